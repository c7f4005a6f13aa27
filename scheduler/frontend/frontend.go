// Package frontend is the scheduler's HTTP API: OpenAI-compatible chat and
// text completions, SageMaker's native /invocations route, /v1/models,
// health and readiness probes and /metrics. For each request it validates
// the body, derives the routing text and tenant, asks the strategy for a
// worker, and streams the worker's answer back, retrying on another worker
// when one fails before its first token.
package frontend

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/openai"
)

// Headers explaining a route.
const (
	HeaderWorker = "X-Baton-Worker"
	HeaderRoute  = "X-Baton-Route"
	HeaderTenant = "X-Prefix-Aware-Id"
)

// Limits and defaults of Config fields.
const (
	MinPrefixLength     = 1024
	MaxPrefixLength     = 65536
	DefaultPrefixLength = 4096
	DefaultRetries      = 2
	DefaultTimeout      = 10 * time.Minute
	DefaultMaxQueue     = 256
	DefaultMaxInFlight  = 256
	DefaultQueueTimeout = 30 * time.Second
	DefaultReadTimeout  = time.Minute
	DefaultIdleTimeout  = 2 * time.Minute
	// writeTimeoutSlack is how much longer than request_timeout a
	// non-streamed response may take to write by default.
	writeTimeoutSlack = 30 * time.Second
)

// Config tunes the front end. The zero value means every default.
type Config struct {
	// Models lists the model names served; a request for another gets a
	// 404. Empty: any model is accepted and workers decide.
	Models []string `yaml:"models"`
	// PrefixLength is how much of the routing text prefix_aware hashes:
	// characters on the OpenAI routes, bytes on /invocations. 1,024–65,536;
	// default 4,096.
	PrefixLength int `yaml:"prefix_length"`
	// MaxBodyBytes limits request bodies; larger ones get a 413. Default
	// 6 MiB.
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// Retries is how many other workers a request tries when its worker
	// fails before the first token. 0–8; default 2. Set -1 for none.
	Retries int `yaml:"retries"`
	// RequestTimeout bounds a request from arrival to last byte; past it
	// the client gets a 504 (or an error event if streaming began).
	// Default 10m.
	RequestTimeout time.Duration `yaml:"request_timeout"`
	// MaxInFlight is a worker's capacity: the most requests the scheduler
	// keeps in flight on one worker. A request whose worker is full goes to
	// the least-loaded worker with room, and waits in the scheduler's queue
	// when every worker is full. Default 256, vLLM's max_num_seqs: past it
	// an engine only queues, and the scheduler queue lets a request go to
	// whichever worker frees up first. (The concurrency threshold is not a
	// capacity: it only makes prefix_aware and kv_aware spill.)
	MaxInFlight int `yaml:"max_in_flight"`
	// MaxQueue bounds the requests waiting in the scheduler when every
	// available worker is full; past it requests get a 429 with
	// Retry-After. Default 256; -1 disables the queue (such requests go to
	// the least-loaded worker at once).
	MaxQueue int `yaml:"max_queue"`
	// QueueTimeout bounds a request's wait in that queue; past it the
	// request gets a 429. Default 30s.
	QueueTimeout time.Duration `yaml:"queue_timeout"`
	// ReadTimeout bounds reading a request, from its arrival to the end of
	// its body; a client that stalls mid-body gets a 408 and its
	// connection is closed. Default 1m: a 6 MiB body over a slow link.
	ReadTimeout time.Duration `yaml:"read_timeout"`
	// WriteTimeout bounds a non-streamed exchange, from the request's
	// arrival to the last byte of its response, so that a client that
	// stops reading cannot hold a connection. Streams are bounded by
	// request_timeout only. Default request_timeout + 30s, which no
	// legitimate response reaches.
	WriteTimeout time.Duration `yaml:"write_timeout"`
	// IdleTimeout closes a kept-alive connection that carries no request
	// for this long. Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
}

