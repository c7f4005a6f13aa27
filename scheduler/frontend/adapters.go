package frontend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/openai"
)

// Adapters configures the LoRA adapters the fleet serves as models of
// their own names.
type Adapters struct {
	// List are the adapters; each Base is a model workers serve.
	List []engine.Adapter
	// Threshold is the requests in flight past which a holder counts as
	// busy, so that the adapter is loaded onto one more worker. 0:
	// routing.DefaultConcurrencyThreshold.
	Threshold int
	// LoadTimeout bounds one load on one worker. 0: DefaultLoadTimeout.
	LoadTimeout time.Duration
}

// DefaultLoadTimeout bounds an adapter load by default: vLLM reads an
// adapter of a few hundred MB from local disk in seconds, from a remote
// repository in tens of them.
const DefaultLoadTimeout = time.Minute

// WithAdapters has the server serve the LoRA adapters of a: a request for
// one goes to a worker that holds it, or, when none does or they are all
// busy, to one the adapter is loaded onto.
func WithAdapters(a Adapters) Option {
	return func(s *Server) {
		if len(a.List) == 0 {
			return
		}
		if a.Threshold <= 0 {
			a.Threshold = routing.DefaultConcurrencyThreshold
		}
		if a.LoadTimeout <= 0 {
			a.LoadTimeout = DefaultLoadTimeout
		}
		l := &loader{cfg: a, byName: make(map[string]engine.Adapter, len(a.List)), loads: make(map[string]*adapterLoad)}
		for _, ad := range a.List {
			l.byName[ad.Name] = ad
		}
		s.lora = l
	}
}

// loader routes requests for adapters and loads them onto the workers of
// one pool: one load of an adapter at a time, which every request needing
// it waits for.
type loader struct {
	cfg     Adapters
	byName  map[string]engine.Adapter
	metrics *metrics.Adapters
	pool    *pool.Pool
	log     *slog.Logger
	// freed is called when a loaded adapter's pin ends without a request
	// ending (every request that waited for the load went elsewhere):
	// requests queued for a slot may take it.
	freed func()

	mu    sync.Mutex
	loads map[string]*adapterLoad // adapter → its load in progress
}

// adapterLoad is a load in progress; w and err are set before done is
// closed. The adapter it loaded stays pinned on w (unpin) until every
// request that waited for it has been routed, pinning its own choice, or
// gave up: no other load evicts it before they reach it.
type adapterLoad struct {
	done    chan struct{}
	w       *pool.Worker
	err     error
	waiters int    // requests waiting for it or routing after it; l.mu
	ended   bool   // the load ended; l.mu
	unpin   func() // the loaded adapter's pin, nil once released; l.mu
}

// errNoAdapterWorker: no worker can take the adapter (503).
var errNoAdapterWorker = errors.New("no worker can load the adapter")

// errSlotsBusy: a worker could take the adapter, but every one of its
// slots holds an adapter serving requests, which is never unloaded, or is
// being loaded. It is routing.ErrFull, so the request waits in the queue
// for one to go idle, and errNoAdapterWorker (503) where there is no
// queue.
var errSlotsBusy = fmt.Errorf("%w: every slot's adapter serves requests: %w", errNoAdapterWorker, routing.ErrFull)

// parents returns each adapter's base model, for /v1/models.
func (l *loader) parents() map[string]string {
	if l == nil {
		return nil
	}
	p := make(map[string]string, len(l.byName))
	for n, a := range l.byName {
		p[n] = a.Base
	}
	return p
}

// pinTries bounds the picks a request makes when the holder it picked
// stops holding the adapter before the request pins it there.
const pinTries = 3

