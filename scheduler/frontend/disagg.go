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
	"github.com/batonllm/baton/workers/httpengine"
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
)

// plan is the outcome of a remote prefill: the decode worker waits for the
// transfer and generates.
type plan struct {
	transferID string
	result     *engine.PrefillResult
	worker     string // the prefill worker
	// protocol is the engines' own protocol, when they hand blocks off
	// by one (disagg_engine.go): decode is then the NIXL decode request,
	// and cached the prompt tokens to report cached (-1: the decode
	// engine's count).
	protocol httpengine.Protocol
	decode   *engine.Request
	cached   int
}

// prefill runs the prefill phase of a request bound for decode worker dw.
// It never fails the request: when no remote prefill happens it returns nil
// and the decode worker prefills locally.
func (x *exchange) prefill(ctx context.Context, dw *pool.Worker) *plan {
	s, dz := x.s, x.dz
	m := s.metrics
	local := x.local
	if _, ok := dw.Client.(engine.Disaggregator); !ok {
		return local(reasonNotDisagg)
	}
	if blockkey.Tokens(blockkey.Chars(x.req.Prompt)) < dz.MinRemoteTokens {
		return local(reasonShort)
	}
	var tried []*pool.Worker
	for attempt := 0; attempt <= dz.Retries; attempt++ {
		pd, err := x.pickPrefill(tried)
		if err != nil {
			if attempt == 0 {
				m.Fallbacks.WithLabelValues(reasonNoPrefillWorker).Inc()
				return local(reasonNoPrefillWorker)
			}
			break
		}
		pw := pd.Worker
		tried = append(tried, pw)
		pz, ok := pw.Client.(engine.Disaggregator)
		if !ok {
			continue
		}
		done, err := pw.Acquire()
		if err != nil {
			continue
		}
		routing.Commit(s.strategy, x.rreq, pd)
		m.Decisions.WithLabelValues(s.strategy.Name(), pd.Reason.String()).Inc()
		id := x.req.ID + "-" + strconv.Itoa(attempt)
		called := time.Now()
		res, err := pz.Prefill(ctx, &engine.PrefillRequest{
			Request: &x.req.Request, TransferID: id, DecodeAddr: dw.Addr,
			MinRemoteTokens: dz.MinRemoteTokens, TransferTimeout: dz.TransferTimeout,
		})
		routing.Done(s.strategy, x.rreq, pd, prefillDone(x.start, called, res, err))
		done(classify(err))
		if ctx.Err() != nil {
			return nil // the client is gone; serving fails with ctx
		}
		if errors.Is(err, engine.ErrTransfer) {
			// The blocks did not reach the decode worker: another prefill
			// worker would push to it too. It prefills locally.
			m.TransferFailures.WithLabelValues("transfer").Inc()
			s.log.Info("kv transfer failed", "id", x.req.ID, "prefill_worker", pw.Name, "decode_worker", dw.Name, "err", err)
			return local(reasonTransferFailed)
		}
		if err != nil && !pool.IsWorkerFault(err) {
			// The request's own fault: no prefill worker will do better,
			// and the decode worker answers it to the client.
			return local(reasonRequest)
		}
		if err != nil {
			m.TransferFailures.WithLabelValues(failureReason(err)).Inc()
			s.log.Info("prefill failed", "id", x.req.ID, "prefill_worker", pw.Name, "decode_worker", dw.Name, "err", err)
			if attempt < dz.Retries {
				m.Fallbacks.WithLabelValues("prefill_retry").Inc()
			}
			continue
		}
		if res.Skipped {
			return local(reasonSkipped)
		}
		m.DisaggDecisions.WithLabelValues("remote", reasonRemote).Inc()
		x.pushed(res)
		m.TTFTPhase.WithLabelValues("queue").Observe(res.Queue.Seconds())
		m.TTFTPhase.WithLabelValues("prefill").Observe(res.Prefill.Seconds())
		m.TTFTPhase.WithLabelValues("transfer").Observe(res.Transfer.Seconds())
		x.w.Header().Set(HeaderPrefillWorker, pw.Name)
		x.disagg = "remote"
		return &plan{transferID: id, result: res, worker: pw.Name}
	}
	m.Fallbacks.WithLabelValues(reasonPrefillFailed).Inc()
	return local(reasonPrefillFailed)
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
	return &plan{transferID: id, result: res, worker: holder.Name}
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

// pickPrefill picks a prefill worker by the prefill strategy, skipping
// those already tried.
func (x *exchange) pickPrefill(tried []*pool.Worker) (routing.Decision, error) {
	strategy := x.s.strategy
	x.rreq.Tried, x.rreq.MaxInFlight = tried, 0
	t0 := time.Now()
	d, err := strategy.Pick(x.rreq, x.dz.Pool.Snapshot())
	x.s.metrics.Decision.WithLabelValues(strategy.Name()).Observe(time.Since(t0).Seconds())
	if err != nil {
		return d, err
	}
	if d.Spill && d.Home != nil {
		x.s.metrics.Spills.WithLabelValues(strategy.Name(), d.Home.Name).Inc()
	}
	x.route = d.RouteHit(strategy.Name(), x.rreq.Tokens)
	return d, nil
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
