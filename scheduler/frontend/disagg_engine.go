package frontend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/openai"
)

// Disaggregation between engines that hand KV blocks to each other by
// their own protocols (vLLM's NixlConnector, SGLang's bootstrap server);
// the coordinator only pairs them and carries the protocol's fields.

// engineDisaggregator is implemented by clients of OpenAI HTTP engines
// that serve disaggregated prefill or decode by their own protocol
// (httpengine.Client of vllm and sglang workers with role prefill or
// decode). Its methods are called from the request's goroutine, except
// PrefillBootstrap, which runs on its own beside the decode's Proxy.
type engineDisaggregator interface {
	engine.Proxier
	// Protocol is the engine's protocol; httpengine.Colocated: none.
	Protocol() httpengine.Protocol
	// Bootstrap is the address of a Bootstrap prefill engine's bootstrap
	// server, which the decode engine reaches.
	Bootstrap() (host string, port int)
	// PrefillNIXL runs a NIXL prefill and returns the transfer parameters
	// for the decode request; errors wrapping engine.ErrTransfer mean the
	// engine cannot hand its blocks off.
	PrefillNIXL(ctx context.Context, req *engine.Request) (*httpengine.NIXLResult, error)
	// PrefillBootstrap sends a Bootstrap prefill, calls started once the
	// engine accepted it, and returns its usage when its response ends.
	PrefillBootstrap(ctx context.Context, req *engine.Request, started func()) (*httpengine.BootstrapResult, error)
	// ProxyCached is Proxy, reporting cached prompt tokens in the usage.
	ProxyCached(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func(), cached int) (engine.ProxyResult, error)
	// ProxyCachedFunc is ProxyCached with the count asked for when the
	// usage arrives; false keeps the engine's.
	ProxyCachedFunc(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func(), cached func() (int, bool)) (engine.ProxyResult, error)
}

// newRoom returns a bootstrap room: SGLang's are random 63-bit integers.
var newRoom = func() uint64 { return uint64(rand.Int64()) }

// prefillNIXL runs the prefill of a request bound for dw, a vLLM decode
// engine, on a vLLM prefill engine, and returns the decode request that
// pulls its blocks. Each attempt of the request makes a new pair (the
// prefill engine holds its blocks for the decode request of that pair
// only); a failed prefill moves to another prefill worker, up to the
// retries, and then, returning nil, to a local prefill on dw.
func (x *exchange) prefillNIXL(ctx context.Context, dw *pool.Worker, attempt int) *plan {
	s := x.s
	m := s.metrics
	if blockkey.Tokens(blockkey.Chars(x.req.Prompt)) < x.dz.MinRemoteTokens {
		return x.local(reasonShort)
	}
	var req engine.Request
	var res *httpengine.NIXLResult
	var called time.Time
	e := x.prefillLoop(ctx, dw, pairing{
		speaks: nixlHandoff{}.speaks,
		try: func(ctx context.Context, pw *pool.Worker, i int) (routing.DoneInfo, error) {
			// Both requests of a pair carry its id (X-Request-Id): vLLM
			// keys the blocks it holds for the decode engine by it.
			req = x.req.Request
			req.ID = x.req.ID + "-" + strconv.Itoa(attempt) + "-" + strconv.Itoa(i)
			called = time.Now()
			var err error
			res, err = pw.Client.(engineDisaggregator).PrefillNIXL(ctx, &req)
			info := routing.DoneInfo{Err: err}
			if err == nil {
				info.FirstToken = time.Since(x.start)
			}
			return info, err
		},
		unhanded: func(pw *pool.Worker, err error) {
			m.TransferFailures.WithLabelValues("no_kv_transfer_params").Inc()
			s.log.Warn("prefill engine cannot hand off its KV cache", "id", x.req.ID, "prefill_worker", pw.Name, "err", err)
		},
	})
	if e.worker == nil {
		return x.fallback(e)
	}
	var err error
	if req.Body, err = httpengine.NIXLDecodeBody(x.req.Body, res.Params); err != nil {
		return x.local(reasonRequest)
	}
	cached := -1 // without the prefill's count, the decode engine's
	if res.Usage != nil && res.CachedReported {
		cached = res.Usage.CachedTokens
	}
	m.DisaggDecisions.WithLabelValues("remote", reasonRemote).Inc()
	m.TTFTPhase.WithLabelValues("prefill").Observe(time.Since(called).Seconds())
	x.w.Header().Set(HeaderPrefillWorker, e.worker.Name)
	x.disagg = "remote"
	return &plan{via: nixlHandoff{}, worker: e.worker.Name, decode: &req, cached: cached}
}

