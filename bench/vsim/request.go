package vsim

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/batonllm/baton/bench"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/sim"
)

var errTooLong = errors.New("prompt exceeds the worker's KV capacity")

// request is one request's life in the fleet: the coordinator's part.
type request struct {
	s       *Sim
	out     *bench.Result
	rreq    *routing.Request
	arrival float64
	last    float64 // time of the latest token
	// gen is the strategy that picks the generating worker, att its
	// attempt there.
	gen routing.Strategy
	att *routing.Attempt
	// reused is the prompt tokens a remote prefill reused (its cached
	// tokens or the decode worker's held ones), -1 without one.
	reused int
}

// arrive routes request i, which arrived at arrival, at s.now, as the
// scheduler's coordinator does.
func (s *Sim) arrive(i int, wr *workload.Request, seed uint64, out *bench.Result, arrival float64) {
	text := wr.RoutingText()
	keys := blockkey.Append(nil, seed, text, blockkey.DefaultBlockChars)
	prompt := blockkey.Tokens(blockkey.Chars(text))
	r := &request{s: s, out: out, arrival: arrival, reused: -1,
		rreq: &routing.Request{Model: s.cfg.Model, PrefixKey: blockkey.Prefix(seed, text, s.prefixLen)}}
	if s.usesKeys {
		r.rreq.Keys, r.rreq.Tokens = keys, prompt
	}
	out.Index, out.PromptTokens = i, prompt
	limit := wr.MaxTokens
	if limit == 0 {
		limit = s.defaultMax
	}
	gen := min(limit, sim.NaturalLength(text))

	// Request i is decided by replica i mod their number, as the bench's
	// client sends it.
	v := s.views[i%len(s.views)]
	r.gen = v.strategy
	if s.cfg.Disaggregated() {
		r.gen = v.decode
	}
	// The front end's capacity per worker; when every worker is at it the
	// scheduler queues the request, which is not modelled: it goes to the
	// pick without capacity, as without a queue.
	r.rreq.MaxInFlight = frontend.DefaultMaxInFlight
	d, err := r.gen.Pick(r.rreq, v.pool.Snapshot())
	if errors.Is(err, routing.ErrFull) {
		r.rreq.MaxInFlight = 0
		d, err = r.gen.Pick(r.rreq, v.pool.Snapshot())
	}
	r.rreq.MaxInFlight = 0
	if err != nil {
		out.Err = err.Error()
		return
	}
	wk := d.Worker
	att, err := routing.Start(r.gen, r.rreq, d, routing.Hooks{})
	if err != nil {
		out.Err = err.Error()
		return
	}
	r.att = att
	out.Worker, out.Spill = wk.Name, d.Spill
	out.Route = d.RouteHit(r.gen.Name(), r.rreq.Tokens)
	de := s.engines[wk]
	decode := &seq{req: r, gen: gen, Seq: sim.Seq{Keys: keys, Prompt: prompt,
		Blocks: int64((prompt + gen + sim.BlockTokens - 1) / sim.BlockTokens)}}
	if decode.Blocks > de.cache.Capacity() {
		// The engine refuses it (sim.ErrInvalid): a client error.
		out.Err = fmt.Sprintf("%d prompt and %d completion tokens need %d blocks, capacity %d", prompt, gen, decode.Blocks, de.cache.Capacity())
		att.End(errTooLong, nil)
		return
	}
	local := func() { s.send(r, de, decode) }

	switch {
	case s.cfg.Disaggregated():
		if prompt < s.cfg.MinRemotePrefillTokens {
			local()
			return
		}
		pd, err := v.strategy.Pick(r.rreq, v.prefill.Snapshot())
		if err != nil {
			local()
			return
		}
		patt, err := routing.Start(v.strategy, r.rreq, pd, routing.Hooks{})
		if err != nil {
			local()
			return
		}
		s.remotePrefill(r, pd.Worker, de, decode, func(first time.Duration, skipped bool) {
			patt.FirstToken(first)
			patt.End(nil, nil)
			if !skipped {
				att.Unestimated() // it estimated a local prefill
			}
		})
	case d.Reason == routing.ReasonReplicate && d.Home != nil && d.Home != wk:
		// kv_aware copies a hot prefix from its holder rather than
		// recomputing it on the idle worker.
		hdone, err := d.Home.Acquire()
		if err != nil {
			local()
			return
		}
		att.Unestimated()
		s.remotePrefill(r, d.Home, de, decode, func(time.Duration, bool) { hdone(nil) })
	default:
		local()
	}
}

