package frontend

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// Picking. Every worker the front end sends a request to is chosen here,
// by a picker of its role (the workers that generate, the prefill
// workers): the role's routing pipeline over its pool, the request's LoRA
// adapter (its holders, or a load), the decision's timing, and the start
// of the attempt through the worker's breaker, which picks again when the
// breaker refuses between the pick and the call. The generating role adds
// the capacity kept per worker and the queue (exchange.decide).

// A picker picks the workers of one role.
type picker struct {
	s    *Server
	pool *pool.Pool
	// lora routes requests for LoRA adapters among the pool's workers
	// (nil: no adapters are served).
	lora *loader
	// released is the Attempt hook run once a worker's slot is released.
	released func()
}

// choice is a picked worker, before its attempt starts.
type choice struct {
	d routing.Decision
	// unpin ends the pin of the request's adapter on d.Worker; never nil.
	unpin func()
	// adapter is how the adapter was found on d.Worker, "held" or
	// "loaded"; empty for a base model.
	adapter string
}

func noUnpin() {}

// cpuSampleEvery is how many decisions share one reading of the deciding
// thread's CPU time: each reading is two system calls (the clock of a
// thread has no vDSO path), a few per cent of a short request's time in
// baton, and a sample of one decision in eight describes them all.
const cpuSampleEvery = 8

// pick runs strategy's pipeline for x's request over the pool's current
// members, skipping tried and, with capacity, the workers at the
// configured MaxInFlight (routing.ErrFull when all are); with avoid, it
// first skips those too, which serve only when nothing else can. A
// request for an adapter then goes to a worker holding it (loader.route),
// pinned there until the attempt ends.
func (p *picker) pick(x *exchange, strategy routing.Strategy, tried, avoid []*pool.Worker, capacity bool) (choice, error) {
	if p.s.beforePick != nil {
		p.s.beforePick()
	}
	snap := p.pool.Snapshot()
	r := x.rreq
	r.Tried, r.MaxInFlight = tried, 0
	if capacity {
		r.MaxInFlight = p.s.cfg.MaxInFlight
	}
	obs := p.s.timersFor(strategy.Name())
	var cpu0 time.Duration
	var tid0 int
	cpuOK := false
	sampled := p.s.cpuTicks.Add(1)%cpuSampleEvery == 1 || p.s.cpuRetry.Load()
	if sampled {
		cpu0, tid0, cpuOK = threadCPU()
	}
	t0 := time.Now()
	var d routing.Decision
	var err error
	if len(avoid) > 0 {
		r.Tried = append(slices.Clip(tried), avoid...)
		d, err = strategy.Pick(r, snap)
		r.Tried = tried
		if err != nil {
			d, err = strategy.Pick(r, snap)
		}
	} else {
		d, err = strategy.Pick(r, snap)
	}
	wall := time.Since(t0)
	if cpuOK {
		cpu1, tid1, ok := threadCPU()
		read := ok && tid1 == tid0
		if read {
			obs.cpu.Observe((cpu1 - cpu0).Seconds())
		}
		if read == p.s.cpuRetry.Load() {
			p.s.cpuRetry.Store(!read)
		}
	}
	obs.wall.Observe(wall.Seconds())
	c := choice{d: d, unpin: noUnpin}
	if r.Adapter != "" && p.lora != nil {
		var end func()
		c.d, c.adapter, end, err = p.lora.route(x.ctx, r, strategy, d, err)
		if end != nil {
			c.unpin = end
		}
	}
	return c, err
}

// startOpts are what a role adds to start.
type startOpts struct {
	// avoid and capacity: see picker.pick.
	avoid    []*pool.Worker
	capacity bool
	// accept, if set, passes over workers it refuses (a prefill engine
	// that does not speak the decode engine's protocol), as if tried.
	accept func(*pool.Worker) bool
	// full is called when every worker is at capacity (routing.ErrFull):
	// the request waits for one. Nil: ErrFull is returned.
	full func() (choice, error)
}

// start picks a worker by strategy, skipping those in *tried, and starts
// the request's attempt on it (routing.Start), committing the decision.
// A worker whose breaker refuses the call is added to *tried and the pick
// runs again. It returns the attempt and how the adapter was found; on
// error nothing is committed and no pin is left.
func (p *picker) start(x *exchange, strategy routing.Strategy, tried *[]*pool.Worker, o startOpts) (*routing.Attempt, string, error) {
	for {
		c, err := p.pick(x, strategy, *tried, o.avoid, o.capacity)
		if errors.Is(err, routing.ErrFull) && o.full != nil {
			c, err = o.full()
		}
		if err != nil {
			return nil, "", err
		}
		wk := c.d.Worker
		if o.accept != nil && !o.accept(wk) {
			c.unpin()
			*tried = append(*tried, wk)
			continue
		}
		att, err := routing.Start(strategy, x.rreq, c.d, routing.Hooks{Unpin: c.unpin, Released: p.released})
		if err != nil {
			// The breaker refused between the pick and the call.
			*tried = append(*tried, wk)
			if len(*tried) > len(p.pool.Snapshot().Workers) {
				return nil, "", routing.ErrNoWorker
			}
			continue
		}
		m := p.s.metrics
		m.Decisions.WithLabelValues(strategy.Name(), c.d.Reason.String()).Inc()
		if c.d.Spill && c.d.Home != nil {
			m.Spills.WithLabelValues(strategy.Name(), c.d.Home.Name).Inc()
		}
		return att, c.adapter, nil
	}
}

