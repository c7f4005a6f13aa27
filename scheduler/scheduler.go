// Package scheduler wires baton's scheduler together: configuration, the
// worker pool and its engine clients, the routing strategy, metrics and the
// HTTP front end. cmd/baton's serve and demo commands, and the end-to-end
// tests, build a Scheduler from a Config.
package scheduler

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/internal/auth"
	"github.com/batonllm/baton/scheduler/internal/h1serve"
	"github.com/batonllm/baton/scheduler/internal/replica"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// Scheduler is a running scheduler: pool, strategy, metrics and front end.
type Scheduler struct {
	cfg Config
	// deps are what the strategies read at run time: the index, the part
	// timers.
	deps routing.Deps
	// Pool holds the workers that generate tokens (roles both and decode).
	Pool *pool.Pool
	// PrefillPool holds the prefill workers; empty in a colocated fleet.
	PrefillPool *pool.Pool
	// pending holds the workers whose models or role are not known yet:
	// never routed to, health-checked until they describe themselves.
	pending *pool.Pool
	// Index knows which worker holds which KV block in which tier, fed by
	// every baton worker's Watch stream; kv_aware routes on it.
	Index    *kvindex.Index
	watcher  *watch.Watcher
	Metrics  *metrics.Metrics
	Handler  *frontend.Server
	Strategy routing.Strategy
	log      *slog.Logger
	// sharing links the scheduler to its other replicas; nil without
	// replicas.redis.
	sharing *sharing

	// Auth checks API keys in front of Handler; nil when no keys are
	// configured.
	Auth *auth.Auth
	tls  tlsState

	placeMu sync.Mutex            // serializes moves between pools
	where   map[string]*pool.Pool // each worker's pool, by name
	roles   map[string]string     // configured roles; "" asks the engine

	// Membership (members.go): the workers configured or discovered, by
	// name, and the source that reports them (nil: static).
	memberMu      sync.Mutex
	members       map[string]WorkerConfig
	source        discovery.Source
	watchWorkers  bool          // the strategies read the KV index
	engineTokens  *engineTokens // discovered vllm and sglang workers' tokenizers, when keys are tokens
	discovered    prometheus.Gauge
	memberChanges *prometheus.CounterVec
	bg            sync.WaitGroup // following the source; draining workers

	mu       sync.Mutex
	clients  []engine.Client
	scrapers map[string]io.Closer // by worker
	tokenize *vllm.Tokenizer      // nil: requests keyed by text
	srv      httpServer
	closed   bool

	// base is every request's base context; a drain that times out
	// cancels it with frontend.ErrDrained.
	base       context.Context
	cancelBase context.CancelCauseFunc
}

