package frontend

import (
	"context"

	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
)

// A handoff is one protocol by which a decode worker's engine gets a
// prompt prefilled by a prefill worker's: baton's push (engine.Disaggregator:
// the prefill worker pushes the blocks, the decode worker waits for them),
// vLLM's NixlConnector (the decode request carries what the prefill
// answered, and its engine pulls the blocks) and SGLang's bootstrap (both
// engines get the request at once and meet at the prefill engine's
// bootstrap server). The coordinator runs every disaggregated request
// through the handoff of its decode worker, and knows no protocol itself.
type handoff interface {
	// prepare runs before attempt n (0 first) of x's request serves on
	// decode worker dw: it prefills the prompt on a prefill worker that
	// speaks the protocol and returns what dw needs to decode, or nil
	// when dw prefills the prompt itself.
	prepare(ctx context.Context, x *exchange, dw *pool.Worker, attempt int) *plan
	// serve serves x's request on dw after prepare returned p (not nil),
	// calling firstToken at its first token, and reports whether anything
	// reached the client.
	serve(ctx context.Context, x *exchange, dw *pool.Worker, p *plan, firstToken func()) (written bool, err error)
	// speaks reports whether prefill worker pw's engine takes part in the
	// protocol.
	speaks(pw *pool.Worker) bool
	// alone reports whether the decode engine serves a request with no
	// prefill worker when it must (a prompt too short to hand off).
	alone() bool
}

// handoffOf returns the handoff of wk's engine: the protocol its client
// declares (httpengine's), else baton's push.
func handoffOf(wk *pool.Worker) handoff {
	if d, ok := wk.Client.(engineDisaggregator); ok {
		if h, ok := handoffs[d.Protocol()]; ok {
			return h
		}
	}
	return pushHandoff{}
}

// handoffs are the handoffs of the protocols HTTP engines declare.
var handoffs = map[httpengine.Protocol]handoff{
	httpengine.NIXL:      nixlHandoff{},
	httpengine.Bootstrap: bootstrapHandoff{},
}

// pushHandoff is baton's own: the prefill worker computes the prompt and
// pushes its blocks to the decode worker, which waits for them (prefill,
// decode). A decode worker whose engine cannot take pushed blocks
// prefills itself.
type pushHandoff struct{}

func (pushHandoff) prepare(ctx context.Context, x *exchange, dw *pool.Worker, attempt int) *plan {
	if attempt > 0 {
		// The transfer went to the decode worker that failed: later
		// attempts prefill on their own.
		x.disagg = "local(decode_retry)"
		x.s.metrics.Fallbacks.WithLabelValues("decode_retry").Inc()
		return nil
	}
	return x.prefill(ctx, dw)
}

func (pushHandoff) serve(ctx context.Context, x *exchange, dw *pool.Worker, p *plan, firstToken func()) (bool, error) {
	stream, err := x.decode(ctx, dw, p)
	if err != nil {
		return false, err
	}
	return x.relay(ctx, dw, stream, firstToken)
}

func (pushHandoff) speaks(pw *pool.Worker) bool {
	_, ok := pw.Client.(engine.Disaggregator)
	return ok
}

func (pushHandoff) alone() bool { return true }

// nixlHandoff is vLLM's NixlConnector: every attempt pairs anew, since the
// prefill engine holds its blocks for its pair's decode request only.
type nixlHandoff struct{}

func (nixlHandoff) prepare(ctx context.Context, x *exchange, dw *pool.Worker, attempt int) *plan {
	return x.prefillNIXL(ctx, dw, attempt)
}

func (nixlHandoff) serve(ctx context.Context, x *exchange, dw *pool.Worker, p *plan, firstToken func()) (bool, error) {
	dc := dw.Client.(engineDisaggregator)
	var res engine.ProxyResult
	var err error
	if p.cached >= 0 {
		res, err = dc.ProxyCached(ctx, p.decode, x.w, firstToken, p.cached)
	} else {
		res, err = dc.Proxy(ctx, p.decode, x.w, firstToken)
	}
	return x.proxied(dw, res, err)
}

func (nixlHandoff) speaks(pw *pool.Worker) bool {
	_, ok := handoffOf(pw).(nixlHandoff)
	return ok
}

func (nixlHandoff) alone() bool { return true }

// bootstrapHandoff is SGLang's: prefill and decode run at once
// (serveBootstrap), so the plan is made as the request is served. A
// decode engine never prefills alone.
type bootstrapHandoff struct{}

func (bootstrapHandoff) prepare(context.Context, *exchange, *pool.Worker, int) *plan {
	return &plan{via: bootstrapHandoff{}}
}

func (bootstrapHandoff) serve(ctx context.Context, x *exchange, dw *pool.Worker, _ *plan, firstToken func()) (bool, error) {
	return x.serveBootstrap(ctx, dw, firstToken)
}

func (bootstrapHandoff) speaks(pw *pool.Worker) bool {
	_, ok := handoffOf(pw).(bootstrapHandoff)
	return ok
}

func (bootstrapHandoff) alone() bool { return false }