// Default returns the configuration used for zero fields.
func Default() Config {
	return Config{
		PrefixLength:   DefaultPrefixLength,
		MaxBodyBytes:   openai.DefaultMaxBodyBytes,
		Retries:        DefaultRetries,
		RequestTimeout: DefaultTimeout,
		MaxQueue:       DefaultMaxQueue,
		MaxInFlight:    DefaultMaxInFlight,
		QueueTimeout:   DefaultQueueTimeout,
		ReadTimeout:    DefaultReadTimeout,
		WriteTimeout:   DefaultTimeout + writeTimeoutSlack,
		IdleTimeout:    DefaultIdleTimeout,
	}
}

// WithDefaults returns c with zero fields set to Default's values.
func (c Config) WithDefaults() Config {
	d := Default()
	if c.PrefixLength == 0 {
		c.PrefixLength = d.PrefixLength
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = d.MaxBodyBytes
	}
	if c.Retries == 0 {
		c.Retries = d.Retries
	} else if c.Retries < 0 {
		c.Retries = 0
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = d.RequestTimeout
	}
	if c.MaxQueue == 0 {
		c.MaxQueue = d.MaxQueue
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.QueueTimeout == 0 {
		c.QueueTimeout = d.QueueTimeout
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = d.ReadTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = c.RequestTimeout + writeTimeoutSlack
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	return c
}

// Validate reports the first invalid field, after defaults, by its
// configuration name.
func (c Config) Validate() error {
	c = c.WithDefaults()
	switch {
	case c.PrefixLength < MinPrefixLength || c.PrefixLength > MaxPrefixLength:
		return fmt.Errorf("prefix_length: must be %d–%d, got %d", MinPrefixLength, MaxPrefixLength, c.PrefixLength)
	case c.MaxBodyBytes < 1024:
		return fmt.Errorf("max_body_bytes: must be at least 1024, got %d", c.MaxBodyBytes)
	case c.Retries > 8:
		return fmt.Errorf("retries: must be at most 8, got %d", c.Retries)
	case c.RequestTimeout < 0:
		return fmt.Errorf("request_timeout: must be positive, got %s", c.RequestTimeout)
	case c.MaxInFlight < 1 || c.MaxInFlight > 1<<20:
		return fmt.Errorf("max_in_flight: must be 1–1048576, got %d", c.MaxInFlight)
	case c.MaxQueue < -1 || c.MaxQueue > 1<<20:
		return fmt.Errorf("max_queue: must be -1 (no queue) or 1–1048576, got %d", c.MaxQueue)
	case c.QueueTimeout < 0:
		return fmt.Errorf("queue_timeout: must be positive, got %s", c.QueueTimeout)
	case c.ReadTimeout < 0:
		return fmt.Errorf("read_timeout: must be positive, got %s", c.ReadTimeout)
	case c.WriteTimeout < 0:
		return fmt.Errorf("write_timeout: must be positive, got %s", c.WriteTimeout)
	case c.IdleTimeout < 0:
		return fmt.Errorf("idle_timeout: must be positive, got %s", c.IdleTimeout)
	}
	for i, m := range c.Models {
		if m == "" {
			return fmt.Errorf("models[%d]: must not be empty", i)
		}
	}
	return nil
}

// Server is the scheduler's HTTP handler.
type Server struct {
	cfg      Config
	pool     *pool.Pool
	strategy routing.Strategy
	metrics  *metrics.Metrics
	log      *slog.Logger
	mux      *http.ServeMux
	created  int64
	disagg   *Disagg          // nil: colocated serving only
	fallback routing.Strategy // least_outstanding: takes requests when there is no queue
	name     string           // the routing strategy's name, for metrics and headers
	usesKeys bool             // a strategy routes on block keys: compute them
	// observeTTFT hears estimated and achieved TTFT; may be nil.
	observeTTFT func(FirstToken)

	// queue holds a slot per request waiting for a worker under the
	// threshold (nil: no queue); freed is closed and replaced each time a
	// request releases a worker, waking the waiters.
	queue   chan struct{}
	freedMu sync.Mutex
	freed   chan struct{}
}

// released wakes requests waiting in the queue: a worker has one request
// fewer in flight.
func (s *Server) released() {
	s.freedMu.Lock()
	close(s.freed)
	s.freed = make(chan struct{})
	s.freedMu.Unlock()
}

func (s *Server) freedChan() <-chan struct{} {
	s.freedMu.Lock()
	defer s.freedMu.Unlock()
	return s.freed
}

// Option configures a Server.
type Option func(*Server)

// FirstToken describes, for strategies that estimate time to first token
// (kv_aware), how the estimate for the chosen worker fared.
type FirstToken struct {
	Worker             string
	Estimate, Achieved time.Duration
	// Uncached is the prompt tokens the strategy expected the worker to
	// compute.
	Uncached int
}

// WithFirstTokenObserver has fn hear about each first token of a request
// routed by a strategy that estimates time to first token.
func WithFirstTokenObserver(fn func(FirstToken)) Option {
	return func(s *Server) { s.observeTTFT = fn }
}

// WithDisagg turns on disaggregated prefill/decode.
func WithDisagg(d *Disagg) Option { return func(s *Server) { s.disagg = d } }

// New returns a Server routing with strategy over p, the workers that
// generate (colocated and decode workers). A nil log discards.
//
// With WithDisagg, while the Disagg's pool has prefill workers, strategy
// picks the prefill worker and the Disagg's DecodeStrategy the decode
// worker from p; strategy names the route in metrics and headers.
func New(cfg Config, p *pool.Pool, strategy routing.Strategy, m *metrics.Metrics, log *slog.Logger, opts ...Option) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg.WithDefaults(), pool: p, strategy: strategy, metrics: m, log: log, mux: http.NewServeMux(), created: time.Now().Unix()}
	for _, o := range opts {
		o(s)
	}
	s.freed = make(chan struct{})
	if s.cfg.MaxQueue > 0 {
		s.queue = make(chan struct{}, s.cfg.MaxQueue)
	}
	s.name = strategy.Name()
	s.usesKeys = routing.UsesKeys(strategy)
	fallback, err := routing.NewLeastOutstanding(routing.Params{})
	if err != nil {
		return nil, err
	}
	s.fallback = fallback
	if s.disagg != nil {
		s.usesKeys = s.usesKeys || routing.UsesKeys(s.disagg.DecodeStrategy)
	}
	allow := map[string][]string{} // path → methods, for 405s
	handle := func(method, path string, h http.HandlerFunc) {
		s.mux.HandleFunc(method+" "+path, h)
		allow[path] = append(allow[path], method)
		if method == http.MethodGet {
			allow[path] = append(allow[path], http.MethodHead)
		}
	}
	handle(http.MethodPost, openai.ChatPath, func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, route{kind: openai.Chat}) })
	handle(http.MethodPost, openai.CompletionPath, func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, route{kind: openai.Completion}) })
	handle(http.MethodPost, "/invocations", func(w http.ResponseWriter, r *http.Request) { s.generate(w, r, route{native: true}) })
	handle(http.MethodGet, "/v1/models", s.models)
	handle(http.MethodGet, "/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	handle(http.MethodGet, "/readyz", s.ready)
	handle(http.MethodGet, "/ping", s.ready) // SageMaker's health route
	handle(http.MethodGet, "/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}).ServeHTTP)
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if methods, ok := allow[r.URL.Path]; ok {
			w.Header().Set("Allow", strings.Join(methods, ", "))
			openai.WriteError(w, &openai.Error{Status: http.StatusMethodNotAllowed, Type: openai.TypeInvalidRequest, Code: "method_not_allowed",
				Message: fmt.Sprintf("%s %s: use %s", r.Method, r.URL.Path, strings.Join(methods, " or "))})
			return
		}
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound, Code: "unknown_route",
			Message: fmt.Sprintf("no route %s %s", r.Method, r.URL.Path)})
	})
	return s, nil
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	models := s.cfg.Models
	if len(models) == 0 {
		for _, wk := range s.pool.Snapshot().Workers {
			for _, m := range wk.ServedModels() {
				if !slices.Contains(models, m) {
					models = append(models, m)
				}
			}
		}
	}
	openai.WriteModels(w, models, s.created)
}

