package frontend

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// HeaderPrefillWorker names the prefill worker when one computed the
// prompt.
const HeaderPrefillWorker = "X-Baton-Prefill-Worker"

// Disagg turns on disaggregated prefill/decode whenever its pool has
// prefill workers: the server's strategy then picks the prefill worker (by
// prefix) from that pool, and DecodeStrategy the decode worker (by load)
// from the server's pool. While the pool is empty, serving is colocated.
type Disagg struct {
	// Pool holds the prefill workers; it may be empty, and fill later.
	Pool *pool.Pool
	// DecodeStrategy picks the decode worker.
	DecodeStrategy routing.Strategy
	// MinRemoteTokens: prompts with fewer tokens left to compute on the
	// decode worker are prefilled there, with no transfer.
	MinRemoteTokens int
	// TransferTimeout bounds a push, and the decode worker's wait for it.
	TransferTimeout time.Duration
	// Retries is how many other prefill workers a request tries when its
	// prefill fails, before it prefills on the decode worker.
	Retries int
}

// Disaggregation decision reasons (baton_disagg_decisions_total).
const (
	reasonRemote          = "remote"            // prefilled on a prefill worker, blocks pushed
	reasonShort           = "short"             // the prompt is shorter than MinRemoteTokens
	reasonSkipped         = "held"              // the decode worker lacked fewer than MinRemoteTokens
	reasonNoPrefillWorker = "no_prefill_worker" // every prefill worker unavailable (breakers open)
	reasonPrefillFailed   = "prefill_failed"    // prefill workers failed, retries spent
	reasonNotDisagg       = "decode_colocated"  // the decode worker's engine cannot take transfers
	reasonRequest         = "request_rejected"  // the prefill worker rejected the request itself
	reasonTransferFailed  = "transfer_failed"   // the blocks did not reach the decode worker
	// reasonAdapter: the request names a LoRA adapter that no prefill
	// worker holds nor can load now (none has slots for it, its slots
	// serve other adapters' requests, or its loads failed).
	reasonAdapter = "adapter_unavailable"
)

// errPrefillAdapter wraps the loader's error when no prefill worker can
// take a request's adapter.
var errPrefillAdapter = errors.New("no prefill worker holds the adapter or can load it now")

// plan is the outcome of a remote prefill: the decode worker waits for the
// transfer and generates.
type plan struct {
	transferID string
	result     *engine.PrefillResult
	worker     string // the prefill worker
	// via is the handoff that made the plan and serves it.
	via handoff
	// decode is the NIXL decode request, and cached the prompt tokens to
	// report cached (-1: the decode engine's count).
	decode *engine.Request
	cached int
}

// A pairing is one protocol's part in a remote prefill (prefillLoop): which
// prefill workers speak it, and one attempt on one of them. Its functions
// are called from the request's goroutine.
type pairing struct {
	// speaks reports whether the prefill worker pw's engine speaks the
	// protocol; the loop passes over those that do not.
	speaks func(pw *pool.Worker) bool
	// try runs attempt i (0 first) on pw, acquired and its decision
	// committed. It returns the outcome the decision reports (routing.Done,
	// and pw's breaker through classify) and the prefill's failure the
	// loop acts on: nil when the request is done with prefill workers.
	try func(ctx context.Context, pw *pool.Worker, i int) (routing.DoneInfo, error)
	// unhanded records a prefill whose blocks cannot reach the decode
	// worker (engine.ErrTransfer).
	unhanded func(pw *pool.Worker, err error)
}

// prefillEnd is how prefillLoop ended.
type prefillEnd struct {
	// worker is the prefill worker whose attempt succeeded, else nil.
	worker *pool.Worker
	// reason says why none did (a local prefill's reason); empty when
	// one did, or when the client went away.
	reason string
	// err is the last prefill's failure, or the pick's when no prefill
	// worker was available.
	err error
}