// errPrefillFailed cancels a Bootstrap decode whose prefill failed.
var errPrefillFailed = errors.New("the paired prefill failed")

// serveBootstrap serves the request on dw, an SGLang decode engine, paired
// with an SGLang prefill engine: both get the request with the prefill
// engine's bootstrap address and a new room, at once. A prefill that
// fails before the decode engine's answer reached the client cancels the
// decode and pairs dw with another prefill worker and a new room, up to
// the retries; a decode engine cannot prefill alone, so when they are
// spent the request fails (with no fault of dw's).
func (x *exchange) serveBootstrap(ctx context.Context, dw *pool.Worker, firstToken func()) (bool, error) {
	m := x.s.metrics
	dc := dw.Client.(engineDisaggregator)
	h := x.w.Header()
	// The last pair's outcome: whether its decode reached the client, and
	// how it ended.
	var written bool
	var err error
	e := x.prefillLoop(ctx, dw, pairing{
		speaks: bootstrapHandoff{}.speaks,
		try: func(ctx context.Context, pw *pool.Worker, i int) (routing.DoneInfo, error) {
			pc := pw.Client.(engineDisaggregator)
			host, port := pc.Bootstrap()
			req := x.req.Request
			req.ID = x.req.ID + "-" + strconv.Itoa(i)
			if req.Body, err = httpengine.BootstrapBody(x.req.Body, host, port, newRoom()); err != nil {
				written = false
				return routing.DoneInfo{Err: err}, err
			}
			h.Set(HeaderPrefillWorker, pw.Name)
			h.Set(HeaderRoute, x.route+"; prefill=remote"+x.adapterRoute(true))
			x.disagg = "remote"
			var info routing.DoneInfo
			var res engine.ProxyResult
			var perr error
			res, written, err, perr = x.pair(ctx, pc, dc, &req, firstToken, func(first time.Duration, err error) {
				info = routing.DoneInfo{FirstToken: first, Err: err}
			})
			if written {
				m.DisaggDecisions.WithLabelValues("remote", reasonRemote).Inc()
				if res.Usage != nil {
					x.usage(dw, res.Usage)
				}
				if err == nil && res.Status >= 400 {
					err = pool.ClientError(fmt.Errorf("engine answered %d", res.Status))
				}
				perr = nil
			}
			// perr: the prefill failed and nothing reached the client.
			return info, perr
		},
		unhanded: func(*pool.Worker, error) {}, // SGLang's prefill has no hand-off of its own to fail
	})
	switch {
	case e.worker != nil || e.reason == "":
		return written, err
	case e.reason == reasonNoPrefillWorker || e.reason == reasonPrefillFailed || e.reason == reasonAdapter:
		h.Del(HeaderPrefillWorker)
		msg := "no prefill worker could serve the request, and decode workers cannot prefill alone"
		if e.err != nil {
			msg = withEngineSaid(msg, e.err)
		}
		// Not the decode worker's fault, nor worth another one.
		return false, pool.ClientError(openai.NoWorker(msg))
	}
	h.Del(HeaderPrefillWorker)
	return false, pool.ClientError(e.err)
}

// prefillUsageWait bounds how long the decode engine's usage waits for
// its prefill's answer, which says how many prompt tokens the prefill
// engine found cached. The prefill engine answers once its blocks reached
// the decode engine, so the wait is only ever felt by answers of a token
// or two.
const prefillUsageWait = time.Second

