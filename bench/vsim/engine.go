package vsim

import (
	"slices"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/sim"
)

// nsNone is the namespace of every block: the fleet has no shared tier
// to write them to.
var nsNone transfer.Namespace

// seq is one sequence on a simulated engine, as workers/sim's: a
// generating one (colocated or decode) or a prefill-only one.
type seq struct {
	req    *request
	keys   []uint64
	prompt int   // prompt tokens
	gen    int   // tokens it generates (0: prefill only)
	blocks int64 // blocks it needs in all
	// transferred: a decode after a remote prefill; its leading blocks
	// were pushed, not reused here.
	transferred bool

	hits, held int
	reserved   int64
	cached     int // prompt tokens reported cached
	computed   int
	chunk      int
	decode     bool
	generated  int

	queued, admitted float64
	// prefilled is called, for a prefill-only sequence, when its prompt is
	// computed; its blocks stay referenced until release.
	prefilled func(s *seq, now float64)
}

// engine is one simulated worker's step loop on the virtual clock:
// workers/sim.Engine's schedule and complete over the same Cache and cost
// model, without goroutines or a wall clock.
type engine struct {
	sim   *Sim
	name  string
	cfg   sim.Config // defaults applied
	cost  sim.CostModel
	pcie  func(blocks int) float64
	cache *sim.Cache
	queue []*seq
	run   []*seq
	busy  bool // a step is in flight

	// Load as the engine reports it: on a ticker of period
	// cfg.LoadInterval and phase phase (seconds), when it changed.
	waitingPrefill int64
	reported       kvindex.Load
	phase          float64
	ticking        bool // a tick is scheduled
	evSeq          uint64
	watched        bool
	steps          int64
}

// enqueue hands s to the step loop, which plans a step at once if idle.
func (e *engine) enqueue(s *seq, now float64) {
	s.queued = now
	e.waitingPrefill += int64(s.prompt)
	e.queue = append(e.queue, s)
	if !e.busy {
		e.plan(now)
	}
	e.changed(now)
}

// wake plans a step if the engine is idle and has work (blocks were
// released that the head of the queue may be waiting for).
func (e *engine) wake(now float64) {
	if !e.busy && len(e.queue)+len(e.run) > 0 {
		e.plan(now)
	}
	e.changed(now)
}

// plan schedules one step and its completion event, or leaves the engine
// idle when nothing can run.
func (e *engine) plan(now float64) {
	e.changed(now)
	dt, batch := e.schedule(now)
	if batch == 0 {
		e.busy = false
		return
	}
	e.busy = true
	e.steps++
	e.sim.at(now+dt, func(t float64) {
		e.complete(t)
		e.plan(t)
	})
}

// schedule is workers/sim's: running sequences first (a decode token each,
// or their next prefill chunk), then waiting ones in arrival order while
// they fit in MaxRunning, the cache and the token budget.
func (e *engine) schedule(now float64) (seconds float64, batch int) {
	budget := e.cfg.Batching.MaxBatchedTokens
	decodes, decodeCtx := 0, 0
	prefill := 0.0
	for _, s := range e.run {
		s.chunk, s.decode = 0, false
		if budget == 0 {
			continue
		}
		if s.computed >= s.prompt {
			s.decode = true
			decodes++
			decodeCtx += s.prompt + s.generated
			budget--
			continue
		}
		s.chunk = min(s.prompt-s.computed, budget)
		budget -= s.chunk
		prefill += e.cost.PrefillSeconds(s.chunk, s.computed)
	}
	admitted, promoted := 0, 0
	for _, s := range e.queue {
		if budget == 0 || len(e.run) >= e.cfg.Batching.MaxRunning {
			break
		}
		h, ok := e.cache.Acquire(nsNone, s.keys, s.blocks-int64(len(s.keys)))
		if !ok {
			break // first come, first served
		}
		s.hits, s.held = h.N, h.N
		s.admitted = now
		s.reserved = s.blocks - int64(h.N)
		s.cached = min(h.N*sim.BlockTokens, s.prompt-1)
		if s.gen > 0 {
			s.req.setCached(s.cached)
		}
		promoted += h.CPU
		e.waitingPrefill -= int64(s.cached)
		s.computed = s.cached
		s.chunk, s.decode = min(s.prompt-s.computed, budget), false
		budget -= s.chunk
		prefill += e.cost.PrefillSeconds(s.chunk, s.computed)
		e.run = append(e.run, s)
		admitted++
	}
	if admitted > 0 {
		clear(e.queue[:admitted])
		e.queue = e.queue[admitted:]
	}
	for _, s := range e.run {
		if s.chunk > 0 || s.decode {
			batch++
		}
	}
	if batch == 0 {
		return 0, 0
	}
	return e.cost.DecodeStepSeconds(decodes, decodeCtx) + prefill + e.pcie(promoted), batch
}

// complete applies the step at now: prefill chunks enter the cache, and
// every sequence that finished its prefill or decoded emits a token.
func (e *engine) complete(now float64) {
	e.run = slices.DeleteFunc(e.run, func(s *seq) bool {
		if s.chunk > 0 {
			s.computed += s.chunk
			e.waitingPrefill -= int64(s.chunk)
			if full := min(len(s.keys), s.computed/sim.BlockTokens); full > s.held {
				e.cache.Commit(nsNone, s.keys[s.held:full])
				s.reserved -= int64(full - s.held)
				s.held = full
			}
			if s.computed < s.prompt {
				return false
			}
			if s.gen == 0 { // prefill only: hand the blocks over
				e.cache.Release(nil, s.reserved)
				s.reserved = 0
				s.prefilled(s, now)
				return true
			}
		} else if !s.decode {
			return false
		}
		s.generated++
		s.req.token(now)
		if s.generated >= s.gen {
			e.cache.Release(s.keys[:s.held], s.reserved)
			s.held, s.reserved = 0, 0
			s.req.finish(now)
			return true
		}
		return false
	})
}