// prefillLoop picks prefill workers by the prefill strategy for a request
// bound for decode worker dw and tries p on each: a worker's fault moves
// to another, up to dz.Retries of them; the request's own fault, or
// blocks that cannot reach dw, end the loop, since no prefill worker
// would do better. Every protocol's commits, outcomes, breaker reports and
// fallback counts are kept here.
func (x *exchange) prefillLoop(ctx context.Context, dw *pool.Worker, p pairing) prefillEnd {
	s, dz := x.s, x.dz
	m := s.metrics
	var tried []*pool.Worker
	var lastErr error
	for i := 0; i <= dz.Retries; i++ {
		att, err := x.startPrefill(&tried, p.speaks)
		if err != nil {
			if i == 0 {
				reason := reasonNoPrefillWorker
				if errors.Is(err, errPrefillAdapter) {
					reason = reasonAdapter
				}
				m.Fallbacks.WithLabelValues(reason).Inc()
				return prefillEnd{reason: reason, err: err}
			}
			break
		}
		pw := att.Worker()
		tried = append(tried, pw)
		info, err := p.try(ctx, pw, i)
		if info.FirstToken > 0 {
			att.FirstToken(info.FirstToken)
		}
		att.End(info.Err, classify(info.Err))
		switch {
		case ctx.Err() != nil:
			return prefillEnd{err: ctx.Err()}
		case errors.Is(err, engine.ErrTransfer):
			p.unhanded(pw, err)
			return prefillEnd{reason: reasonTransferFailed, err: err}
		case err != nil && !pool.IsWorkerFault(err):
			return prefillEnd{reason: reasonRequest, err: err}
		case err != nil:
			lastErr = err
			m.TransferFailures.WithLabelValues(failureReason(err)).Inc()
			s.log.Info("prefill failed", "id", x.req.ID, "prefill_worker", pw.Name, "decode_worker", dw.Name, "err", err)
			if i < dz.Retries {
				m.Fallbacks.WithLabelValues("prefill_retry").Inc()
			}
			continue
		}
		return prefillEnd{worker: pw}
	}
	m.Fallbacks.WithLabelValues(reasonPrefillFailed).Inc()
	return prefillEnd{reason: reasonPrefillFailed, err: lastErr}
}

// local records that the decode worker prefills the request itself.
func (x *exchange) local(reason string) *plan {
	x.s.metrics.DisaggDecisions.WithLabelValues("local", reason).Inc()
	x.disagg = "local(" + reason + ")"
	return nil
}

// fallback is the plan when no prefill worker succeeded: the decode
// worker prefills, or nothing when the client went away.
func (x *exchange) fallback(e prefillEnd) *plan {
	if e.reason == "" {
		return nil // the client is gone; serving fails with ctx
	}
	return x.local(e.reason)
}

// prefill runs the prefill phase of a request bound for decode worker dw.
// It never fails the request: when no remote prefill happens it returns nil
// and the decode worker prefills locally.
func (x *exchange) prefill(ctx context.Context, dw *pool.Worker) *plan {
	s, dz := x.s, x.dz
	m := s.metrics
	if _, ok := dw.Client.(engine.Disaggregator); !ok {
		return x.local(reasonNotDisagg)
	}
	if blockkey.Tokens(blockkey.Chars(x.req.Prompt)) < dz.MinRemoteTokens {
		return x.local(reasonShort)
	}
	var id string
	var res *engine.PrefillResult
	e := x.prefillLoop(ctx, dw, pairing{
		speaks: pushHandoff{}.speaks,
		try: func(ctx context.Context, pw *pool.Worker, i int) (routing.DoneInfo, error) {
			id = x.req.ID + "-" + strconv.Itoa(i)
			called := time.Now()
			var err error
			res, err = pw.Client.(engine.Disaggregator).Prefill(ctx, &engine.PrefillRequest{
				Request: &x.req.Request, TransferID: id, DecodeAddr: dw.Addr,
				MinRemoteTokens: dz.MinRemoteTokens, TransferTimeout: dz.TransferTimeout,
			})
			return prefillDone(x.start, called, res, err), err
		},
		unhanded: func(pw *pool.Worker, err error) {
			// Another prefill worker would push to dw too.
			m.TransferFailures.WithLabelValues("transfer").Inc()
			s.log.Info("kv transfer failed", "id", x.req.ID, "prefill_worker", pw.Name, "decode_worker", dw.Name, "err", err)
		},
	})
	if e.worker == nil {
		return x.fallback(e)
	}
	if res.Skipped {
		return x.local(reasonSkipped)
	}
	m.DisaggDecisions.WithLabelValues("remote", reasonRemote).Inc()
	x.pushed(res)
	m.TTFTPhase.WithLabelValues("queue").Observe(res.Queue.Seconds())
	m.TTFTPhase.WithLabelValues("prefill").Observe(res.Prefill.Seconds())
	m.TTFTPhase.WithLabelValues("transfer").Observe(res.Transfer.Seconds())
	x.w.Header().Set(HeaderPrefillWorker, e.worker.Name)
	x.disagg = "remote"
	return &plan{via: pushHandoff{}, transferID: id, result: res, worker: e.worker.Name}
}