// knownModel reports whether model is served: listed in the configured
// models or, without such a list, served by some worker (a worker that
// declares no models may serve any).
func (s *Server) knownModel(model string) bool {
	if len(s.cfg.Models) > 0 {
		return slices.Contains(s.cfg.Models, model)
	}
	for _, wk := range s.pool.Snapshot().Workers {
		if wk.Serves(model) {
			return true
		}
	}
	return false
}

// ready answers 200 when at least one worker is available, else 503.
func (s *Server) ready(w http.ResponseWriter, r *http.Request) {
	for _, wk := range s.pool.Snapshot().Workers {
		if wk.Available() {
			w.Write([]byte("ready\n"))
			return
		}
	}
	openai.WriteError(w, openai.NoWorker("no worker is available"))
}

type route struct {
	kind   openai.Kind
	native bool // /invocations: kind detected, routed on raw body bytes
}

// generate serves one generation request.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, rt route) {
	start := time.Now()
	strategy := s.name
	req, rreq, err := s.parse(w, r, rt)
	if err != nil {
		outcome := metrics.OutcomeInvalid
		if e, ok := err.(*openai.Error); ok && e.Status == http.StatusServiceUnavailable {
			outcome = metrics.OutcomeNoWorker
		}
		s.metrics.Requests.WithLabelValues(strategy, "", outcome).Inc()
		openai.WriteError(w, err)
		return
	}
	s.metrics.Accepted.Inc()
	req.ID = openai.NewID(req.Kind)

	if !req.Stream {
		_ = http.NewResponseController(w).SetWriteDeadline(start.Add(s.cfg.WriteTimeout))
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
	defer cancel()
	x := &exchange{s: s, w: w, req: req, rreq: rreq, start: start, strategy: strategy, predicted: -1, dz: s.disaggregated()}
	outcome := x.run(ctx)

	s.metrics.Requests.WithLabelValues(strategy, x.worker, outcome).Inc()
	s.metrics.Duration.WithLabelValues(strategy, outcome).Observe(time.Since(start).Seconds())
	if outcome == metrics.OutcomeOK {
		s.metrics.Completed.Inc()
	} else {
		s.metrics.Failed.WithLabelValues(outcome).Inc()
	}
	s.log.Debug("request", "id", req.ID, "model", req.Model, "worker", x.worker, "outcome", outcome, "duration", time.Since(start))
}

