package frontend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/openai"
)

// The coordinator: one request's life once it is parsed (an exchange):
// picking through the routing pipeline, the queue, attempts and retries,
// disaggregated prefill (disagg.go), relaying the stream and reporting the
// outcome, exactly one of them, to the client, the breakers and metrics.

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
	// att is the generating worker's attempt under way: its committed
	// decision, slot, adapter pin and what its strategy hears of it.
	att    *routing.Attempt
	disagg string // how the prompt was prefilled, when disaggregated
	used   int    // prompt and completion tokens reported; -1: none
	// dz is the server's Disagg when the fleet had prefill workers as the
	// request arrived, else nil: the request is served colocated.
	dz *Disagg
	// ctx is the request's; adapter is how its LoRA adapter was found
	// on the generating worker picked last (held or loaded), empty for a
	// base model.
	ctx     context.Context
	adapter string
	// prefillAdapter is how the adapter was found on the prefill worker
	// picked last, when disaggregated (held or loaded).
	prefillAdapter string
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
		att, err := x.decide(ctx)
		if err != nil {
			if lastErr != nil {
				err = lastErr
			}
			return x.fail(ctx, err)
		}
		d := att.Decision()
		wk := d.Worker
		h := x.w.Header()
		h.Set(HeaderWorker, wk.Name)
		var p *plan
		if x.dz != nil {
			h.Del(HeaderPrefillWorker)
			p = handoffOf(wk).prepare(ctx, x, wk, attempt)
			route := x.route // the prefill decision's
			if p == nil {
				route = s.name
			} else {
				// The strategy estimated a local prefill, which did not
				// happen.
				att.Unestimated()
			}
			h.Set(HeaderRoute, route+"; prefill="+x.disagg+x.adapterRoute(p != nil))
			if x.adapter != "" {
				s.lora.metrics.Requests.WithLabelValues(x.rreq.Adapter, x.adapter).Inc()
			}
		} else {
			route := d.RouteHit(x.strategy, x.rreq.Tokens)
			if x.adapter != "" {
				route += "; adapter=" + x.adapter
				s.lora.metrics.Requests.WithLabelValues(x.rreq.Adapter, x.adapter).Inc()
			}
			h.Set(HeaderRoute, route)
			if d.Reason == routing.ReasonReplicate && d.Home != nil && d.Home != wk {
				// The prefix moves by transfer, not recomputation: the
				// estimate was of the latter.
				if p = x.copyPrefix(ctx, d.Home, wk); p != nil {
					att.Unestimated()
				}
			}
		}

		written, err := x.serve(ctx, wk, p)
		att.End(err, classify(err))
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

// adapterRoute is what X-Baton-Route says of a disaggregated request's
// adapter: how the decode worker had it and, when remote is true (a
// prefill worker computed the prompt), how the prefill worker had it.
func (x *exchange) adapterRoute(remote bool) string {
	if x.adapter == "" {
		return ""
	}
	r := "; adapter=" + x.adapter
	if remote && x.prefillAdapter != "" {
		r += "; prefill_adapter=" + x.prefillAdapter
	}
	return r
}

// serve runs the request on wk and reports whether anything reached the
// client.
func (x *exchange) serve(ctx context.Context, wk *pool.Worker, p *plan) (bool, error) {
	m := x.s.metrics
	firstToken := func() {
		wk.Answered()
		now := time.Now()
		m.TTFT.WithLabelValues(x.strategy).Observe(now.Sub(x.start).Seconds())
		x.lastTok = now
		x.att.FirstToken(now.Sub(x.start))
	}
	if p != nil {
		return p.via.serve(ctx, x, wk, p, firstToken)
	}
	if pr, ok := wk.Client.(engine.Proxier); ok {
		res, err := pr.Proxy(ctx, &x.req.Request, x.w, firstToken)
		return x.proxied(wk, res, err)
	}
	stream, err := wk.Client.Generate(ctx, &x.req.Request)
	if err != nil {
		return false, err
	}
	return x.relay(ctx, wk, stream, firstToken)
}