// route completes the pick of req, a request for an adapter: d and err
// are the strategy's, among the holders req has not tried (and, for
// profiles that count loads, the workers it could load onto). When the
// strategy chose a worker without the adapter, no holder is available, or
// all are past the threshold, it loads the adapter (onto the chosen
// worker, else another) and picks again among the holders. It returns how
// the adapter was found, "held" or "loaded", and the adapter's pin on the
// worker picked (pool.Worker.PinAdapter), which the caller ends once the
// request is done with the worker: no load evicts the adapter under it.
func (l *loader) route(ctx context.Context, req *routing.Request, strategy routing.Strategy, d routing.Decision, err error) (routing.Decision, string, func(), error) {
	for try := 1; ; try++ {
		rd, how, leave, rerr := l.route1(ctx, req, strategy, d, err)
		if rerr != nil {
			leave()
			return rd, "", nil, rerr
		}
		end, ok := rd.Worker.PinAdapter(req.Adapter)
		leave()
		if ok {
			rd.Worker.TouchAdapter(req.Adapter)
			return rd, how, end, nil
		}
		if try == pinTries {
			// Evicted under each pick: wait for the loads to settle.
			return rd, "", nil, fmt.Errorf("adapter %s: evicted from each worker picked: %w", req.Adapter, routing.ErrFull)
		}
		// A load of another adapter evicted it since the pick.
		d, err = strategy.Pick(req, l.pool.Snapshot())
	}
}

// route1 is route's pick without the pin: leave, which the caller calls
// once it pinned its choice or gave up, ends its wait for a load.
func (l *loader) route1(ctx context.Context, req *routing.Request, strategy routing.Strategy, d routing.Decision, err error) (routing.Decision, string, func(), error) {
	a := l.byName[req.Adapter]
	var prefer *pool.Worker
	switch {
	case err == nil && !d.Worker.HoldsAdapter(a.Name):
		prefer = d.Worker // kv_aware found the load worth its time
	case err == nil && !l.busy(req):
		return d, "held", noLeave, nil
	}
	if err != nil && !errors.Is(err, routing.ErrNoWorker) && !errors.Is(err, routing.ErrFull) {
		return d, "", noLeave, err
	}
	if err != nil && !l.servable(a) {
		// No worker holds it nor could load it (llama-server has no
		// load API): the model does not exist, as an engine would say.
		return d, "", noLeave, fmt.Errorf("adapter %s: no worker holds it or loads adapters: %w", a.Name, engine.ErrUnknownModel)
	}
	// The picks that follow a load choose among the holders only.
	defer func(load bool) { req.LoadAdapter = load }(req.LoadAdapter)
	req.LoadAdapter = false
	w, leave, lerr := l.ensure(ctx, a, req.Tried, prefer)
	if lerr != nil && prefer != nil {
		// The chosen worker failed to load it; holders may serve still.
		if d, err = strategy.Pick(req, l.pool.Snapshot()); err == nil {
			return d, "held", leave, nil
		}
		if errors.Is(err, routing.ErrFull) {
			return d, "", leave, err // the holders are at capacity: wait for them
		}
		return d, "", leave, lerr
	}
	if lerr != nil {
		if err == nil || errors.Is(err, routing.ErrFull) {
			// Busy holders still serve, or the request queues for them.
			return d, "held", leave, err
		}
		return d, "", leave, lerr
	}
	d, err = strategy.Pick(req, l.pool.Snapshot())
	if err != nil {
		return d, "", leave, err
	}
	if d.Worker == w {
		return d, "loaded", leave, nil
	}
	return d, "held", leave, nil
}

func noLeave() {}

// servable reports whether some worker, available or not, holds a or
// could load it.
func (l *loader) servable(a engine.Adapter) bool {
	for _, w := range l.pool.Snapshot().Workers {
		if w.HoldsAdapter(a.Name) || w.AdapterSlots() > 0 && w.Serves(a.Base) {
			return true
		}
	}
	return false
}

// busy reports whether every available holder of the request's adapter
// it has not tried is past the threshold.
func (l *loader) busy(req *routing.Request) bool {
	for _, w := range l.pool.Snapshot().Workers {
		if w.HoldsAdapter(req.Adapter) && w.Available() && !slices.Contains(req.Tried, w) && w.InFlight() < l.cfg.Threshold {
			return false
		}
	}
	return true
}