// parse reads and validates the request and derives its routing request.
func (s *Server) parse(w http.ResponseWriter, r *http.Request, rt route) (*openai.Request, *routing.Request, error) {
	// The read deadline covers the body only. It stays when reading
	// failed, so that net/http's drain of an unread body fails at once and
	// the connection closes.
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(s.cfg.ReadTimeout))
	body, err := openai.ReadBody(w, r, s.cfg.MaxBodyBytes)
	if err != nil {
		return nil, nil, err
	}
	_ = rc.SetReadDeadline(time.Time{})
	kind := rt.kind
	if rt.native {
		if kind, err = openai.DetectKind(body); err != nil {
			return nil, nil, err
		}
	}
	req, err := openai.Parse(kind, body)
	if err != nil {
		return nil, nil, err
	}
	if h, ok := r.Header[HeaderTenant]; ok {
		t := ""
		if len(h) > 0 {
			t = h[0]
		}
		if err := openai.ValidTenant(t); err != nil {
			return nil, nil, openai.Invalid(HeaderTenant, "invalid_value", HeaderTenant+" "+err.Error())
		}
		if req.Tenant == "" {
			req.Tenant = t
		}
	}
	if !s.knownModel(req.Model) {
		if len(s.cfg.Models) == 0 && len(s.pool.Snapshot().Workers) == 0 {
			// No worker has said what it serves yet: not the client's
			// fault, and worth a retry.
			return nil, nil, openai.NoWorker("no worker is available yet")
		}
		return nil, nil, openai.ModelNotFound(req.Model)
	}
	seed := blockkey.Seed(req.Model, req.Tenant)
	rreq := &routing.Request{Model: req.Model, Tenant: req.Tenant}
	if s.usesKeys {
		rreq.Keys = blockkey.Append(make([]uint64, 0, len(req.Prompt)/blockkey.DefaultBlockChars), seed, req.Prompt, blockkey.DefaultBlockChars)
		rreq.Tokens = blockkey.Tokens(blockkey.Chars(req.Prompt))
	}
	if rt.native {
		rreq.PrefixKey = blockkey.PrefixBytes(seed, body, s.cfg.PrefixLength)
	} else {
		rreq.PrefixKey = blockkey.Prefix(seed, req.Prompt, s.cfg.PrefixLength)
	}
	return req, rreq, nil
}

