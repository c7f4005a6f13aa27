package vsim

import (
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/sim"
)

// nsNone is the namespace of every block: the fleet has no shared tier
// to write them to.
var nsNone transfer.Namespace

// seq is one sequence on a simulated engine: a generating one
// (colocated or decode) or a prefill-only one.
type seq struct {
	sim.Seq
	req *request
	gen int // tokens it generates (0: prefill only)
	// prefilled is called, for a prefill-only sequence, when its prompt is
	// computed; its blocks stay referenced until released.
	prefilled func(s *seq, now float64)
}

// engine is one simulated worker on the virtual clock: workers/sim's
// Batch, stepped by events instead of a goroutine and a wall clock.
type engine struct {
	sim   *Sim
	name  string
	cfg   sim.Config // defaults applied
	cache *sim.Cache
	batch *sim.Batch[*seq]
	busy  bool // a step is in flight

	// Load as the engine reports it: on a ticker of period
	// cfg.LoadInterval and phase phase (seconds), when it changed.
	reported kvindex.Load
	phase    float64
	ticking  bool // a tick is scheduled
	evSeq    uint64
	watched  bool
	steps    int64
}

func newEngine(s *Sim, name string, cfg sim.Config, cm sim.CostModel, gpu, cpu int64, phase float64) *engine {
	e := &engine{sim: s, name: name, cfg: cfg, phase: phase, watched: s.usesKeys}
	e.cache = sim.NewTieredCache(sim.CacheConfig{GPUBlocks: gpu, CPUBlocks: cpu, Emit: e.emit})
	e.batch = sim.NewBatch(cfg.Batching, cm, e.cache, s.figures.CPUCopySeconds, sim.Hooks[*seq]{
		Admitted:  e.admitted,
		Prefilled: func(q *seq) { q.prefilled(q, e.sim.now) },
		Token:     e.token,
	})
	return e
}

// enqueue hands s to the engine, which plans a step at once if idle.
func (e *engine) enqueue(s *seq, now float64) {
	e.batch.Enqueue(s)
	if !e.busy {
		e.plan(now)
	}
	e.changed(now)
}

// wake plans a step if the engine is idle and has work (blocks were
// released that the head of the queue may be waiting for).
func (e *engine) wake(now float64) {
	if !e.busy && len(e.batch.Queue)+len(e.batch.Run) > 0 {
		e.plan(now)
	}
	e.changed(now)
}

// plan schedules one step and its completion event, or leaves the engine
// idle when nothing can run.
func (e *engine) plan(now float64) {
	e.changed(now)
	st := e.batch.Schedule()
	if st.Batch == 0 {
		e.busy = false
		return
	}
	e.busy = true
	e.steps++
	e.sim.at(now+st.Seconds, func(t float64) {
		e.batch.Complete()
		e.plan(t)
	})
}

// admitted reports a generating sequence's cached tokens to its request.
func (e *engine) admitted(s *seq, _ sim.Hits) {
	if !s.PrefillOnly {
		s.req.setCached(s.Cached)
	}
}

// token records s's latest token, and ends s after its last.
func (e *engine) token(s *seq) (done bool) {
	now := e.sim.now
	s.req.token(now)
	if s.Generated < s.gen {
		return false
	}
	e.batch.Release(s)
	s.req.finish(now)
	return true
}
