// Package pool holds the workers a scheduler routes to: their membership,
// health, circuit breakers and in-flight counts.
//
// Membership changes rebuild an immutable Snapshot under a mutex and publish
// it atomically; request goroutines read the current Snapshot without locks.
// Health and breaker state live in each Worker as atomics shared by every
// Snapshot, so they change without a rebuild and without moving keys on the
// Snapshot's ring.
package pool

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/scheduler/internal/ring"
	"github.com/batonllm/baton/workers/engine"
)

// Snapshot is the pool's membership at one moment. It is immutable: never
// modify its slices.
type Snapshot struct {
	// Workers are the pool's workers, sorted by name.
	Workers []*Worker
	// Ring places the workers by name; ring member i is Workers[i]. It
	// depends on membership only, so health and breaker changes do not
	// move keys.
	Ring *ring.Ring

	// names and statuses are Workers' names and statuses, which the
	// methods by position read without reading the Workers.
	names    []string
	statuses []*status
}

// Name returns Workers[i].Name.
func (s *Snapshot) Name(i int) string { return s.names[i] }

// Available returns Workers[i].Available().
func (s *Snapshot) Available(i int) bool { return s.statuses[i].available() }

// InFlight returns Workers[i].InFlight().
func (s *Snapshot) InFlight(i int) int { return int(s.statuses[i].inFlight.Load()) }

// Serves returns Workers[i].Serves(model).
func (s *Snapshot) Serves(i int, model string) bool { return s.statuses[i].serves(model) }

// Worker returns the worker named name, or nil.
func (s *Snapshot) Worker(name string) *Worker {
	i := sort.Search(len(s.Workers), func(i int) bool { return s.Workers[i].Name >= name })
	if i < len(s.Workers) && s.Workers[i].Name == name {
		return s.Workers[i]
	}
	return nil
}

// Option configures a Pool.
type Option func(*Pool)

// OnBreakerChange sets a hook called when a worker's breaker changes state.
// It is called synchronously, with the breaker's lock held, from whichever
// goroutine caused the change: it must not block and must not call the
// worker's Acquire or BreakerState.
func OnBreakerChange(fn func(worker string, from, to gobreaker.State)) Option {
	return func(p *Pool) { p.onBreakerChange = fn }
}

// OnHealthChange sets a hook called when a worker turns healthy or
// unhealthy. It is called from the health-check goroutines and must not
// block.
func OnHealthChange(fn func(worker string, healthy bool)) Option {
	return func(p *Pool) { p.onHealthChange = fn }
}

// OnDescribe sets a hook called when a worker with Discover set describes
// itself for the first time, or differently from the last time. It is
// called from the health-check goroutines, after the worker's check
// passed, and may take the pool's membership lock (Add, Remove, Set) and
// other pools'.
func OnDescribe(fn func(w *Worker, d engine.Description)) Option {
	return func(p *Pool) { p.onDescribe = fn }
}

// Pool is a set of workers and the loop that checks their health. Its
// methods are safe for concurrent use.
type Pool struct {
	cfg             Config
	onBreakerChange func(worker string, from, to gobreaker.State)
	onHealthChange  func(worker string, healthy bool)
	onDescribe      func(w *Worker, d engine.Description)

	mu      sync.Mutex // serializes membership changes
	workers map[string]*Worker
	slab    statusSlab // guarded by mu
	snap    atomic.Pointer[Snapshot]

	checkMu   sync.Mutex // serializes health rounds
	ctx       context.Context
	cancel    context.CancelFunc
	loopDone  chan struct{}
	closeOnce sync.Once
}

// New returns an empty pool and starts its health-check loop, which runs
// until Close. Zero fields of cfg take Default's values.
func New(cfg Config, opts ...Option) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Pool{
		cfg:      cfg.withDefaults(),
		workers:  make(map[string]*Worker),
		loopDone: make(chan struct{}),
	}
	for _, o := range opts {
		o(p)
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.publish()
	go p.healthLoop()
	return p, nil
}

// Close stops the health-check loop and waits for it. It does not close the
// workers' clients. Close is idempotent.
func (p *Pool) Close() error {
	p.closeOnce.Do(func() {
		p.cancel()
		<-p.loopDone
	})
	return nil
}

// Snapshot returns the current membership. It takes no lock and does not
// allocate.
func (p *Pool) Snapshot() *Snapshot { return p.snap.Load() }

// Add adds w to the pool, replacing any worker of the same name. The
// replaced worker's calls in flight still release its own counts.
func (p *Pool) Add(w *Worker) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.adopt(w); err != nil {
		return err
	}
	p.workers[w.Name] = w
	p.publish()
	return nil
}

// Remove removes the worker named name and returns it, or nil if there is
// none. Its calls in flight go on, and it refuses new ones (ErrRemoved);
// the caller closes its client once they end (Worker.Drained).
func (p *Pool) Remove(name string) *Worker {
	p.mu.Lock()
	defer p.mu.Unlock()
	w, ok := p.workers[name]
	if !ok {
		return nil
	}
	delete(p.workers, name)
	p.publish()
	w.retire()
	return w
}

// Set replaces the pool's membership with workers, as service discovery
// reports it. A Worker already in the pool keeps its health, breaker and
// in-flight count; pass the same *Worker to keep them. Workers left out
// are removed as by Remove. Set changes nothing if workers holds an
// invalid worker or a name twice.
func (p *Pool) Set(workers []*Worker) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	next := make(map[string]*Worker, len(workers))
	for _, w := range workers {
		if w == nil {
			return errors.New("nil worker")
		}
		if _, dup := next[w.Name]; dup {
			return fmt.Errorf("worker %q: name given twice", w.Name)
		}
		if err := p.check(w); err != nil {
			return err
		}
		next[w.Name] = w
	}
	for _, w := range workers {
		_ = p.adopt(w) // checked above
	}
	for name, w := range p.workers {
		if next[name] != w {
			defer w.retire() // once the snapshot without it is published
		}
	}
	p.workers = next
	p.publish()
	return nil
}