// prefillDone is the outcome of a remote prefill called at called for a
// request that arrived at start: its prefill ended after the worker's
// queue and prefill time (the push to the decode worker follows).
func prefillDone(start, called time.Time, res *engine.PrefillResult, err error) routing.DoneInfo {
	if err != nil || res == nil || res.Skipped {
		return routing.DoneInfo{Err: err}
	}
	first := time.Since(start) - res.Transfer
	if res.Queue > 0 || res.Prefill > 0 {
		first = called.Sub(start) + res.Queue + res.Prefill
	}
	return routing.DoneInfo{FirstToken: first}
}

// copyPrefix copies the request's prefix from holder, the worker that
// holds it, onto dw, the idle worker kv_aware replicates it to: holder
// prefills the prompt (computing only what it lacks) and pushes the blocks
// to dw, which decodes. A copy costs a transfer where recomputing the
// prefix on dw costs its whole prefill. It returns nil, and dw
// recomputes, when either engine cannot take part or the copy fails;
// holder's failure counts against holder alone.
func (x *exchange) copyPrefix(ctx context.Context, holder, dw *pool.Worker) *plan {
	s := x.s
	m := s.metrics
	pz, ok := holder.Client.(engine.Disaggregator)
	if _, dok := dw.Client.(engine.Disaggregator); !ok || !dok || s.disagg == nil {
		m.PrefixCopies.WithLabelValues("unsupported").Inc()
		return nil
	}
	done, err := holder.Acquire()
	if err != nil {
		m.PrefixCopies.WithLabelValues("holder_unavailable").Inc()
		return nil
	}
	id := x.req.ID + "-copy"
	res, err := pz.Prefill(ctx, &engine.PrefillRequest{
		Request: &x.req.Request, TransferID: id, DecodeAddr: dw.Addr,
		MinRemoteTokens: s.disagg.MinRemoteTokens, TransferTimeout: s.disagg.TransferTimeout,
	})
	done(classify(err))
	switch {
	case err != nil:
		m.PrefixCopies.WithLabelValues("failed").Inc()
		if ctx.Err() == nil {
			s.log.Info("prefix copy failed; recomputing", "id", x.req.ID, "from", holder.Name, "to", dw.Name, "err", err)
		}
		return nil
	case res.Skipped:
		m.PrefixCopies.WithLabelValues("held").Inc()
		return nil
	}
	m.PrefixCopies.WithLabelValues("copied").Inc()
	x.pushed(res)
	x.w.Header().Set(HeaderPrefillWorker, holder.Name)
	return &plan{via: pushHandoff{}, transferID: id, result: res, worker: holder.Name}
}

// pushed records a prefill's push of KV blocks to another worker.
func (x *exchange) pushed(res *engine.PrefillResult) {
	m := x.s.metrics
	m.TransferBytes.Add(float64(res.BytesSent))
	m.TransferBlocks.WithLabelValues("sent").Add(float64(res.BlocksSent))
	m.TransferBlocks.WithLabelValues("held").Add(float64(res.BlocksHeld))
	if res.BlocksRejected > 0 {
		m.TransferBlocks.WithLabelValues("rejected").Add(float64(res.BlocksRejected))
		m.TransferFailures.WithLabelValues("corrupt").Inc()
	}
	m.TransferDuration.Observe(res.Transfer.Seconds())
}

// failureReason labels a prefill failure.
func failureReason(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, engine.ErrUnavailable):
		return "unavailable"
	}
	return "error"
}

// decode starts generation on the decode worker after a remote prefill.
func (x *exchange) decode(ctx context.Context, wk *pool.Worker, p *plan) (engine.Stream, error) {
	dz := wk.Client.(engine.Disaggregator)
	t0 := time.Now()
	stream, err := dz.Decode(ctx, &x.req.Request, p.transferID, x.s.disagg.TransferTimeout)
	if err != nil {
		return nil, fmt.Errorf("decode on %s: %w", wk.Name, err)
	}
	// Decode returns with the first event in hand.
	x.s.metrics.TTFTPhase.WithLabelValues("first_decode").Observe(time.Since(t0).Seconds())
	// Prompt tokens this request did not compute anywhere: those the
	// prefill worker found cached, or the decode worker already held.
	reused := max(p.result.CachedTokens, p.result.DecodeHeldTokens)
	return &usageStream{Stream: stream, cached: reused}, nil
}

// usageStream reports, in the final usage, the prompt tokens reused across
// the prefill and decode workers rather than the decode worker's own view
// (which counts the blocks it just received as cached).
type usageStream struct {
	engine.Stream
	cached int
}

func (s *usageStream) Recv() (engine.Event, error) {
	ev, err := s.Stream.Recv()
	if err == nil && ev.Final != nil {
		f := *ev.Final
		f.CachedTokens = min(s.cached, f.PromptTokens)
		ev.Final = &f
	}
	return ev, err
}