// decide picks the worker that generates x's request and starts its
// attempt: the generating strategy's pick among the workers with room,
// else a wait in the queue (or, without one, the least-loaded worker).
func (x *exchange) decide(ctx context.Context) (*routing.Attempt, error) {
	s := x.s
	strategy := x.genStrategy()
	avoid := x.pairOnly(s.pool.Snapshot())
	att, how, err := s.gen.start(x, strategy, &x.tried, startOpts{
		avoid:    avoid,
		capacity: true,
		full:     func() (choice, error) { return x.wait(ctx, strategy, avoid) },
	})
	if err != nil {
		if x.dz != nil && errors.Is(err, engine.ErrUnknownModel) && s.loraPrefill.servable(s.lora.byName[x.rreq.Adapter]) {
			// Prefill workers could take it, but no decode worker can,
			// and they do not decode.
			err = fmt.Errorf("%w %s: no decode worker holds it or can load it, and prefill workers do not decode", errNoAdapterWorker, x.rreq.Adapter)
		}
		return nil, err
	}
	x.att, x.adapter = att, how
	d := att.Decision()
	x.worker = d.Worker.Name
	x.predicted = -1
	if x.dz == nil && s.usesKeys {
		x.predicted = d.PredictedCached
	}
	return att, nil
}

// wait is called when every worker that could serve the request is at
// capacity (MaxInFlight): the request waits in the scheduler's bounded
// queue, picking again each time a worker frees up. A full queue or a
// wait past QueueTimeout is a 429. Without a queue, the least-loaded
// worker takes the request at once. Its picks skip avoid first, as the
// first pick did.
func (x *exchange) wait(ctx context.Context, strategy routing.Strategy, avoid []*pool.Worker) (choice, error) {
	s := x.s
	if s.queue == nil {
		return s.gen.pick(x, s.fallback, x.tried, avoid, false)
	}
	select {
	case s.queue <- struct{}{}:
	default:
		s.metrics.QueueRejections.WithLabelValues("full").Inc()
		return choice{}, errOverloaded
	}
	defer func() { <-s.queue }()
	s.metrics.QueueDepth.Inc()
	defer s.metrics.QueueDepth.Dec()
	timer := time.NewTimer(s.cfg.QueueTimeout)
	defer timer.Stop()
	for {
		freed := s.freedChan()
		c, err := s.gen.pick(x, strategy, x.tried, avoid, true)
		if !errors.Is(err, routing.ErrFull) {
			return c, err
		}
		select {
		case <-freed:
		case <-timer.C:
			s.metrics.QueueRejections.WithLabelValues("timeout").Inc()
			return choice{}, errOverloaded
		case <-ctx.Done():
			return choice{}, ctx.Err()
		}
	}
}

// released wakes requests waiting in the queue: a worker has one request
// fewer in flight.
func (s *Server) released() {
	s.freedMu.Lock()
	if s.freedTaken {
		close(s.freed)
		s.freed = make(chan struct{})
		s.freedTaken = false
	}
	s.freedMu.Unlock()
}

func (s *Server) freedChan() <-chan struct{} {
	s.freedMu.Lock()
	defer s.freedMu.Unlock()
	s.freedTaken = true
	return s.freed
}

// pairOnly returns, for a disaggregated request whose prompt is shorter
// than MinRemoteTokens, the workers of snap that cannot serve it alone:
// SGLang decode engines (--disaggregation-mode decode), which only ever
// decode what a paired prefill engine sends them. vLLM decode engines and
// baton workers prefill short prompts themselves.
func (x *exchange) pairOnly(snap *pool.Snapshot) []*pool.Worker {
	if x.dz == nil || blockkey.Tokens(blockkey.Chars(x.req.Prompt)) >= x.dz.MinRemoteTokens {
		return nil
	}
	var out []*pool.Worker
	for _, w := range snap.Workers {
		if !handoffOf(w).alone() {
			out = append(out, w)
		}
	}
	return out
}

// startPrefill picks a prefill worker by the prefill strategy among those
// that accept passes, skipping tried, and starts its attempt. A request
// for a LoRA adapter is prefilled by a worker holding it, as it is decoded
// by one: the adapter is loaded onto a prefill worker when none holds it
// or all are busy (loader.route, one load however many requests wait),
// and pinned there until the attempt ends. A request no prefill worker
// can take now (errPrefillAdapter) does not wait for one: its decode
// worker, which holds the adapter, prefills it.
func (x *exchange) startPrefill(tried *[]*pool.Worker, accept func(*pool.Worker) bool) (*routing.Attempt, error) {
	s := x.s
	att, how, err := s.prefill.start(x, s.strategy, tried, startOpts{accept: accept})
	x.prefillAdapter = how
	if err != nil {
		if x.rreq.Adapter != "" && s.loraPrefill != nil {
			err = fmt.Errorf("%w: %w", errPrefillAdapter, err)
		}
		return nil, err
	}
	x.route = att.Decision().RouteHit(s.strategy.Name(), x.rreq.Tokens)
	return att, nil
}
