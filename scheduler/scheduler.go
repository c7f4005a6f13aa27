// Package scheduler wires baton's scheduler together: configuration, the
// worker pool and its engine clients, the routing strategy, metrics and the
// HTTP front end. cmd/baton's serve and demo commands, and the end-to-end
// tests, build a Scheduler from a Config.
package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/httpengine"
)

// Scheduler is a running scheduler: pool, strategy, metrics and front end.
type Scheduler struct {
	cfg Config
	// Pool holds the workers that generate tokens (roles both and decode).
	Pool *pool.Pool
	// PrefillPool holds the prefill workers; nil in a colocated fleet.
	PrefillPool *pool.Pool
	// Index knows which worker holds which KV block in which tier, fed by
	// every baton worker's Watch stream; kv_aware routes on it.
	Index    *kvindex.Index
	watcher  *watch.Watcher
	Metrics  *metrics.Metrics
	Handler  *frontend.Server
	Strategy routing.Strategy
	log      *slog.Logger

	mu      sync.Mutex
	clients []engine.Client
	srv     *http.Server
	closed  bool
}

// New validates cfg, connects to its workers and builds the scheduler. It
// does not listen: call Serve. A nil log discards.
//
// Besides the strategies of the registry, the scheduler offers kv_aware,
// bound to its own KV index.
func New(cfg Config, strategies *routing.Registry, log *slog.Logger) (*Scheduler, error) {
	idx := kvindex.New(kvindex.Config{})
	strategies = strategies.Clone()
	if !strategies.Has(routing.KVAware) {
		routing.RegisterKVAware(strategies, idx)
	}
	if err := cfg.Validate(strategies); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	strategy, err := strategies.New(cfg.Strategy, cfg.Params)
	if err != nil {
		return nil, err
	}
	s := &Scheduler{cfg: cfg, Strategy: strategy, log: log, Index: idx}
	if err := s.build(cfg, strategies); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// build connects to the workers, splits them into pools by role and builds
// the front end.
func (s *Scheduler) build(cfg Config, strategies *routing.Registry) error {
	s.Metrics = metrics.New(s.snapshot(&s.Pool), s.snapshot(&s.PrefillPool))
	s.watcher = watch.New(s.Index, watch.Config{OnResync: func(worker string, err error) {
		s.Metrics.IndexResyncs.WithLabelValues(worker).Inc()
		s.log.Info("kv index resync", "worker", worker, "err", err)
	}})
	// Watching every worker costs the scheduler CPU on each of their cache
	// events: do it only for strategies that read the index.
	watchWorkers := routing.UsesKeys(s.Strategy) || cfg.Disaggregation.WithDefaults().DecodeStrategy == routing.KVAware
	var gen, pre []*pool.Worker
	for _, wc := range cfg.Workers {
		w, role, err := s.connect(wc)
		if err != nil {
			return err
		}
		if role == RolePrefill {
			pre = append(pre, w)
		} else {
			gen = append(gen, w)
		}
		// Baton workers stream their cache events into the index; other
		// engines are known to it by name only (predictions still apply).
		if src, ok := w.Client.(watch.Source); ok && watchWorkers {
			err = s.watcher.Add(w.Name, src)
		} else if watchWorkers {
			err = s.Index.AddWorker(w.Name)
		}
		if err != nil {
			s.log.Warn("worker not indexed; kv_aware treats it as holding nothing", "worker", w.Name, "err", err)
		}
	}
	if len(gen) == 0 {
		return errors.New("workers: prefill workers need at least one decode (or both) worker")
	}
	opts := []pool.Option{
		pool.OnBreakerChange(func(worker string, from, to gobreaker.State) {
			s.Metrics.BreakerChanged(worker, from, to)
			s.log.Warn("breaker changed", "worker", worker, "from", from.String(), "to", to.String())
		}),
		pool.OnHealthChange(func(worker string, healthy bool) {
			s.log.Warn("worker health changed", "worker", worker, "healthy", healthy)
		}),
	}
	var err error
	if s.Pool, err = newPool(cfg.Pool, gen, opts); err != nil {
		return err
	}
	genStrategy := s.Strategy
	var fopts []frontend.Option
	if len(pre) > 0 {
		if s.PrefillPool, err = newPool(cfg.Pool, pre, opts); err != nil {
			return err
		}
		d := cfg.Disaggregation.WithDefaults()
		if genStrategy, err = strategies.New(d.DecodeStrategy, cfg.Params); err != nil {
			return err
		}
		fopts = append(fopts, frontend.WithDisagg(&frontend.Disagg{
			Pool: s.PrefillPool, Strategy: s.Strategy,
			MinRemoteTokens: d.MinRemotePrefillTokens, TransferTimeout: d.TransferTimeout, Retries: d.PrefillRetries,
		}))
		s.log.Info("disaggregated prefill/decode", "prefill_workers", len(pre), "decode_workers", len(gen), "decode_strategy", d.DecodeStrategy)
	}
	fopts = append(fopts, frontend.WithFirstTokenObserver(func(ft frontend.FirstToken) {
		s.Index.ObserveTTFT(ft.Worker, ft.Estimate, ft.Achieved)
		s.Index.Prefilled(ft.Worker, ft.Uncached)
	}))
	s.Handler, err = frontend.New(cfg.Config, s.Pool, genStrategy, s.Metrics, s.log, fopts...)
	return err
}

// snapshot returns a reader of *p's snapshot for the metrics, nil while
// the pool does not exist. Pools are built before the scheduler serves.
func (s *Scheduler) snapshot(p **pool.Pool) func() *pool.Snapshot {
	return func() *pool.Snapshot {
		if *p == nil {
			return nil
		}
		return (*p).Snapshot()
	}
}

func newPool(cfg pool.Config, workers []*pool.Worker, opts []pool.Option) (*pool.Pool, error) {
	p, err := pool.New(cfg, opts...)
	if err != nil {
		return nil, err
	}
	if err := p.Set(workers); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// connect builds the engine client of one worker and finds its role.
func (s *Scheduler) connect(wc WorkerConfig) (*pool.Worker, string, error) {
	w := &pool.Worker{Name: wc.Name, Addr: wc.Address, Models: wc.Models}
	role := wc.Role
	switch wc.Kind {
	case KindHTTP:
		c, err := httpengine.New(wc.Address)
		if err != nil {
			return nil, "", fmt.Errorf("worker %s: %w", wc.Name, err)
		}
		w.Client = c
	default:
		c, err := grpcworker.Dial(wc.Address)
		if err != nil {
			return nil, "", fmt.Errorf("worker %s: %w", wc.Name, err)
		}
		w.Client = c
		if len(w.Models) == 0 || role == "" {
			// Ask the worker; one that is not up yet serves any model, as
			// role both, until it is configured explicitly.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			info, err := c.Info(ctx)
			cancel()
			if err == nil {
				if len(w.Models) == 0 {
					w.Models = info.Models
				}
				if role == "" {
					role = roleName(info.Role)
				}
			} else {
				s.log.Warn("worker info unavailable; routing any model to it as role both", "worker", wc.Name, "err", err)
			}
		}
	}
	s.mu.Lock()
	s.clients = append(s.clients, w.Client)
	s.mu.Unlock()
	if role == "" {
		role = RoleBoth
	}
	return w, role, nil
}

func roleName(r workerpb.Role) string {
	switch r {
	case workerpb.Role_ROLE_PREFILL:
		return RolePrefill
	case workerpb.Role_ROLE_DECODE:
		return RoleDecode
	}
	return RoleBoth
}

// Serve serves HTTP on l until Close. It returns nil after Close.
func (s *Scheduler) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return errors.New("scheduler closed")
	}
	s.srv = &http.Server{
		Handler:           s.Handler,
		ReadHeaderTimeout: 10 * time.Second,
		// No write timeout: streams last as long as generation does, bounded
		// by the front end's request timeout.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	srv := s.srv
	s.mu.Unlock()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Shutdown stops accepting requests and waits, until ctx is done, for those
// in flight to finish; then it closes the scheduler.
func (s *Scheduler) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	var err error
	if srv != nil {
		err = srv.Shutdown(ctx)
	}
	s.Close()
	return err
}

// Close stops serving at once and releases the pool and worker
// connections. It is idempotent.
func (s *Scheduler) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	srv, clients := s.srv, s.clients
	s.mu.Unlock()
	if srv != nil {
		srv.Close()
	}
	if s.Pool != nil {
		s.Pool.Close()
	}
	if s.PrefillPool != nil {
		s.PrefillPool.Close()
	}
	if s.watcher != nil {
		s.watcher.Close()
	}
	for _, c := range clients {
		c.Close()
	}
	return nil
}