// New validates cfg, connects to its workers and builds the scheduler. It
// does not listen: call Serve. A nil log discards.
//
// Strategies are built from the registry (routing.RegisterBuiltins) over
// the scheduler's own KV index (routing.Deps.Index).
func New(cfg Config, strategies *routing.Registry, log *slog.Logger) (*Scheduler, error) {
	if err := cfg.Validate(strategies); err != nil {
		return nil, err
	}
	// The other replicas hear each prediction once sharing has started,
	// before the first request.
	var share func(e replica.Entry)
	icfg := kvindex.Config{Now: cfg.IndexNow}
	if cfg.Replicas.enabled() {
		icfg.OnPredict = func(p kvindex.Prediction) {
			share(replica.Entry{Worker: p.Worker, Keys: p.Keys, Pending: p.Pending, At: p.At.UnixNano()})
		}
	}
	idx := kvindex.New(icfg)
	strategies, err := cfg.RegisterProfiles(strategies)
	if err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Scheduler{log: log, Index: idx}
	s.base, s.cancelBase = context.WithCancelCause(context.Background())
	s.Metrics = metrics.New(s.snapshot(&s.Pool), s.snapshot(&s.PrefillPool))
	s.deps = routing.Deps{Rand: cfg.Rand, Index: idx, PartTimer: func(profile, part string) func(time.Duration) {
		h := s.Metrics.RoutingPart.WithLabelValues(profile, part)
		return func(d time.Duration) { h.Observe(d.Seconds()) }
	}}
	s.cfg = cfg
	s.Strategy, err = strategies.New(cfg.Strategy, cfg.Params, s.deps)
	if err != nil {
		return nil, err
	}
	if err := s.setupTLS(cfg); err != nil {
		return nil, err
	}
	if cfg.Replicas.enabled() {
		if s.sharing, err = startSharing(cfg.Replicas, idx, s.Metrics.Registry, log); err != nil {
			return nil, err
		}
		share = s.sharing.sharer.Publish
	}
	if err := s.build(cfg, strategies); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// build connects to the workers, splits them into pools by role and builds
// the front end.
func (s *Scheduler) build(cfg Config, strategies *routing.Registry) error {
	s.watcher = watch.New(s.Index, watch.Config{OnResync: func(worker string, err error) {
		reason := watch.ResyncReason(err)
		s.Metrics.IndexResyncs.WithLabelValues(worker, reason).Inc()
		s.log.Info("kv index resync", "worker", worker, "reason", reason, "err", err)
	}, OnAdapters: s.workerAdapters, ScrapesPerSecond: float64(cfg.ScrapesPerSecond), Relay: s.sharing.relay(cfg.Replicas)})
	if s.sharing != nil {
		s.sharing.watcher.Store(s.watcher)
	}
	s.Metrics.CollectEngines(s.engineCounts)
	d := cfg.Disaggregation.WithDefaults()
	// Watching every worker costs the scheduler CPU on each of their cache
	// events: do it only for strategies that read the index.
	watchWorkers := routing.UsesKeys(s.Strategy) || d.DecodeStrategy == routing.KVAware
	opts := []pool.Option{
		pool.OnBreakerChange(func(worker string, from, to gobreaker.State) {
			s.Metrics.BreakerChanged(worker, from, to)
			if to == gobreaker.StateOpen {
				s.log.Warn("breaker changed", "worker", worker, "from", from.String(), "to", to.String())
			} else {
				s.log.Info("breaker changed", "worker", worker, "from", from.String(), "to", to.String())
			}
		}),
		pool.OnHealthChange(func(worker string, healthy bool) {
			if healthy {
				// A worker back from a restart is routed to again: its
				// Watch stream must not wait out the watcher's backoff
				// while the index holds what the old process held.
				s.watcher.Retry(worker)
				s.log.Info("worker health changed", "worker", worker, "healthy", healthy)
			} else {
				s.log.Warn("worker health changed", "worker", worker, "healthy", healthy)
			}
		}),
		pool.OnDescribe(s.described),
	}
	s.watchWorkers = watchWorkers
	s.where = make(map[string]*pool.Pool)
	s.roles = make(map[string]string)
	s.scrapers = make(map[string]io.Closer)
	var err error
	for _, pp := range []**pool.Pool{&s.Pool, &s.PrefillPool, &s.pending} {
		if *pp, err = pool.New(cfg.Pool, opts...); err != nil {
			return err
		}
	}
	if w := cfg.Discovery.Worker; cfg.Discovery.discovered() && tokenizes(w) && w.TokenizePath != TokenizeNone && watchWorkers {
		s.engineTokens = newEngineTokens()
	}
	if err := s.discover(cfg); err != nil {
		return err
	}
	if s.source == nil && len(s.Pool.Snapshot().Workers) == 0 && len(s.pending.Snapshot().Workers) == 0 {
		return errors.New("workers: prefill workers need at least one decode (or both) worker")
	}
	decode, err := strategies.New(d.DecodeStrategy, cfg.Params, s.deps)
	if err != nil {
		return err
	}
	if n := len(s.PrefillPool.Snapshot().Workers); n > 0 {
		s.log.Info("disaggregated prefill/decode", "prefill_workers", n, "decode_workers", len(s.Pool.Snapshot().Workers), "decode_strategy", d.DecodeStrategy)
	}
	fopts := []frontend.Option{
		frontend.WithDisagg(&frontend.Disagg{
			Pool: s.PrefillPool, DecodeStrategy: decode,
			MinRemoteTokens: d.MinRemotePrefillTokens, TransferTimeout: d.TransferTimeout, Retries: d.PrefillRetries,
		}),
	}
	if cfg.Auth.Enabled() {
		if s.Auth, err = auth.New(cfg.Auth, s.Metrics.Registry, s.log); err != nil {
			return fmt.Errorf("auth.%w", err)
		}
		fopts = append(fopts, frontend.WithAdmission(s.Auth))
	}
	if routing.UsesKeys(s.Strategy) || routing.UsesKeys(decode) {
		tk, err := s.tokenKeys(cfg.Workers)
		if err != nil {
			return err
		}
		if s.engineTokens != nil {
			tk = s.discoveredTokenKeys(cfg.Discovery.Worker)
		}
		if tk != nil {
			fopts = append(fopts, frontend.WithTokenKeys(*tk))
		}
	}
	fopts = append(fopts, frontend.WithAdapters(frontend.Adapters{List: cfg.adapters(), Threshold: cfg.ConcurrencyThreshold}))
	if s.sharing != nil {
		fopts = append(fopts, frontend.WithBeforePick(s.sharing.sharer.Poll))
	}
	s.Handler, err = frontend.New(cfg.Config, s.Pool, s.Strategy, s.Metrics, s.log, fopts...)
	return err
}

// tokenKeys returns how the front end keys requests by an engine's tokens:
// those of the first vllm or sglang worker, whose tokenize endpoint,
// model and block size serve every request (mixing engines of different
// tokenizers or block sizes in one fleet is rare). Nil: no such worker, or
// it tokenizes nothing, and requests are keyed by their text.
//
// For an engine of data-parallel ranks that worker is its first rank: the
// engine's own name is no worker's, so its model (when the configuration
// leaves it to the engine) and its block size would be unknown, and every
// request would be keyed as for an adapter of no model, under keys that
// none of the ranks' events match.
func (s *Scheduler) tokenKeys(workers []WorkerConfig) (*frontend.TokenKeys, error) {
	i := slices.IndexFunc(workers, tokenizes)
	if i < 0 || workers[i].TokenizePath == TokenizeNone {
		return nil, nil
	}
	wc := workers[i].ranks()[0]
	tc, err := s.engineTLS(wc)
	if err != nil {
		return nil, err
	}
	t, err := vllm.NewTokenizer(wc.Address, wc.TokenizePath, vllm.WithTLS(tc))
	if err != nil {
		return nil, fmt.Errorf("worker %s: %w", wc.Name, err)
	}
	s.mu.Lock()
	s.tokenize = t
	s.mu.Unlock()
	s.log.Info("requests keyed by an engine's tokens", "worker", wc.Name, "tokenize", t.URL())
	return &frontend.TokenKeys{
		Tokenizer:   t,
		Model:       func() string { return s.modelOf(wc) },
		BlockSize:   func() int { return s.blockTokens(wc.Name) },
		Timeout:     wc.TokenizeTimeout,
		CacheTokens: wc.TokenizeCacheTokens,
	}, nil
}

// blockTokens returns the tokens of a worker's KV block, as the index
// knows them.
func (s *Scheduler) blockTokens(worker string) int {
	var m [1]kvindex.Match
	s.Index.Lookup(nil, []string{worker}, m[:])
	return m[0].BlockTokens
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

// connect builds the engine client of one worker. When the configuration
// leaves the worker's models or role to the engine, it asks once; a nil
// description means the engine did not answer (yet).
func (s *Scheduler) connect(wc WorkerConfig) (*pool.Worker, *engine.Description, error) {
	w := &pool.Worker{Name: wc.Name, Addr: wc.Address, Models: wc.Models, MaxLoRAs: wc.MaxLoRAs}
	tc, err := s.engineTLS(wc)
	if err != nil {
		return nil, nil, err
	}
	k := kindOfWorker(wc)
	c, err := k.Connect(s.target(wc, tc))
	if err != nil {
		return nil, nil, fmt.Errorf("worker %s: %w", wc.Name, err)
	}
	w.Client = c
	w.Discover = len(wc.Models) == 0 || (k.DescribesRole && wc.Role == "")
	s.mu.Lock()
	s.clients = append(s.clients, w.Client)
	s.mu.Unlock()
	desc := &engine.Description{Models: wc.Models, Role: wc.Role}
	if w.Discover {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		d, err := w.Client.(engine.Describer).Describe(ctx)
		cancel()
		if err != nil {
			// Its health checks describe it once it answers; an engine
			// whose certificate is not trusted never will: say why.
			s.log.Warn("worker did not describe itself", "worker", wc.Name, "err", err)
			return w, nil, nil
		}
		desc = &d
	}
	// With adapters configured, the health checks also follow the
	// adapters the engine holds, whatever the configuration says of its
	// models and role.
	w.Discover = w.Discover || len(s.cfg.Adapters) > 0
	return w, desc, nil
}

// target is wc as its kind's functions see it, its engine reached with
// tc when https.
func (s *Scheduler) target(wc WorkerConfig, tc *tls.Config) engine.Target {
	t := engine.Target{
		Name: wc.Name, Address: wc.Address, Role: wc.Role, TLS: tc,
		BootstrapHost: wc.BootstrapHost, BootstrapPort: wc.BootstrapPort,
		MetricsPath: wc.MetricsPath, Adapters: s.cfg.adapters(),
	}
	if !kindOfWorker(wc).URL {
		t.Credentials = s.tls.workerCreds
	}
	t.Rank, t.DPSize = wc.dpTarget()
	return t
}

// watchEngine has the watcher follow a vllm, sglang or llamacpp worker:
// its load from its metrics and, if withEvents, its KV cache events;
// without events the index learns its blocks from routing.
func (s *Scheduler) watchEngine(wc WorkerConfig, withEvents bool) error {
	sc, err := s.scraper(wc)
	if err != nil {
		return err
	}
	log := s.log.With("worker", wc.Name)
	cfg := watch.EngineConfig{
		Metrics:        sc,
		ScrapeInterval: wc.MetricsInterval,
		ScrapeTimeout:  wc.MetricsTimeout,
		BlockSize:      wc.BlockSize,
		Capacity:       kvindex.Capacity{Prompts: wc.CachePrompts},
		Cost:           wc.Cost.Figures,
		Model:          func() string { return s.modelOf(wc) },
		Logger:         s.log,
	}
	if kindOfWorker(wc).AdapterMetrics {
		cfg.OnAdapters = func(held []string, slots int) { s.engineAdapters(wc.Name, held, slots) }
	}
	switch {
	case wc.Events != "" && withEvents:
		mode := kvevents.Connect
		if wc.EventsBind {
			mode = kvevents.Bind
		}
		cfg.Events = kvevents.SubscriberConfig{
			Endpoint: wc.Events, ReplayEndpoint: wc.EventsReplay, Topic: wc.EventsTopic, Mode: mode,
			// The engine may have cached blocks before the scheduler
			// started: its replay buffer tells which.
			ReplayFromStart: true,
			Logger:          log,
			// A data-parallel rank's stream holds its batches alone.
			DPRank: int64(wc.dpRank()), CheckDPRank: wc.DataParallelSize > 1,
		}
	case wc.Events != "":
		log.Info("engine's KV events not followed: the strategy does not read the KV index", "strategy", s.cfg.Strategy)
	}
	return s.watcher.AddEngine(wc.Name, cfg)
}

// scraper returns the scraper of a vllm, sglang or llamacpp worker's
// load, closed with the scheduler.
func (s *Scheduler) scraper(wc WorkerConfig) (watch.MetricsSource, error) {
	tc, err := s.engineTLS(wc)
	if err != nil {
		return nil, err
	}
	k := kindOfWorker(wc)
	if k.Scrape == nil {
		return nil, fmt.Errorf("worker %s: %s engines have no metrics baton reads", wc.Name, k.Name)
	}
	sc, err := k.Scrape(s.target(wc, tc))
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.scrapers[wc.Name] = sc
	s.mu.Unlock()
	return sc, nil
}

// engineCounts returns the counts of the vllm and sglang workers followed,
// for the metrics.
func (s *Scheduler) engineCounts() []metrics.EngineCounts {
	var out []metrics.EngineCounts
	for _, e := range s.watcher.Engines() {
		c := metrics.EngineCounts{
			Worker: e.Worker,
			Scrapes: map[string]uint64{"ok": e.Scrapes.OK, "failed": e.Scrapes.Failed, "garbage": e.Scrapes.Garbage,
				"skipped": e.Scrapes.Skipped, "relayed": e.Scrapes.Relayed},

			ScrapeInterval: e.ScrapeInterval,
		}
		if e.HasEvents {
			t, st := e.Translated, e.Events
			c.Events = map[string]uint64{
				"stored": t.Stored, "removed": t.Removed, "cleared": t.Cleared,
				"unknown_parent": t.UnknownParent, "unknown_removed": t.UnknownRemoved, "bad_stored": t.BadStored,
				"other_medium": t.OtherMedium, "other_group": t.OtherGroup, "evicted": t.Evicted,
			}
			c.Stream = map[string]uint64{
				"batch": st.Batches, "decode_error": st.DecodeErrors, "unknown_tag": st.UnknownTags,
				"bad_frame": st.BadFrames, "gap": st.Gaps, "replay": st.Replays, "replay_failure": st.ReplayFailures,
				"reset": st.Resets, "wrong_rank": st.WrongRank, "restart": st.Restarts, "reconnect": st.Reconnects, "dial_failure": st.DialFailures,
			}
		}
		out = append(out, c)
	}
	return out
}

// modelOf returns the model that salts a vllm or sglang worker's block
// keys: the first it is configured with, else the first it said it
// serves (vLLM lists its base model before its LoRA adapters).
func (s *Scheduler) modelOf(wc WorkerConfig) string {
	if len(wc.Models) > 0 {
		return wc.Models[0]
	}
	s.placeMu.Lock()
	p := s.where[wc.Name]
	s.placeMu.Unlock()
	if p == nil {
		return ""
	}
	if w := p.Snapshot().Worker(wc.Name); w != nil {
		if m := w.ServedModels(); len(m) > 0 {
			return m[0]
		}
	}
	return ""
}

// described hears a worker's description from its pool's health checks:
// a pending worker joins the pool of its role, a worker that restarted
// with another role moves, and its models are updated.
func (s *Scheduler) described(w *pool.Worker, d engine.Description) {
	s.placeMu.Lock()
	from := s.where[w.Name]
	s.placeMu.Unlock()
	if from == s.pending {
		s.log.Info("worker info known; routing to it", "worker", w.Name, "role", s.roleOf(w.Name, d), "models", d.Models)
	}
	s.apply(w, d)
}

// Pending returns the names of the workers whose description is not known
// yet: they serve nothing until their pool's health checks reach them.
func (s *Scheduler) Pending() []string {
	var names []string
	for _, w := range s.pending.Snapshot().Workers {
		names = append(names, w.Name)
	}
	return names
}

// roleOf returns the worker's configured role, else the engine's.
func (s *Scheduler) roleOf(name string, d engine.Description) string {
	s.placeMu.Lock()
	r := s.roles[name]
	s.placeMu.Unlock()
	if r != "" {
		return r
	}
	if d.Role == "" {
		return RoleBoth
	}
	return d.Role
}

// apply sets a worker's models from its description (unless configured)
// and puts it in the pool of its role.
func (s *Scheduler) apply(w *pool.Worker, d engine.Description) {
	if len(w.Models) == 0 {
		w.SetModels(d.Models)
	}
	w.SetAdapters(s.heldAdapters(d))
	if d.MaxLoRAs > 0 {
		w.SetAdapterSlots(d.MaxLoRAs) // else vLLM's metrics may tell
	}
	target := s.Pool
	if s.roleOf(w.Name, d) == RolePrefill {
		target = s.PrefillPool
	}
	s.place(w, target)
}

// workerAdapters hears the LoRA adapters a baton worker reports holding,
// and its adapter slots when it tells them, from the watcher's goroutine
// of that worker.
func (s *Scheduler) workerAdapters(name string, held []string, slots int) {
	if w := s.placed(name); w != nil {
		w.SetAdapters(held)
		if slots > 0 {
			w.SetAdapterSlots(slots)
		}
	}
}

// engineAdapters hears, from a vLLM engine's metrics, the adapters its
// requests use and its adapter slots: they are held, beside the idle ones
// its /v1/models lists.
func (s *Scheduler) engineAdapters(name string, held []string, slots int) {
	if w := s.placed(name); w != nil {
		w.NoteAdapters(held)
		w.SetAdapterSlots(slots)
	}
}

// placed returns the worker named name in the pool it is in, nil if none.
func (s *Scheduler) placed(name string) *pool.Worker {
	s.placeMu.Lock()
	p := s.where[name]
	s.placeMu.Unlock()
	if p == nil {
		return nil
	}
	return p.Snapshot().Worker(name)
}

// place moves the worker named w.Name into target. A worker belongs to
// one pool, so a move makes its successor over the same client: its
// breaker and health start afresh, what it holds of adapters carries
// over.
func (s *Scheduler) place(w *pool.Worker, target *pool.Pool) {
	s.placeMu.Lock()
	defer s.placeMu.Unlock()
	from := s.where[w.Name]
	if _, member := s.roles[w.Name]; from == target || !member || w.Removed() {
		return // or it left while describing itself
	}
	if from != nil {
		from.Remove(w.Name)
		w = w.Successor()
	}
	if err := target.Add(w); err != nil {
		s.log.Error("adding worker to its pool", "worker", w.Name, "err", err)
		return
	}
	s.where[w.Name] = target
}

// Serve serves HTTP on l until Close. It returns nil after Close, also
// when Close came first (it then closes l): a scheduler closed before it
// served has nothing to report.
func (s *Scheduler) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		l.Close()
		return nil
	}
	var h http.Handler = s.Handler
	if s.Auth != nil {
		h = s.Auth.Wrap(h)
	}
	if s.tls.front == nil {
		// Plain HTTP/1.1: baton's own connection loop (h1serve), which
		// answers a short request without net/http's per-request watch.
		s.srv = &h1serve.Server{
			Handler:           h,
			ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout:       s.cfg.Config.WithDefaults().IdleTimeout,
			MaxHeaderBytes:    s.cfg.Config.WithDefaults().MaxHeaderBytes,
			RequestTimeout:    s.cfg.Config.WithDefaults().RequestTimeout,
			ErrorLog:          s.log,
			BaseContext:       func(net.Listener) context.Context { return s.base },
			ConnState:         s.connState,
		}
	} else {
		s.srv = &tlsServer{&http.Server{
			Handler:           h,
			ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout:       s.cfg.Config.WithDefaults().IdleTimeout,
			MaxHeaderBytes:    s.cfg.Config.WithDefaults().MaxHeaderBytes,
			// No read or write timeout here: the front end sets them per
			// request (the body; a non-streamed response), as streams last as
			// long as generation does, bounded by the request timeout.
			ErrorLog:    slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
			BaseContext: func(net.Listener) context.Context { return s.base },
			TLSConfig:   s.tls.front, // its GetCertificate serves the files
			ConnState:   s.connState,
		}}
	}
	srv := s.srv
	s.mu.Unlock()
	if n := s.cfg.Config.WithDefaults().MaxConnections; n > 0 {
		l = newLimitListener(l, n)
	}
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// httpServer is the front end's server: h1serve's for plain HTTP,
// net/http's for TLS (and HTTP/2 over it).
type httpServer interface {
	Serve(net.Listener) error
	Shutdown(context.Context) error
	Close() error
}

// tlsServer serves TLS with the certificate of its TLSConfig.
type tlsServer struct{ *http.Server }

func (s tlsServer) Serve(l net.Listener) error { return s.ServeTLS(l, "", "") }

// connState counts the front end's open connections.
func (s *Scheduler) connState(_ net.Conn, st http.ConnState) {
	switch st {
	case http.StateNew:
		s.Metrics.Connections.Inc()
	case http.StateClosed, http.StateHijacked:
		s.Metrics.Connections.Dec()
	}
}

// ReloadKeys reads the API keys again (baton serve does on SIGHUP). On
// error the keys in use stay. Without keys configured it does nothing.
func (s *Scheduler) ReloadKeys() error {
	if s.Auth == nil {
		return nil
	}
	return s.Auth.Reload()
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

// drainGrace bounds the wait, after a drain timed out and cancelled the
// requests left, for them to write their error and end.
const drainGrace = 5 * time.Second

// Drain shuts the scheduler down gracefully, as baton serve does on
// SIGTERM: /readyz answers 503 at once (baton_draining is 1); after
// Config.DrainDelay the scheduler stops accepting connections and lets the
// requests in flight finish within Config.DrainTimeout. Those still
// running then end with a stream_interrupted error (a 503 before their
// first byte), each counted once with the outcome "interrupted". Then it
// closes the scheduler. It returns once all that is done.
func (s *Scheduler) Drain() {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	start := time.Now()
	s.Handler.Drain()
	s.Metrics.Draining.Set(1)
	s.log.Info("draining", "in_flight", s.Handler.InFlight(), "delay", s.cfg.DrainDelay, "timeout", s.cfg.DrainTimeout)
	interrupted := 0
	if srv == nil {
		// Serve has not begun: nothing was accepted, and Serve returns
		// at once after Close.
		s.Close()
		s.log.Info("drained", "duration", time.Since(start).Round(time.Millisecond), "interrupted", interrupted)
		return
	}
	if s.cfg.DrainDelay > 0 {
		time.Sleep(s.cfg.DrainDelay)
		s.log.Info("draining: no longer accepting", "in_flight", s.Handler.InFlight())
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.DrainTimeout)
	err := srv.Shutdown(ctx)
	cancel()
	if err != nil {
		interrupted = s.Handler.InFlight()
		s.log.Warn("drain timed out; interrupting the requests left", "in_flight", interrupted, "timeout", s.cfg.DrainTimeout)
		s.cancelBase(frontend.ErrDrained)
		ctx, cancel := context.WithTimeout(context.Background(), drainGrace)
		srv.Shutdown(ctx) // now waits for the interrupted requests to end
		cancel()
	}
	s.Close()
	s.log.Info("drained", "duration", time.Since(start).Round(time.Millisecond), "interrupted", interrupted)
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
	s.mu.Unlock()
	s.cancelBase(nil)
	if s.source != nil {
		s.source.Close()
	}
	s.bg.Wait() // no worker joins or leaves past this
	if s.engineTokens != nil {
		s.engineTokens.close()
	}
	s.mu.Lock()
	srv, clients, scrapers, tokenize := s.srv, s.clients, s.scrapers, s.tokenize
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
	if s.pending != nil {
		s.pending.Close()
	}
	if s.sharing != nil {
		s.sharing.close()
	}
	if s.watcher != nil {
		s.watcher.Close()
	}
	for _, sc := range scrapers {
		sc.Close()
	}
	if tokenize != nil {
		tokenize.Close()
	}
	for _, c := range clients {
		c.Close()
	}
	return nil
}

// The clients the scheduler builds, checked against the optional abilities
// it finds on them at run time.
var (
	_ watch.Source        = (*grpcworker.Client)(nil)
	_ engine.Describer    = (*grpcworker.Client)(nil)
	_ engine.Describer    = (*httpengine.Client)(nil)
	_ engine.Proxier      = (*httpengine.Client)(nil)
	_ watch.MetricsSource = (*vllm.Scraper)(nil)
)
