package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/workers/engine"
)

// Errors of Prefill and Decode; match them with errors.Is.
var (
	// ErrRole: the call is not served by this worker's role (Prefill on a
	// decode worker, Decode on a prefill worker).
	ErrRole = errors.New("not served by this worker's role")
	// ErrTransfer: asking the decode worker what it holds, or pushing the
	// blocks to it, failed. It wraps engine.ErrTransfer and
	// engine.ErrUnavailable; the decode worker recomputes whatever it
	// lacks.
	ErrTransfer = fmt.Errorf("%w: %w", engine.ErrTransfer, engine.ErrUnavailable)
)

// SkipShort is PrefillResult.SkipReason when the decode worker lacks fewer
// than MinRemoteTokens tokens.
const SkipShort = "short"

// Transfers received are remembered this long after they end, so a Decode
// arriving after its transfer finished sees it; at most maxTransfers are
// kept (the oldest finished ones are forgotten first).
const (
	transferRetention = time.Minute
	maxTransfers      = 16384
)

// BlockBytes returns the payload size of one KV block as transfers move
// it: kvblock.Size(KVBytesPerToken, BlockTokens, Config.KVScale).
func (e *Engine) BlockBytes() int { return e.blockBytes }

// linkDelay is the modelled time the link takes to carry n blocks of real
// (unscaled) KV, in real time: n × KVBytesPerToken × BlockTokens /
// Disagg.LinkBandwidth / TimeScale.
func (e *Engine) linkDelay(n int) time.Duration {
	if n == 0 || e.cfg.Disagg.LinkBandwidth < 0 {
		return 0
	}
	bytes := float64(n) * float64(e.cost.KVBytesPerToken()) * BlockTokens
	return time.Duration(bytes / e.cfg.Disagg.LinkBandwidth / e.cfg.TimeScale * float64(time.Second))
}

