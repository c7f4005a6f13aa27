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
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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
	// tokenKeys, when set, keys requests by tokens (tok, built when the
	// strategies use keys) rather than text.
	tokenKeys  *TokenKeys
	tok        *tokenizer
	admission  Admission // nil: every request is admitted
	beforePick func()    // nil: none
	lora       *loader   // the LoRA adapters served (nil: none)
	// loraPrefill loads adapters onto the disaggregation's prefill
	// workers (nil: no adapters, or no disaggregation).
	loraPrefill *loader
	// gen picks the workers that generate; prefill the prefill workers
	// (nil without disaggregation).
	gen, prefill *picker

	// queue holds a slot per request waiting for a worker under the
	// threshold (nil: no queue); freed is closed and replaced each time a
	// request releases a worker, waking the waiters; freedTaken says a
	// waiter has taken freed since (without one, nothing is replaced).
	queue      chan struct{}
	freedMu    sync.Mutex
	freed      chan struct{}
	freedTaken bool

	draining atomic.Bool  // Drain was called: not ready
	inFlight atomic.Int64 // generation requests being served

	timers sync.Map // a strategy's name → its decisionTimers
	// cpuTicks counts decisions, one in cpuSampleEvery of which has its
	// thread's CPU time read; cpuRetry asks the next decision for a
	// reading when a sampled one changed threads (and so gave none).
	cpuTicks atomic.Uint64
	cpuRetry atomic.Bool
}

// decisionTimers are a strategy's decision-time histograms
// (baton_routing_decision_seconds and its thread-CPU twin).
type decisionTimers struct{ wall, cpu prometheus.Observer }

// timersFor returns the named strategy's decision-time histograms. They
// are resolved once per strategy and kept, and a caller takes them before
// it starts the clock: resolving a labelled histogram hashes its labels
// and looks them up, a few µs on a cold cache, which neither the decision
// should pay for on every request nor its timing count.
func (s *Server) timersFor(strategy string) decisionTimers {
	if t, ok := s.timers.Load(strategy); ok {
		return t.(decisionTimers)
	}
	t := decisionTimers{wall: s.metrics.Decision.WithLabelValues(strategy), cpu: s.metrics.DecisionCPU.WithLabelValues(strategy)}
	s.timers.Store(strategy, t)
	return t
}

// ErrDrained is the cause with which the scheduler cancels the requests
// still running when its drain times out (context.WithCancelCause on the
// requests' base context): they end with a stream_interrupted error event,
// or a 503 before their first byte, and the outcome "interrupted".
var ErrDrained = errors.New("the scheduler is shutting down and its drain timed out")

// errInterrupted is what a request cut short by ErrDrained answers.
var errInterrupted = &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer, Code: "stream_interrupted",
	Message: "the scheduler shut down before the request finished (drain timeout); retry it", RetryAfter: 1}

// Option configures a Server.
type Option func(*Server)

// WithDisagg turns on disaggregated prefill/decode.
func WithDisagg(d *Disagg) Option { return func(s *Server) { s.disagg = d } }

// Admission vets generation requests by who sends them (the API keys of
// scheduler/internal/auth, which wraps the Server and leaves its caller in the
// request's context).
type Admission interface {
	// Admit is called on the request's goroutine once its body is parsed
	// and its model known, before routing; it must not block. estimate is
	// the tokens the request may use: its prompt's, at 4 characters a
	// token, plus max_tokens. It returns the tenant the request must use
	// whatever its body and headers say ("" keeps theirs), or an error,
	// an *openai.Error, to answer with instead (a 429 for a limit).
	Admit(ctx context.Context, estimate int) (tenant string, err error)
	// Done is called once an admitted request ends, with the prompt and
	// completion tokens it used, or -1 when no usage was reported.
	Done(ctx context.Context, used int)
}

// WithAdmission has a vet every generation request before it is routed.
func WithAdmission(a Admission) Option { return func(s *Server) { s.admission = a } }

// WithBeforePick has f called on the request's goroutine before each
// pick of a worker: a scheduler replica applies there what the other
// replicas have decided meanwhile (replica.Sharer.Poll). f must not
// block.
func WithBeforePick(f func()) Option { return func(s *Server) { s.beforePick = f } }

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
	if s.lora != nil {
		s.lora.metrics, s.lora.pool, s.lora.freed, s.lora.log = m.NewAdapters(), p, s.released, log
		if s.disagg != nil {
			s.loraPrefill = &loader{cfg: s.lora.cfg, byName: s.lora.byName, metrics: s.lora.metrics, pool: s.disagg.Pool,
				log: log, freed: s.released, loads: make(map[string]*adapterLoad)}
		}
	}
	s.gen = &picker{s: s, pool: p, lora: s.lora, released: s.released}
	if s.disagg != nil {
		s.prefill = &picker{s: s, pool: s.disagg.Pool, lora: s.loraPrefill}
	}
	if s.cfg.MaxQueue > 0 {
		s.queue = make(chan struct{}, s.cfg.MaxQueue)
	}
	s.name = strategy.Name()
	s.usesKeys = routing.UsesKeys(strategy)
	fallback, err := routing.NewLeastOutstanding(routing.Params{}, routing.Deps{})
	if err != nil {
		return nil, err
	}
	s.fallback = fallback
	if s.disagg != nil {
		s.usesKeys = s.usesKeys || routing.UsesKeys(s.disagg.DecodeStrategy)
	}
	if tk := s.tokenKeys; tk != nil && s.usesKeys {
		if tk.Tokenizer == nil || tk.BlockSize == nil || tk.Model == nil {
			return nil, errors.New("token keys: Tokenizer, BlockSize and Model are required")
		}
		s.tok = newTokenizer(*tk, m, log)
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
	if s.lora != nil {
		for _, a := range s.lora.cfg.List {
			if slices.Contains(models, a.Base) && !slices.Contains(models, a.Name) {
				models = append(models, a.Name)
			}
		}
	}
	openai.WriteModelList(w, models, s.lora.parents(), s.created)
}