// ensure returns a worker a was loaded onto for this request: by the load
// in progress, or by a new one (onto prefer if it can take a) unless,
// with no prefer, a holder has room by now. It waits for the load until
// ctx ends; the load goes on without it, since others may be waiting for
// it, bounded by LoadTimeout a worker. The caller calls leave once it
// pinned the worker it routes to, or gave up: the loaded adapter stays
// pinned until every request that waited for it did.
func (l *loader) ensure(ctx context.Context, a engine.Adapter, tried []*pool.Worker, prefer *pool.Worker) (w *pool.Worker, leave func(), err error) {
	l.mu.Lock()
	ld := l.loads[a.Name]
	if ld == nil {
		if prefer == nil && !l.busy(&routing.Request{Adapter: a.Name, Tried: tried}) {
			// A load ended between the pick and here.
			l.mu.Unlock()
			return nil, noLeave, nil
		}
		ld = &adapterLoad{done: make(chan struct{})}
		l.loads[a.Name] = ld
		go func() {
			w, unpin, err := l.load(context.WithoutCancel(ctx), a, slices.Clone(tried), prefer)
			l.mu.Lock()
			delete(l.loads, a.Name)
			ld.w, ld.err, ld.unpin, ld.ended = w, err, unpin, true
			l.unpinIdle(ld)
			l.mu.Unlock()
			close(ld.done)
		}()
	}
	ld.waiters++
	l.mu.Unlock()
	var once sync.Once
	leave = func() {
		once.Do(func() {
			l.mu.Lock()
			ld.waiters--
			l.unpinIdle(ld)
			l.mu.Unlock()
		})
	}
	l.metrics.Waiting.Inc()
	defer l.metrics.Waiting.Dec()
	select {
	case <-ld.done:
		return ld.w, leave, ld.err
	case <-ctx.Done():
		leave()
		return nil, noLeave, ctx.Err()
	}
}

// unpinIdle releases the pin of ld's adapter once the load ended and no
// request waits for it or is routing after it. l.mu is held.
func (l *loader) unpinIdle(ld *adapterLoad) {
	if !ld.ended || ld.waiters > 0 || ld.unpin == nil {
		return
	}
	ld.unpin()
	ld.unpin = nil
	if l.freed != nil {
		l.freed()
	}
}

// load loads a onto prefer, if it can take it, else the best worker that
// can and is not in failed, and onto the next when that fails;
// LoadTimeout bounds each try. It returns the worker and the loaded
// adapter's pin there (pool.Worker.EndAdapterLoad).
func (l *loader) load(base context.Context, a engine.Adapter, failed []*pool.Worker, prefer *pool.Worker) (*pool.Worker, func(), error) {
	var lastErr error
	// taken are the workers whose last slot another load took between
	// the choice of the worker and its reservation: busy, not failed.
	var taken []*pool.Worker
	for {
		skip := append(slices.Clip(failed), taken...)
		w := l.target(a, skip)
		if prefer != nil && l.canLoad(prefer, a, skip) {
			w = prefer
		}
		if w == nil {
			if lastErr != nil {
				return nil, nil, fmt.Errorf("%w %s: %w", errNoAdapterWorker, a.Name, &clientSafe{"its load failed", lastErr})
			}
			if l.slotsBusy(a, failed) {
				return nil, nil, fmt.Errorf("adapter %s: %w", a.Name, errSlotsBusy)
			}
			if !l.baseAvailable(a) {
				// Not the adapter's doing: no worker of its base
				// model is available at all.
				return nil, nil, fmt.Errorf("adapter %s: %w", a.Name, routing.ErrNoWorker)
			}
			return nil, nil, fmt.Errorf("%w %s", errNoAdapterWorker, a.Name)
		}
		victim, ok := w.ReserveAdapter(a.Name)
		if !ok {
			taken = append(taken, w)
			continue
		}
		lctx, cancel := context.WithTimeout(base, l.cfg.LoadTimeout)
		t0 := time.Now()
		err := l.loadOn(lctx, w, a, victim)
		cancel()
		took := time.Since(t0)
		l.metrics.LoadSeconds.Observe(took.Seconds())
		if _, api := w.Client.(engine.AdapterLoader); api && err == nil {
			w.ObserveAdapterLoad(took) // for kv_aware's estimates
		}
		unpin := w.EndAdapterLoad(a.Name, err == nil)
		if err == nil {
			l.metrics.Loads.WithLabelValues(w.Name, a.Name, "ok").Inc()
			return w, unpin, nil
		}
		l.metrics.Loads.WithLabelValues(w.Name, a.Name, "failed").Inc()
		l.log.Warn("adapter load failed", "worker", w.Name, "adapter", a.Name, "err", err)
		failed = append(failed, w)
		lastErr = err
	}
}