// exchange is one request's trip through routing and workers.
type exchange struct {
	s        *Server
	w        http.ResponseWriter
	req      *openai.Request
	rreq     *routing.Request
	start    time.Time
	strategy string
	worker   string // the worker that served (or last failed) it
	tried    []*pool.Worker
	lastTok  time.Time
	route    string // X-Baton-Route of the prefill decision, if any
	// predicted is the strategy's predicted cached tokens for the worker
	// that serves, or -1 when it made no prediction.
	predicted int
	// estimate is the strategy's TTFT estimate for the worker, 0 if none.
	estimate time.Duration
	disagg   string // how the prompt was prefilled, when disaggregated
	// dz is the server's Disagg when the fleet had prefill workers as the
	// request arrived, else nil: the request is served colocated.
	dz *Disagg
}

// disaggregated returns s.disagg while it has prefill workers, else nil.
func (s *Server) disaggregated() *Disagg {
	if s.disagg == nil || len(s.disagg.Pool.Snapshot().Workers) == 0 {
		return nil
	}
	return s.disagg
}

// genStrategy picks the worker that generates: the decode strategy when
// the request is disaggregated.
func (x *exchange) genStrategy() routing.Strategy {
	if x.dz != nil {
		return x.dz.DecodeStrategy
	}
	return x.s.strategy
}

// run routes and serves the request, writing exactly one outcome to the
// client, and returns the outcome's label.
func (x *exchange) run(ctx context.Context) string {
	s := x.s
	var lastErr error
	for attempt := 0; attempt <= s.cfg.Retries; attempt++ {
		d, err := x.pick(true)
		if errors.Is(err, routing.ErrFull) {
			d, err = x.wait(ctx)
		}
		wk := d.Worker
		if err != nil {
			if lastErr != nil {
				err = lastErr
			}
			return x.fail(ctx, err)
		}
		acquired, err := wk.Acquire()
		if err != nil {
			// The breaker refused between the pick and the call.
			x.tried = append(x.tried, wk)
			attempt--
			if len(x.tried) > len(s.pool.Snapshot().Workers) {
				return x.fail(ctx, routing.ErrNoWorker)
			}
			continue
		}
		done := func(err error) {
			acquired(err)
			s.released()
		}
		x.worker = wk.Name
		x.predicted = -1
		routing.Commit(x.genStrategy(), x.rreq, d)
		if x.dz == nil && s.usesKeys {
			x.predicted = d.PredictedCached
		}
		if d.Spill && d.Home != nil {
			s.metrics.Spills.WithLabelValues(x.strategy, d.Home.Name).Inc()
		}
		h := x.w.Header()
		h.Set(HeaderWorker, wk.Name)
		var p *plan
		if x.dz != nil {
			h.Del(HeaderPrefillWorker)
			if attempt == 0 {
				// Later attempts prefill on their decode worker: the
				// transfer went to the one that failed.
				p = x.prefill(ctx, wk)
			} else {
				x.disagg = "local(decode_retry)"
				s.metrics.Fallbacks.WithLabelValues("decode_retry").Inc()
			}
			route := x.route // the prefill decision's
			if p == nil {
				route = s.name
			}
			h.Set(HeaderRoute, route+"; prefill="+x.disagg)
		} else {
			h.Set(HeaderRoute, d.RouteHit(x.strategy, x.rreq.Tokens))
		}

		written, err := x.serve(ctx, wk, p)
		done(classify(err))
		if err == nil {
			return metrics.OutcomeOK
		}
		if written || ctx.Err() != nil || !retryable(err) {
			if !written {
				return x.fail(ctx, err)
			}
			outcome := outcomeOf(ctx, err)
			if outcome == metrics.OutcomeCanceled {
				s.log.Debug("client went away mid-stream", "id", x.req.ID, "worker", wk.Name, "err", err)
			} else {
				s.log.Warn("stream broken after first token", "id", x.req.ID, "worker", wk.Name, "err", err)
			}
			return outcome
		}
		s.log.Info("worker failed before first token; retrying", "id", x.req.ID, "worker", wk.Name, "err", err)
		s.metrics.Retries.WithLabelValues("worker_error").Inc()
		x.tried = append(x.tried, wk)
		lastErr = err
	}
	return x.fail(ctx, lastErr)
}