// Prefill runs req's prefill on this worker and pushes the KV blocks the
// decode worker at req.DecodeAddr lacks to it over tr, under
// req.TransferID.
//
// It first asks the decode worker which of the prompt's blocks it holds.
// If the tokens it lacks after its leading held blocks are fewer than
// req.MinRemoteTokens, Prefill computes and sends nothing and returns a
// result with Skipped set (SkipReason SkipShort): the decode worker should
// prefill locally (Decode with no transfer id). Otherwise a prefill-only
// sequence joins the batch like any other (reusing this worker's cached
// blocks, prefilled in chunks, timed by the cost model); once its prompt
// is computed its blocks stay referenced while the blocks the decode
// worker does not hold are pushed (after the modelled link time, see
// Config.Disagg.LinkBandwidth), then released. The push runs on the
// caller's goroutine, never on the step loop, and is bounded by
// req.TransferTimeout when set.
//
// A request naming one of the engine's LoRA adapters is prefilled with the
// adapter in a slot, loaded first if need be (as Generate does), and its
// blocks are keyed by the adapter's name: the decode worker holds them for
// that adapter alone, never for the base model or another adapter.
//
// Errors: ErrRole, ErrUnknownModel, ErrInvalid, ErrClosed, ErrTransfer
// (wrapped), or ctx's error when ctx ended. Cancelling ctx cancels the
// prefill or the push and releases the blocks.
func (e *Engine) Prefill(ctx context.Context, req *engine.PrefillRequest, tr transfer.Transport) (*engine.PrefillResult, error) {
	if !e.cfg.servesPrefill() {
		return nil, fmt.Errorf("prefill on a %s worker: %w", e.cfg.Role, ErrRole)
	}
	if req == nil {
		return nil, fmt.Errorf("nil prefill request: %w", ErrInvalid)
	}
	if req.TransferID == "" || req.DecodeAddr == "" {
		return nil, fmt.Errorf("prefill needs a transfer id and a decode address: %w", ErrInvalid)
	}
	if tr == nil {
		return nil, fmt.Errorf("%w: no transport configured", ErrTransfer)
	}
	s, err := e.newSeq(ctx, req.Request, true)
	if err != nil {
		return nil, err
	}
	bounded := func() (context.Context, context.CancelFunc) {
		if req.TransferTimeout > 0 {
			return context.WithTimeout(ctx, req.TransferTimeout)
		}
		return ctx, func() {}
	}

	hctx, cancel := bounded()
	held, err := tr.Has(hctx, req.DecodeAddr, s.Keys)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: asking %s which blocks it holds: %w", ErrTransfer, req.DecodeAddr, err)
	}
	if len(held) != len(s.Keys) {
		return nil, fmt.Errorf("%w: %s answered %d of %d keys", ErrTransfer, req.DecodeAddr, len(held), len(s.Keys))
	}
	lead := 0
	for lead < len(held) && held[lead] {
		lead++
	}
	res := &engine.PrefillResult{
		PromptTokens:     s.Prompt,
		DecodeHeldTokens: min(lead*BlockTokens, s.Prompt),
	}
	if s.Prompt-lead*BlockTokens < req.MinRemoteTokens {
		res.Skipped, res.SkipReason = true, SkipShort
		return res, nil
	}

	// An adapter's prefill runs once the adapter is in a slot, loaded if
	// need be; it keeps the slot until its prompt is computed.
	unslot := func() {}
	if s.adapter != "" {
		if unslot, err = e.lora.acquire(ctx, s.adapter); err != nil {
			return nil, err
		}
	}
	defer unslot()

	// Prefill: fetch what the shared tier has, queue, compute, and take
	// over the blocks' references.
	if err := e.fetch(ctx, s); err != nil {
		return nil, err
	}
	if err := e.enqueue(s); err != nil {
		return nil, err
	}
	e.wake()
	select {
	case <-s.pre.done:
	case <-ctx.Done():
		s.cancel()
		<-s.pre.done // the loop drops it (or hands it over just before)
		if s.pre.handed {
			e.releaseHanded(s)
		}
		return nil, ctx.Err()
	}
	unslot() // the push needs no adapter
	if !s.pre.handed {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, s.pre.err
	}
	defer e.releaseHanded(s)
	res.CachedTokens = s.Cached
	res.Queue = s.pre.admitted.Sub(s.queued)
	res.Prefill = s.pre.prefilled.Sub(s.pre.admitted)

	// Push the blocks the decode worker lacks, their payloads written as
	// they are sent (transfer.PushFill): a push holds one block's payload,
	// not the prompt's.
	pushStart := time.Now()
	keys := make([]uint64, 0, len(s.Keys))
	for i, k := range s.Keys {
		if held[i] {
			res.BlocksHeld++
			continue
		}
		keys = append(keys, k)
	}
	pctx, cancel := bounded()
	defer cancel()
	stats, err := e.push(pctx, tr, req.DecodeAddr, req.TransferID, keys)
	res.Transfer = time.Since(pushStart)
	e.statsMu.Lock()
	e.stats.Pushes++
	if err != nil {
		e.stats.PushFailures++
	} else {
		e.stats.PushBlocks += uint64(len(keys))
		e.stats.PushBytes += uint64(stats.Bytes)
	}
	e.statsMu.Unlock()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: pushing %d blocks to %s: %w", ErrTransfer, len(keys), req.DecodeAddr, err)
	}
	res.BlocksSent = len(keys)
	res.BytesSent = stats.Bytes
	res.BlocksRejected = stats.Rejected
	return res, nil
}

// releaseHanded releases the blocks a prefill-only sequence handed over
// (handOver) and wakes the step loop: the head of its queue may have been
// waiting for them, and nothing else would wake it.
func (e *Engine) releaseHanded(s *seq) {
	e.cache.Release(s.Keys[:s.Held], 0)
	e.wake()
}