// target is the worker to load a onto: available, serving a's base, not
// holding it, not in skip, allowed adapters (AdapterSlots); one with a free
// slot first, then the one with fewest requests in flight.
func (l *loader) target(a engine.Adapter, skip []*pool.Worker) *pool.Worker {
	var best *pool.Worker
	bestFree := false
	for _, w := range l.pool.Snapshot().Workers {
		if !l.canLoad(w, a, skip) {
			continue
		}
		free := w.AdapterSlotFree()
		if best == nil || (free && !bestFree) || (free == bestFree && w.InFlight() < best.InFlight()) {
			best, bestFree = w, free
		}
	}
	return best
}

// canLoad reports whether a may be loaded onto w: it has adapter slots,
// is available, serves a's base, does not hold a, is not in skip, and has
// a free slot or an idle adapter to evict.
func (l *loader) canLoad(w *pool.Worker, a engine.Adapter, skip []*pool.Worker) bool {
	return w.AdapterSlots() > 0 && w.Available() && w.Serves(a.Base) && !w.HoldsAdapter(a.Name) && !slices.Contains(skip, w) &&
		w.CanTakeAdapter(a.Name)
}

// baseAvailable reports whether any available worker serves a's base
// model.
func (l *loader) baseAvailable(a engine.Adapter) bool {
	for _, w := range l.pool.Snapshot().Workers {
		if w.Available() && w.Serves(a.Base) {
			return true
		}
	}
	return false
}

// slotsBusy reports whether a worker not in skip could load a but for its
// slots, each holding an adapter with requests in flight or being
// loaded: one will take a once those end.
func (l *loader) slotsBusy(a engine.Adapter, skip []*pool.Worker) bool {
	for _, w := range l.pool.Snapshot().Workers {
		if w.AdapterSlots() > 0 && w.Available() && w.Serves(a.Base) && !w.HoldsAdapter(a.Name) && !slices.Contains(skip, w) {
			return true
		}
	}
	return false
}

// loadOn loads a onto w, into the slot ReserveAdapter took, first
// unloading victim, the adapter that held it, if any (the worker stopped
// holding it when the slot was taken; should the unload fail, the engine's
// next report says it still holds it). Engines without a load API load on
// the first request.
func (l *loader) loadOn(ctx context.Context, w *pool.Worker, a engine.Adapter, victim string) error {
	ld, api := w.Client.(engine.AdapterLoader)
	if victim != "" {
		if api {
			if err := ld.UnloadAdapter(ctx, victim); err != nil {
				return err
			}
		}
		l.metrics.Evictions.WithLabelValues(w.Name).Inc()
	}
	if !api {
		return nil
	}
	return ld.LoadAdapter(ctx, a)
}

// adapterError is the client's answer when no worker could take the
// adapter.
func adapterError(err error) *openai.Error {
	return openai.NoWorker(err.Error())
}