// remotePrefill prefills r's prompt on pw and pushes the blocks de lacks
// to it, then starts the decode there, as workers/sim's Prefill and the
// coordinator do; when de already holds all but MinRemotePrefillTokens it
// skips, and de prefills locally. ended hears the prefill's first-token
// time (from arrival to the end of the prefill) once the push is done.
func (s *Sim) remotePrefill(r *request, pw *pool.Worker, de *engine, decode *seq, ended func(first time.Duration, skipped bool)) {
	held := de.cache.Holds(decode.Keys)
	lead := 0
	for lead < len(held) && held[lead] {
		lead++
	}
	if decode.Prompt-lead*sim.BlockTokens < s.cfg.MinRemotePrefillTokens {
		ended(0, true)
		s.send(r, de, decode)
		return
	}
	pe := s.engines[pw]
	p := &seq{req: r, Seq: sim.Seq{Keys: decode.Keys, Prompt: decode.Prompt, PrefillOnly: true,
		Blocks: int64((decode.Prompt + sim.BlockTokens - 1) / sim.BlockTokens)}}
	if p.Blocks > pe.cache.Capacity() {
		// The prefill worker refuses it; the decode worker prefills.
		ended(0, true)
		s.send(r, de, decode)
		return
	}
	r.out.PrefillWorker = pw.Name
	p.prefilled = func(p *seq, now float64) {
		var send []uint64
		for i, k := range p.Keys {
			if !held[i] {
				send = append(send, k)
			}
		}
		delay := 0.0
		if s.linkBW > 0 {
			delay = float64(len(send)) * s.kvPerBlock / s.linkBW
		}
		first := time.Duration((now - r.arrival) * float64(time.Second))
		s.at(now+delay, func(now float64) {
			for _, k := range send {
				de.cache.Insert(nsNone, k, false)
			}
			pe.cache.Release(p.Keys[:p.Held], 0)
			p.Held = 0
			pe.wake(now)
			r.reused = min(max(p.Cached, lead*sim.BlockTokens), decode.Prompt)
			ended(first, false)
			// The coordinator's decode call follows at once, over
			// a connection it holds, for a request already parsed
			// and routed: no dispatch delay (Dispatch).
			de.enqueue(decode, now)
		})
	}
	s.send(r, pe, p)
}

// send hands q, of request r, to e's queue once the coordinator's call
// reaches it (Config.Dispatch), at once without a dispatch delay.
func (s *Sim) send(r *request, e *engine, q *seq) {
	var d float64
	switch {
	case s.cfg.dispatchOf != nil:
		d = s.cfg.dispatchOf(r.out.Index).Seconds()
	case s.dispatch != nil:
		d = s.dispatch()
	}
	if d <= 0 {
		e.enqueue(q, s.now)
		return
	}
	s.at(s.now+d, func(now float64) { e.enqueue(q, now) })
}

// token records a token of r at now.
func (r *request) token(now float64) {
	if r.out.CompletionTokens == 0 {
		r.out.TTFT = now - r.arrival
		r.att.FirstToken(time.Duration(r.out.TTFT * float64(time.Second)))
	} else {
		r.out.Gaps = append(r.out.Gaps, now-r.last)
	}
	r.last = now
	r.out.CompletionTokens++
}

// finish ends r at now: its usage, and its worker's in-flight slot.
func (r *request) finish(now float64) {
	r.out.E2E = now - r.arrival
	r.out.Done = now
	r.att.Usage(r.out.PromptTokens, r.out.CachedTokens)
	r.att.End(nil, nil)
}

// setCached records the prompt tokens r's generating worker found cached.
func (r *request) setCached(cached int) {
	if r.reused >= 0 {
		cached = r.reused
	}
	r.out.CachedTokens = cached
}

// emit applies a cache event of e to the KV index, as the watcher does.
func (e *engine) emit(ev sim.CacheEvent) {
	if !e.watched {
		return
	}
	ce := kvindex.CacheEvent{Keys: ev.Keys, Tier: tierOf(ev.Tier)}
	switch ev.Kind {
	case sim.BlockRemoved:
		ce.Kind = kvindex.Removed
	case sim.BlockTierChanged:
		ce.Kind = kvindex.Moved
		if ev.FromTier != 0 {
			ce.From, ce.HasFrom = tierOf(ev.FromTier), true
		}
	}
	e.evSeq++
	e.sim.apply(e.name, kvindex.Event{Seq: e.evSeq, Cache: &ce})
}

func tierOf(t sim.Tier) kvindex.Tier {
	switch t {
	case sim.TierCPU:
		return kvindex.TierCPU
	case sim.TierRedis:
		return kvindex.TierRedis
	}
	return kvindex.TierGPU
}

// load is e's load report.
func (e *engine) load() kvindex.Load {
	return kvindex.Load{Running: len(e.batch.Run), Waiting: len(e.batch.Queue), WaitingPrefillTokens: e.batch.WaitingPrefill(),
		GPUBlocksUsed: e.cache.Used(), GPUBlocksTotal: e.cache.Capacity(),
		CPUBlocksUsed: e.cache.CPUUsed(), CPUBlocksTotal: e.cache.CPUCapacity()}
}

// changed notes that e's load may have changed at now: the engine's next
// tick reports it if so. workers/sim publishes its load on a ticker, so
// that a worker going idle says so within LoadInterval, however long
// ago its last report was; the ticks are modelled only while something
// changes.
func (e *engine) changed(now float64) {
	if !e.watched || e.ticking {
		return
	}
	e.ticking = true
	next := now
	if iv := e.cfg.LoadInterval.Seconds(); iv > 0 {
		next = e.phase + (math.Floor((now-e.phase)/iv)+1)*iv
	}
	e.sim.at(next, func(float64) {
		e.ticking = false
		if l := e.load(); l != e.reported {
			e.reported = l
			e.evSeq++
			e.sim.apply(e.name, kvindex.Event{Seq: e.evSeq, Load: &l})
		}
	})
}