// pair sends req to the prefill engine pc and the decode engine dc at once
// and relays the decode engine's response to the client once the prefill
// engine accepted its part, or the decode engine answered. A prefill
// refused before that cancels the decode: written is false, and perr says
// why. prefilled is called once the prefill ended, with the time of its
// acceptance. The usage relayed reports the prefill engine's cached
// tokens, as for vLLM, when its answer reported them: an SGLang decode
// engine reports what the prefill engine sent it with the blocks (newer
// versions) or nothing (older ones).
func (x *exchange) pair(ctx context.Context, pc, dc engineDisaggregator, req *engine.Request, firstToken func(),
	prefilled func(time.Duration, error)) (res engine.ProxyResult, written bool, err, perr error) {
	pctx, pcancel := context.WithCancel(ctx)
	defer pcancel()
	dctx, dcancel := context.WithCancelCause(ctx)
	defer dcancel(nil)
	g := &gate{w: x.w}
	ended := make(chan struct{})
	var first time.Duration
	var prefillErr error
	var prefillRes *httpengine.BootstrapResult
	go func() {
		defer close(ended)
		ok := false
		prefillRes, prefillErr = pc.PrefillBootstrap(pctx, req, func() {
			ok = true
			first = time.Since(x.start)
			g.accept()
		})
		if !ok && pctx.Err() == nil {
			// Refused on its own, not cancelled once the decode ended.
			g.refuse()
			dcancel(errPrefillFailed)
		}
	}()
	cached := func() (int, bool) {
		t := time.NewTimer(prefillUsageWait)
		defer t.Stop()
		select {
		case <-ended:
			if r := prefillRes; r != nil && r.CachedReported {
				return r.Usage.CachedTokens, true
			}
		case <-t.C:
		case <-dctx.Done():
		}
		return 0, false
	}
	res, err = dc.ProxyCachedFunc(dctx, req, g, g.onFirst(firstToken), cached)
	if err == nil {
		// The decode engine answered: with the blocks, or a refusal of
		// the request itself, relayed as is.
		g.release()
	}
	pcancel() // a prefill still running once its decode ended is of no use
	<-ended
	prefilled(first, prefillErr)
	if err != nil && !g.open && ctx.Err() == nil && errors.Is(context.Cause(dctx), errPrefillFailed) {
		return res, false, err, prefillErr
	}
	return res, g.open, err, nil
}

// gate holds back what the decode engine relays until its paired prefill
// engine accepted the request, so that a prefill refused meanwhile leaves
// the client untouched and the request free to pair again. The decode's
// relay writes to it from the request's goroutine; the prefill's
// goroutine opens it (accept), sending what was held back at once.
type gate struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	open    bool // what came so far went to the client; read once pair's goroutine ended
	refused bool // the prefill was refused: held back unless the decode answers
	status  int
	buf     bytes.Buffer
	first   func() // the first token, held back with the bytes
}

func (g *gate) Header() http.Header { return g.w.Header() }

func (g *gate) WriteHeader(status int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open {
		g.w.WriteHeader(status)
		return
	}
	g.status = status
}

func (g *gate) Write(b []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open {
		return g.w.Write(b)
	}
	if g.status == 0 {
		g.status = http.StatusOK // as net/http writes it
	}
	return g.buf.Write(b)
}

// FlushError flushes what went through (http.ResponseController's hook).
func (g *gate) FlushError() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open {
		return http.NewResponseController(g.w).Flush()
	}
	return nil
}

// accept opens the gate unless the prefill was refused.
func (g *gate) accept() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.refused {
		g.releaseLocked()
	}
}

// refuse keeps the gate shut until the decode engine answers.
func (g *gate) refuse() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.refused = true
}

// release sends what was held back, and lets everything through.
func (g *gate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.releaseLocked()
}

func (g *gate) releaseLocked() {
	if g.open {
		return
	}
	g.open = true
	if g.status == 0 {
		return // nothing came yet: what comes goes through
	}
	g.w.WriteHeader(g.status)
	if g.buf.Len() > 0 {
		_, _ = g.w.Write(g.buf.Bytes())
		g.buf.Reset()
	}
	_ = http.NewResponseController(g.w).Flush()
	if f := g.first; f != nil {
		g.first = nil
		f()
	}
}

// onFirst returns the decode's first-token callback, deferred to the
// gate's opening when the token is held back.
func (g *gate) onFirst(f func()) func() {
	return func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.open {
			f()
			return
		}
		g.first = f
	}
}