// push sleeps the modelled link time of the blocks of keys, then pushes
// them.
func (e *Engine) push(ctx context.Context, tr transfer.Transport, addr, id string, keys []uint64) (transfer.PushStats, error) {
	if d := e.linkDelay(len(keys)); d > 0 && !sleepUntil(time.Now().Add(d), nil, e.quit, ctx.Done()) {
		if err := ctx.Err(); err != nil {
			return transfer.PushStats{}, err
		}
		return transfer.PushStats{}, ErrClosed
	}
	return transfer.PushFill(ctx, tr, addr, id, keys, e.blockBytes, kvblock.Fill)
}

func (e *Engine) getBuf() *[]byte {
	if b, ok := e.bufs.Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, e.blockBytes)
	return &b
}

func (e *Engine) putBuf(b []byte) {
	if len(b) == e.blockBytes {
		e.bufs.Put(&b)
	}
}

// Decode generates req on this worker, as Generate does, after waiting for
// transfer transferID (if not empty) to end, at most timeout (0:
// Config.Disagg.TransferTimeout). A transfer that fails, arrives corrupt
// or does not end in time never fails the request: the worker computes
// whatever prompt blocks its cache still lacks. The final usage's cached
// tokens count the prompt tokens found in this worker's cache at
// admission, transferred blocks included. A request naming a LoRA adapter
// runs with it in a slot, as Generate's do.
//
// It fails with ErrRole, ErrUnknownModel, ErrInvalid, ErrClosed (wrapped)
// or ctx's error, without generating anything.
func (e *Engine) Decode(ctx context.Context, req *engine.Request, transferID string, timeout time.Duration) (engine.Stream, error) {
	if !e.cfg.servesDecode() {
		return nil, fmt.Errorf("decode on a %s worker: %w", e.cfg.Role, ErrRole)
	}
	s, err := e.newSeq(ctx, req, false)
	if err != nil {
		return nil, err
	}
	if transferID != "" {
		s.transferred = true
		if timeout <= 0 {
			timeout = e.cfg.Disagg.TransferTimeout
		}
		if err := e.waitTransfer(ctx, transferID, timeout); err != nil {
			return nil, err
		}
	}
	return e.startAdapter(ctx, s)
}

// waitTransfer waits until transfer id ends, timeout passes (nil: proceed
// regardless), ctx ends or the engine closes.
func (e *Engine) waitTransfer(ctx context.Context, id string, timeout time.Duration) error {
	x := e.xfers.wait(id)
	defer e.xfers.unwait(id, x)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-x.done:
		return nil
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-e.quit:
		return ErrClosed
	}
}

// Has reports which blocks the engine holds (transfer.Receiver).
func (e *Engine) Has(keys []uint64) []bool { return e.cache.Holds(keys) }

// Accept inserts one verified block of a transfer into the cache, computed
// and unreferenced, as if this worker had prefilled it (transfer.Receiver).
// A block whose size is not BlockBytes, or whose contents are not its
// key's, is dropped and counted as rejected.
func (e *Engine) Accept(transferID string, key uint64, data []byte) {
	if !e.validBlock(key, data) {
		e.xfers.accept(transferID, false)
		return
	}
	// The namespace is unknown here: the first sequence to use the block
	// gives it its own (Cache.Acquire).
	e.cache.Insert(transfer.Namespace{}, key, false)
	e.xfers.accept(transferID, true)
}

func (e *Engine) validBlock(key uint64, data []byte) bool {
	if len(data) != e.blockBytes {
		return false
	}
	var head [8]byte
	kvblock.Fill(head[:], key)
	return bytes.Equal(data[:min(8, len(data))], head[:min(8, len(data))])
}

// Finish ends a transfer and wakes the Decode calls waiting for it
// (transfer.Receiver).
func (e *Engine) Finish(transferID string, accepted, rejected int, err error) {
	st := e.xfers.finish(transferID, accepted, rejected, err)
	e.statsMu.Lock()
	e.stats.TransfersReceived++
	if err != nil {
		e.stats.TransferFailures++
	}
	e.stats.ReceivedBlocks += uint64(st.Accepted)
	e.stats.RejectedBlocks += uint64(st.Rejected)
	e.statsMu.Unlock()
}