// proxied is the outcome of a response an engine's client relayed
// (engine.Proxier): its usage recorded, an error status the request's
// fault.
func (x *exchange) proxied(wk *pool.Worker, res engine.ProxyResult, err error) (bool, error) {
	if res.Usage != nil {
		x.usage(wk, res.Usage)
	}
	if err == nil && res.Status >= 400 {
		return res.Written, pool.ClientError(fmt.Errorf("engine answered %d", res.Status))
	}
	return res.Written, err
}

// relay writes a worker's stream to the client in the OpenAI format and
// reports whether anything reached it.
func (x *exchange) relay(ctx context.Context, wk *pool.Worker, stream engine.Stream, firstToken func()) (bool, error) {
	defer stream.Close()
	stream = drainStream{stream, ctx}
	m := x.s.metrics
	inter := m.InterToken.WithLabelValues(x.strategy)
	final, written, err := openai.Write(x.w, x.req, x.req.ID, stream, &openai.Observer{
		FirstToken: firstToken,
		Token: func(n int) {
			wk.Answered()
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

// drainStream is a worker's stream whose error, once the scheduler's drain
// timed out (ErrDrained), says so: the client's stream_interrupted event
// then tells why it broke.
type drainStream struct {
	engine.Stream
	ctx context.Context
}

func (d drainStream) Recv() (engine.Event, error) {
	ev, err := d.Stream.Recv()
	var e *openai.Error
	switch {
	case err == nil:
	case errors.Is(context.Cause(d.ctx), ErrDrained):
		return ev, errInterrupted
	case errors.Is(err, io.EOF) || errors.As(err, &e):
	case d.ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		// The request's deadline or its client: the outcome says so
		// (504, or nobody listening), not the worker.
	default:
		// The client's stream_interrupted event says what the engine
		// said, not where it is.
		return ev, fmt.Errorf("%w: %w", &openai.Error{Status: http.StatusBadGateway, Type: openai.TypeServer, Code: "stream_interrupted",
			Message: withEngineSaid("the worker stream ended early", err)}, err)
	}
	return ev, err
}

func (x *exchange) usage(wk *pool.Worker, f *engine.Final) {
	x.used = f.PromptTokens + f.CompletionTokens
	x.att.Usage(f.PromptTokens, f.CachedTokens)
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
	case outcome == metrics.OutcomeInterrupted:
		e = errInterrupted
	case errors.As(err, &e):
	case outcome == metrics.OutcomeTimeout:
		e = openai.Timeout()
	case outcome == metrics.OutcomeCanceled:
		return outcome // nobody is listening
	case errors.Is(err, errNoAdapterWorker):
		e = adapterError(err)
		outcome = metrics.OutcomeNoWorker
	case errors.Is(err, routing.ErrNoWorker):
		e = openai.NoWorker("no worker is available for model " + strconv.Quote(x.req.Model))
	case errors.Is(err, engine.ErrUnknownModel):
		e = openai.ModelNotFound(x.req.Model)
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrInvalid):
		e = openai.Invalid("", "invalid_request", withEngineSaid("the worker rejected the request", err))
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrTooLarge):
		e = &openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest, Code: "request_too_large",
			Message: withEngineSaid("the request is larger than the workers accept", err)}
		outcome = metrics.OutcomeInvalid
	case errors.Is(err, engine.ErrUnavailable):
		e = openai.NoWorker(withEngineSaid("every worker tried was unavailable", err))
		outcome = metrics.OutcomeNoWorker
	default:
		e = openai.Internal(http.StatusBadGateway, withEngineSaid("the worker failed", err))
	}
	if e.Status >= 500 {
		// The client reads what the engine said; the log keeps where
		// it is.
		x.s.log.Warn("request failed", "id", x.req.ID, "model", x.req.Model, "worker", x.worker, "status", e.Status, "err", err)
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
	case errors.Is(context.Cause(ctx), ErrDrained):
		return metrics.OutcomeInterrupted
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