// check reports whether w can join p. p.mu is held.
func (p *Pool) check(w *Worker) error {
	switch {
	case w == nil:
		return errors.New("nil worker")
	case w.Name == "":
		return errors.New("worker with empty name")
	case w.Client == nil:
		return fmt.Errorf("worker %q: nil client", w.Name)
	case w.pool != nil && w.pool != p:
		return fmt.Errorf("worker %q: belongs to another pool", w.Name)
	}
	return nil
}

// adopt gives w its breaker and marks it healthy the first time it joins
// p. p.mu is held.
func (p *Pool) adopt(w *Worker) error {
	if err := p.check(w); err != nil {
		return err
	}
	if w.pool == p {
		return nil
	}
	w.pool = p
	// The worker's status moves to the pool's slab, its models set, so
	// that the snapshots' methods by position read the slab alone.
	s, own := p.slab.next(), &w.own
	s.inFlight.Store(own.inFlight.Load())
	s.openUntil.Store(own.openUntil.Load())
	s.state.Store(own.state.Load())
	models := w.Models
	if m := own.models.Load(); m != nil {
		models = *m
	}
	s.setModels(models)
	w.st.Store(s)
	w.drained = make(chan struct{})
	timeout := p.cfg.BreakerOpenTimeout
	failures := p.cfg.BreakerFailures
	w.breaker = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        w.Name,
		MaxRequests: p.cfg.BreakerHalfOpenRequests,
		Timeout:     timeout,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.ConsecutiveFailures >= failures
		},
		IsSuccessful: func(err error) bool { return !IsWorkerFault(err) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			w.onBreakerChange(from, to, timeout)
		},
	})
	w.status().healthy.Store(true)
	return nil
}

// publish builds and stores a Snapshot of p.workers. p.mu is held.
func (p *Pool) publish() {
	ws := make([]*Worker, 0, len(p.workers))
	for _, w := range p.workers {
		ws = append(ws, w)
	}
	slices.SortFunc(ws, func(a, b *Worker) int { return cmp.Compare(a.Name, b.Name) })
	names := make([]string, len(ws))
	statuses := make([]*status, len(ws))
	for i, w := range ws {
		names[i], statuses[i] = w.Name, w.status()
	}
	p.snap.Store(&Snapshot{Workers: ws, Ring: ring.New(names, p.cfg.VirtualNodes), names: names, statuses: statuses})
}

// healthLoop runs a round of checks every HealthInterval until Close.
func (p *Pool) healthLoop() {
	defer close(p.loopDone)
	t := time.NewTicker(p.cfg.HealthInterval)
	defer t.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
			p.CheckNow(p.ctx)
		}
	}
}

// CheckNow runs one round of health checks on the current workers and
// returns when it is over; the loop started by New calls it every
// HealthInterval. Each worker's Client.Check runs with HealthTimeout, at
// most HealthConcurrency at once. Rounds never overlap.
func (p *Pool) CheckNow(ctx context.Context) {
	p.checkMu.Lock()
	defer p.checkMu.Unlock()
	sem := make(chan struct{}, p.cfg.HealthConcurrency) // bounds checks in flight
	var wg sync.WaitGroup
	for _, w := range p.Snapshot().Workers {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			p.check1(ctx, w)
		})
	}
	wg.Wait()
}

// check1 checks one worker and updates its health.
func (p *Pool) check1(ctx context.Context, w *Worker) {
	since := w.checked // the previous check's start, else this one's
	w.checked = time.Now()
	if since.IsZero() {
		since = w.checked
	}
	cctx, cancel := context.WithTimeout(ctx, p.cfg.HealthTimeout)
	err := w.Client.Check(cctx)
	// gRPC may report the deadline before cctx's own timer ends it.
	timedOut := cctx.Err() != nil || errors.Is(err, context.DeadlineExceeded)
	cancel()
	if ctx.Err() != nil {
		return // shutting down: the check says nothing about the worker
	}
	if err == nil {
		w.failedChecks = 0
		p.setHealthy(w, true)
		p.describe(ctx, w)
		return
	}
	if timedOut && w.answered.Load() >= since.UnixNano() {
		// The worker answered calls since its previous check began: it
		// is up, and a check that timed out says the scheduler's host or
		// the path was slow (a CPU-starved host times out every worker's
		// check at once), not that the worker is down.
		return
	}
	w.failedChecks++
	if w.failedChecks >= p.cfg.UnhealthyAfter {
		p.setHealthy(w, false)
	}
}

// describe asks a worker with Discover set what it serves and tells the
// OnDescribe hook when that changed.
func (p *Pool) describe(ctx context.Context, w *Worker) {
	dc, ok := w.Client.(engine.Describer)
	if !ok || !w.Discover {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, p.cfg.HealthTimeout)
	d, err := dc.Describe(cctx)
	cancel()
	if err != nil || (w.described != nil && w.described.Role == d.Role && slices.Equal(w.described.Models, d.Models) &&
		slices.Equal(w.described.Adapters, d.Adapters) && w.described.MaxLoRAs == d.MaxLoRAs) {
		return
	}
	w.described = &d
	if p.onDescribe != nil {
		p.onDescribe(w, d)
	}
}

func (p *Pool) setHealthy(w *Worker, healthy bool) {
	if w.status().healthy.Swap(healthy) == healthy {
		return
	}
	if p.onHealthChange != nil {
		p.onHealthChange(w.Name, healthy)
	}
}