// TransferStatus is what a decode engine knows of one transfer.
type TransferStatus struct {
	// Finished: the push ended (Err says whether it broke off).
	Finished bool
	Err      error
	// Accepted blocks entered the cache; Rejected ones were dropped, by
	// the transport's verification or by the engine's own checks.
	Accepted, Rejected int
}

// Transfer returns the status of transfer id, if it is remembered.
func (e *Engine) Transfer(id string) (TransferStatus, bool) {
	return e.xfers.status(id)
}

var _ transfer.Receiver = (*Engine)(nil)

// xfer is one transfer as its receiver sees it.
type xfer struct {
	done    chan struct{} // closed by Finish
	status  TransferStatus
	local   int // blocks rejected by Accept's own checks
	waiters int // Decode calls waiting
	ended   time.Time
}

// xfers tracks recent transfers so Decode calls can wait for theirs,
// whether they arrive before the push ends or after.
type xfers struct {
	mu    sync.Mutex
	m     map[string]*xfer
	ended []endedXfer // finished transfers, in finishing order
}

type endedXfer struct {
	id string
	x  *xfer
}

func (t *xfers) get(id string) *xfer {
	if t.m == nil {
		t.m = make(map[string]*xfer)
	}
	x := t.m[id]
	if x == nil {
		x = &xfer{done: make(chan struct{})}
		t.m[id] = x
	}
	return x
}

// wait returns the transfer to wait for and counts the waiter.
func (t *xfers) wait(id string) *xfer {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.get(id)
	x.waiters++
	return x
}

// unwait drops a waiter; a transfer nobody pushes nor waits for is
// forgotten.
func (t *xfers) unwait(id string, x *xfer) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x.waiters--
	if x.waiters == 0 && !x.status.Finished && x.status.Accepted == 0 && x.local == 0 && t.m[id] == x {
		delete(t.m, id)
	}
}

func (t *xfers) accept(id string, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.get(id)
	if x.status.Finished {
		// A new push under the same id (a retried prefill): start afresh.
		x = &xfer{done: make(chan struct{})}
		t.m[id] = x
	}
	if ok {
		x.status.Accepted++
	} else {
		x.local++
	}
}

// finish ends transfer id and returns its final status.
func (t *xfers) finish(id string, accepted, rejected int, err error) TransferStatus {
	t.mu.Lock()
	defer t.mu.Unlock()
	x := t.get(id)
	if x.status.Finished {
		x = &xfer{done: make(chan struct{})} // an empty push after another
		t.m[id] = x
	}
	x.status = TransferStatus{
		Finished: true,
		Err:      err,
		Accepted: accepted - x.local,
		Rejected: rejected + x.local,
	}
	x.ended = time.Now()
	close(x.done)
	t.ended = append(t.ended, endedXfer{id, x})
	t.expire(x.ended)
	return x.status
}

// expire forgets finished transfers older than transferRetention, and the
// oldest ones while more than maxTransfers are kept.
func (t *xfers) expire(now time.Time) {
	n := 0
	for n < len(t.ended) && (now.Sub(t.ended[n].x.ended) > transferRetention || len(t.m) > maxTransfers) {
		if ex := t.ended[n]; t.m[ex.id] == ex.x {
			delete(t.m, ex.id)
		}
		n++
	}
	if n > 0 {
		clear(t.ended[:n])
		t.ended = t.ended[n:]
	}
}

func (t *xfers) status(id string) (TransferStatus, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	x, ok := t.m[id]
	if !ok {
		return TransferStatus{}, false
	}
	st := x.status
	if !st.Finished {
		st.Rejected = x.local
	}
	return st, true
}