// errOverloaded is the 429 of a request the queue could not take, or that
// waited in it too long.
var errOverloaded = &openai.Error{Status: http.StatusTooManyRequests, Type: openai.TypeOverloaded, Code: "overloaded",
	Message: "every worker is at capacity and the scheduler's queue is full; retry later", RetryAfter: 1}

// wait is called when every worker that could serve the request is at
// capacity (MaxInFlight): the request waits in the scheduler's bounded
// queue, running the pipeline again each time a worker frees up. A full
// queue or a wait past QueueTimeout is a 429. Without a queue, the
// least-loaded worker takes the request at once.
func (x *exchange) wait(ctx context.Context) (routing.Decision, error) {
	s := x.s
	if s.queue == nil {
		return x.pickWith(s.fallback, false)
	}
	select {
	case s.queue <- struct{}{}:
	default:
		s.metrics.QueueRejections.WithLabelValues("full").Inc()
		return routing.Decision{}, errOverloaded
	}
	defer func() { <-s.queue }()
	s.metrics.QueueDepth.Inc()
	defer s.metrics.QueueDepth.Dec()
	timer := time.NewTimer(s.cfg.QueueTimeout)
	defer timer.Stop()
	for {
		freed := s.freedChan()
		d, err := x.pick(true)
		if !errors.Is(err, routing.ErrFull) {
			return d, err
		}
		select {
		case <-freed:
		case <-timer.C:
			s.metrics.QueueRejections.WithLabelValues("timeout").Inc()
			return d, errOverloaded
		case <-ctx.Done():
			return d, ctx.Err()
		}
	}
}

// pick runs the pipeline of the strategy that picks the generating
// worker, skipping the workers this request already tried and, with
// capacity, those at MaxInFlight (then routing.ErrFull when all are).
func (x *exchange) pick(capacity bool) (routing.Decision, error) {
	return x.pickWith(x.genStrategy(), capacity)
}

func (x *exchange) pickWith(strategy routing.Strategy, capacity bool) (routing.Decision, error) {
	snap := x.s.pool.Snapshot()
	x.rreq.Tried, x.rreq.MaxInFlight = x.tried, 0
	if capacity {
		x.rreq.MaxInFlight = x.s.cfg.MaxInFlight
	}
	t0 := time.Now()
	var d routing.Decision
	var err error
	x.estimate = 0
	if est, ok := strategy.(routing.TTFTEstimator); ok && x.dz == nil {
		d, x.estimate, err = est.PickEstimate(x.rreq, snap)
	} else {
		d, err = strategy.Pick(x.rreq, snap)
	}
	x.s.metrics.Decision.WithLabelValues(strategy.Name()).Observe(time.Since(t0).Seconds())
	return d, err
}

// serve runs the request on wk and reports whether anything reached the
// client.
func (x *exchange) serve(ctx context.Context, wk *pool.Worker, p *plan) (bool, error) {
	m := x.s.metrics
	firstToken := func() {
		now := time.Now()
		m.TTFT.WithLabelValues(x.strategy).Observe(now.Sub(x.start).Seconds())
		x.lastTok = now
		if x.estimate > 0 && x.s.observeTTFT != nil {
			x.s.observeTTFT(FirstToken{Worker: wk.Name, Estimate: x.estimate, Achieved: now.Sub(x.start),
				Uncached: max(x.rreq.Tokens-x.predicted, 0)})
		}
	}
	if p, ok := wk.Client.(engine.Proxier); ok {
		res, err := p.Proxy(ctx, &x.req.Request, x.w, firstToken)
		if res.Usage != nil {
			x.usage(wk, res.Usage)
		}
		if err == nil && res.Status >= 400 {
			return res.Written, pool.ClientError(fmt.Errorf("engine answered %d", res.Status))
		}
		return res.Written, err
	}
	var stream engine.Stream
	var err error
	if p != nil {
		stream, err = x.decode(ctx, wk, p)
	} else {
		stream, err = wk.Client.Generate(ctx, &x.req.Request)
	}
	if err != nil {
		return false, err
	}
	defer stream.Close()
	inter := m.InterToken.WithLabelValues(x.strategy)
	final, written, err := openai.Write(x.w, x.req, x.req.ID, stream, &openai.Observer{
		FirstToken: firstToken,
		Token: func(n int) {
			now := time.Now()
			if n < 1 {
				n = 1
			}
			gap := now.Sub(x.lastTok).Seconds() / float64(n)
			for range n {
				inter.Observe(gap)
			}
			x.lastTok = now
		},
	})
	if final != nil {
		x.usage(wk, final)
	}
	return written, err
}