// knownModel reports whether model is served: listed in the configured
// models or, without such a list, served by some worker (a worker that
// declares no models may serve any).
func (s *Server) knownModel(model string) bool {
	if a, ok := s.adapter(model); ok {
		model = a.Base
	}
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

// adapter returns the configured LoRA adapter named model, if any.
func (s *Server) adapter(model string) (engine.Adapter, bool) {
	if s.lora == nil {
		return engine.Adapter{}, false
	}
	a, ok := s.lora.byName[model]
	return a, ok
}

// Drain marks the server as draining for shutdown: /readyz and /ping
// answer 503 from now on, so that load balancers stop sending it
// requests. Requests that still arrive are served; the caller stops
// accepting them (http.Server.Shutdown).
func (s *Server) Drain() { s.draining.Store(true) }

// InFlight returns the generation requests being served.
func (s *Server) InFlight() int { return int(s.inFlight.Load()) }

// ready answers 200 when at least one worker is available and the server
// is not draining, else 503.
func (s *Server) ready(w http.ResponseWriter, r *http.Request) {
	if s.draining.Load() {
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer, Code: "draining",
			Message: "the scheduler is shutting down"})
		return
	}
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
	s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	strategy := s.name
	req, rreq, err := s.parse(w, r, rt)
	if err != nil {
		outcome := metrics.OutcomeInvalid
		if e, ok := err.(*openai.Error); ok && e.Status == http.StatusServiceUnavailable {
			outcome = metrics.OutcomeNoWorker
		} else if ok && e.Status == http.StatusTooManyRequests {
			outcome = metrics.OutcomeRateLimited
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
	ctx := r.Context()
	if dl, ok := ctx.Deadline(); !ok || dl.After(start.Add(s.cfg.RequestTimeout)) {
		// The server did not bound the request as tightly (h1serve's
		// RequestTimeout does).
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.RequestTimeout)
		defer cancel()
	}
	x := &exchange{s: s, w: w, req: req, rreq: rreq, start: start, strategy: strategy, predicted: -1, used: -1, dz: s.disaggregated(), ctx: ctx}
	outcome := x.run(ctx)
	if s.admission != nil {
		s.admission.Done(r.Context(), x.used)
	}

	s.metrics.Requests.WithLabelValues(strategy, x.worker, outcome).Inc()
	s.metrics.Duration.WithLabelValues(strategy, outcome).Observe(time.Since(start).Seconds())
	if outcome == metrics.OutcomeOK {
		s.metrics.Completed.Inc()
	} else {
		s.metrics.Failed.WithLabelValues(outcome).Inc()
	}
	if s.log.Enabled(r.Context(), slog.LevelDebug) {
		s.log.Debug("request", "id", req.ID, "model", req.Model, "worker", x.worker, "outcome", outcome, "duration", time.Since(start))
	}
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
	if n := blockkey.Tokens(blockkey.Chars(req.Prompt)); s.cfg.MaxPromptTokens > 0 && n > s.cfg.MaxPromptTokens {
		param := "prompt"
		if req.Path == openai.ChatPath {
			param = "messages"
		}
		return nil, nil, openai.Invalid(param, "context_length_exceeded",
			fmt.Sprintf("the prompt has about %d tokens, more than this server's limit of %d (max_prompt_tokens)", n, s.cfg.MaxPromptTokens))
	}
	bound := false // the tenant is the API key's, whatever the body says
	if s.admission != nil {
		tenant, err := s.admission.Admit(r.Context(), blockkey.Tokens(blockkey.Chars(req.Prompt))+req.MaxTokens)
		if err != nil {
			return nil, nil, err
		}
		if tenant != "" {
			req.Tenant, bound = tenant, true
		}
	}
	if s.tok != nil && req.Tenant != "" && !rt.native {
		// Engines keyed by their tokens (vLLM, SGLang) isolate tenants
		// in their own caches by cache_salt, which their events carry
		// and the request's keys take (tokenizer.keys).
		req.Body = withCacheSalt(req.Body, req.Tenant, bound)
	}
	seed := blockkey.Seed(req.Model, req.Tenant)
	// An adapter's keys are seeded by its own name (req.Model), so its
	// blocks are never its base model's.
	rreq := &routing.Request{Model: req.Model, Tenant: req.Tenant}
	if a, ok := s.adapter(req.Model); ok {
		rreq.Model, rreq.Adapter = a.Base, a.Name
		rreq.LoadAdapter, rreq.AdapterBytes = true, a.Bytes
	}
	if s.usesKeys && (s.tok == nil || !s.tok.keys(r.Context(), &req.Request, rreq)) {
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