func (x *exchange) usage(wk *pool.Worker, f *engine.Final) {
	m := x.s.metrics
	m.PromptTokens.WithLabelValues(wk.Name).Add(float64(f.PromptTokens))
	m.CachedTokens.WithLabelValues(wk.Name).Add(float64(f.CachedTokens))
	for _, t := range []struct {
		tier   string
		tokens int
	}{{"gpu", f.CachedGPU}, {"cpu", f.CachedCPU}, {"redis", f.CachedRedis}} {
		if t.tokens > 0 {
			m.TierHits.WithLabelValues(t.tier).Add(float64(t.tokens))
		}
	}
	if x.predicted >= 0 {
		m.PredictedCached.WithLabelValues(x.strategy).Add(float64(x.predicted))
		m.AchievedCached.WithLabelValues(x.strategy).Add(float64(f.CachedTokens))
	}
}

// fail writes err to the client as an OpenAI error and returns its outcome.
func (x *exchange) fail(ctx context.Context, err error) string {
	outcome := outcomeOf(ctx, err)
	var e *openai.Error
	switch {
	case errors.As(err, &e):
	case outcome == metrics.OutcomeTimeout:
		e = openai.Timeout()
	case outcome == metrics.OutcomeCanceled:
		return outcome // nobody is listening
	case errors.Is(err, routing.ErrNoWorker):
		e = openai.NoWorker("no worker is available for model " + strconv.Quote(x.req.Model))
	case errors.Is(err, engine.ErrUnknownModel):
		e = openai.ModelNotFound(x.req.Model)
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrInvalid):
		e = openai.Invalid("", "invalid_request", "the worker rejected the request: "+err.Error())
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrTooLarge):
		e = &openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest, Code: "request_too_large",
			Message: "the request is larger than the workers accept: " + err.Error()}
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrUnavailable):
		e = openai.NoWorker("every worker tried was unavailable: " + err.Error())
		outcome = metrics.OutcomeNoWorker
	default:
		e = openai.Internal(http.StatusBadGateway, "the worker failed: "+err.Error())
	}
	x.w.Header().Del(HeaderRoute)
	if outcome == metrics.OutcomeNoWorker {
		x.w.Header().Del(HeaderWorker)
	}
	openai.WriteError(x.w, e)
	return outcome
}

func outcomeOf(ctx context.Context, err error) string {
	var e *openai.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(ctx.Err(), context.DeadlineExceeded):
		return metrics.OutcomeTimeout
	case errors.Is(err, context.Canceled) || errors.Is(err, engine.ErrClientGone) || ctx.Err() != nil:
		return metrics.OutcomeCanceled
	case errors.Is(err, routing.ErrNoWorker):
		return metrics.OutcomeNoWorker
	case errors.Is(err, errOverloaded):
		return metrics.OutcomeOverloaded
	case errors.As(err, &e) && e.Status < 500,
		errors.Is(err, engine.ErrUnknownModel), errors.Is(err, engine.ErrInvalid), errors.Is(err, engine.ErrTooLarge):
		return metrics.OutcomeInvalid
	}
	return metrics.OutcomeWorkerError
}

// retryable reports whether a failure before the first token may be retried
// on another worker: the worker was unreachable or failed, not the request.
func retryable(err error) bool {
	return pool.IsWorkerFault(err)
}

// classify turns a call's error into what the worker's breaker should hear:
// failures caused by the request or the client are not the worker's fault.
func classify(err error) error {
	var e *openai.Error
	if errors.As(err, &e) && e.Status < 500 {
		return pool.ClientError(err)
	}
	return err
}
