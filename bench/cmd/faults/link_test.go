package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/sim"
)

const testScale = 500 // the simulated clock, fast

func startSim(t *testing.T, role string) *sim.Worker {
	t.Helper()
	w, err := sim.Start(sim.Config{Role: role, TimeScale: testScale}, "127.0.0.1:0", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

func startLink(t *testing.T, target string) *linkProxy {
	t.Helper()
	l, err := newLinkProxy(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	return l
}

func dial(t *testing.T, addr string) *grpcworker.Client {
	t.Helper()
	c, err := grpcworker.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// collect returns a function that reads a stream to its end: its text
// and final usage.
func collect(t *testing.T) func(engine.Stream, error) (string, *engine.Final) {
	return func(st engine.Stream, err error) (string, *engine.Final) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var b strings.Builder
		for {
			ev, err := st.Recv()
			if err == io.EOF {
				t.Fatal("stream ended without a final event")
			}
			if err != nil {
				t.Fatal(err)
			}
			b.WriteString(ev.Text)
			if ev.Final != nil {
				return b.String(), ev.Final
			}
		}
	}
}

func prompt(seed string) string {
	var b strings.Builder
	for i := 0; b.Len() < 2400; i++ {
		fmt.Fprintf(&b, "%s word %d. ", seed, i)
	}
	return b.String()
}

// TestLinkCorruptsPushedBlocks: a prefill worker pushes a prompt's blocks
// through the link, which flips a byte in every second one; the decode
// worker rejects exactly those, recomputes them, and answers the text an
// uncorrupted run gives. The connection is never broken.
func TestLinkCorruptsPushedBlocks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, d, both := startSim(t, sim.RolePrefill), startSim(t, sim.RoleDecode), startSim(t, sim.RoleBoth)
	link := startLink(t, d.GRPCAddr)
	pc, dc, bc := dial(t, p.GRPCAddr), dial(t, link.addr()), dial(t, both.GRPCAddr)
	link.corrupt(2)

	req := &engine.Request{Model: model, Prompt: prompt("corrupt"), MaxTokens: 24}
	res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "x1", DecodeAddr: link.addr()})
	if err != nil {
		t.Fatalf("Prefill: %v", err)
	}
	if res.Skipped || res.BlocksSent < 10 {
		t.Fatalf("Prefill = %+v, want a push of the whole prompt", res)
	}
	if want := res.BlocksSent / 2; res.BlocksRejected != want || link.flipped.Load() != int64(want) || link.pushed.Load() != int64(res.BlocksSent) {
		t.Errorf("%d blocks sent, %d rejected; link saw %d, flipped %d: want every second one flipped and rejected",
			res.BlocksSent, res.BlocksRejected, link.pushed.Load(), link.flipped.Load())
	}
	st, ok := d.Engine.Transfer("x1")
	if !ok || st.Err != nil || st.Rejected != res.BlocksRejected || st.Accepted != res.BlocksSent-res.BlocksRejected {
		t.Errorf("decode worker's transfer: %+v (known %v)", st, ok)
	}
	got, gotFinal := collect(t)(dc.Decode(ctx, req, "x1", 5*time.Second))
	want, _ := collect(t)(bc.Generate(ctx, req))
	if got != want {
		t.Errorf("decode text %q, uncorrupted %q", got, want)
	}
	// Block 1 was rejected: only block 0 was usable, so the decode worker
	// recomputed the rest.
	if gotFinal.CachedTokens != sim.BlockTokens {
		t.Errorf("decode found %d tokens cached, want %d: block 1 arrived corrupt", gotFinal.CachedTokens, sim.BlockTokens)
	}
	if e := link.lastErr.Load(); e != nil {
		t.Errorf("link error: %v", e)
	}
}

// TestLinkDropsWatchEvents: with dropWatch, a Watch stream through the
// link loses its next cache event, so the subscriber sees its sequence
// numbers skip one; the stream goes on, and calls on the same connection
// keep working.
func TestLinkDropsWatchEvents(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := startSim(t, sim.RoleBoth)
	link := startLink(t, w.GRPCAddr)
	c := dial(t, link.addr())
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	st, err := c.Watch(wctx)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := st.Recv()
	if err != nil || ev.GetSnapshot() == nil || ev.GetSeq() != 1 {
		t.Fatalf("first event %v, %v: want the snapshot", ev, err)
	}
	generate := func(i int) {
		collect(t)(c.Generate(ctx, &engine.Request{Model: model, Prompt: prompt(fmt.Sprintf("watch %d", i)), MaxTokens: 8}))
	}
	// recv reads events until one is a cache event, and returns the
	// sequence numbers read.
	recv := func() []uint64 {
		var seqs []uint64
		for {
			ev, err := st.Recv()
			if err != nil {
				t.Fatalf("Recv: %v", err)
			}
			seqs = append(seqs, ev.GetSeq())
			if ev.GetCache() != nil {
				return seqs
			}
		}
	}
	generate(0)
	seqs := recv()
	last := seqs[len(seqs)-1]
	link.dropWatch()
	// The first request's cache event is lost, the second's arrives.
	generate(1)
	generate(2)
	skipped := 0
	for _, s := range recv() {
		switch s {
		case last + 1:
		case last + 2:
			skipped++
		default:
			t.Fatalf("seq %d after %d", s, last)
		}
		last = s
	}
	if skipped != 1 || link.dropped.Load() != 1 {
		t.Fatalf("%d sequence numbers skipped, %d events dropped: want 1", skipped, link.dropped.Load())
	}
	// Once only: the stream goes on without more gaps.
	for i := 4; i < 40; i++ {
		generate(i)
		for _, s := range recv() {
			if s != last+1 {
				t.Fatalf("seq %d after %d", s, last)
			}
			last = s
		}
	}
	if link.watches.Load() != 1 {
		t.Errorf("watch streams seen %d, want 1", link.watches.Load())
	}
	if e := link.lastErr.Load(); e != nil {
		t.Errorf("link error: %v", e)
	}
}

// TestLinkPassesLargeSnapshots: a Watch stream's snapshot larger than the
// stream's flow control window (64 KiB at first) crosses the link; a link
// that held a message until it was whole would stall it, the subscriber
// never seeing the bytes it must acknowledge.
func TestLinkPassesLargeSnapshots(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := startSim(t, sim.RoleBoth)
	direct := dial(t, w.GRPCAddr)
	for i := range 16 {
		long := strings.Repeat(prompt(fmt.Sprintf("big %d", i)), 16) // 600 blocks
		collect(t)(direct.Generate(ctx, &engine.Request{Model: model, Prompt: long, MaxTokens: 1}))
	}
	link := startLink(t, w.GRPCAddr)
	link.dropWatch() // armed: the snapshot must pass all the same
	c := dial(t, link.addr())
	wctx, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	st, err := c.Watch(wctx)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := st.Recv()
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	n := 0
	for _, b := range ev.GetSnapshot().GetBlocks() {
		n += len(b.GetKeys())
	}
	if n < 9000 {
		t.Fatalf("snapshot of %d blocks, want the ~9,600 the worker holds", n)
	}
}

// TestLinkHoldsAPushForAKill: holdPush holds a push once some of its
// blocks have passed, so that a decode worker killed then dies with the push in
// flight: the prefill worker's Prefill, still waiting, then fails as a
// failed transfer (engine.ErrTransfer), which no breaker counts against
// the prefill worker, as soon as the decode worker is gone, not at the
// transfer deadline. A hold nobody releases ends at its bound, and the
// push goes through whole.
func TestLinkHoldsAPushForAKill(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := startSim(t, sim.RolePrefill)
	pc := dial(t, p.GRPCAddr)
	const deadline = 10 * time.Second // the transfer's
	prefill := func(id string, link *linkProxy) <-chan error {
		done := make(chan error, 1)
		go func() {
			req := &engine.Request{Model: model, Prompt: prompt(id), MaxTokens: 8}
			res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: id, DecodeAddr: link.addr(), TransferTimeout: deadline})
			if err == nil && (res.Skipped || res.BlocksSent < 10) {
				err = fmt.Errorf("prefill %+v: want a push of the whole prompt", res)
			}
			done <- err
		}()
		return done
	}

	t.Run("killed while held", func(t *testing.T) {
		d := startSim(t, sim.RoleDecode)
		link := startLink(t, d.GRPCAddr)
		hold := link.holdPush(64<<10, time.Minute)
		done := prefill("held", link)
		select {
		case <-hold.held:
		case err := <-done:
			t.Fatalf("Prefill ended (%v) with no push held", err)
		case <-ctx.Done():
			t.Fatal("no push held")
		}
		select {
		case err := <-done:
			t.Fatalf("Prefill ended (%v) while its push was held", err)
		default:
		}
		if hold.pending != 1 || hold.before < 64<<10 {
			t.Errorf("%d pushes open at the hold, %d bytes passed: want 1, and at least 64 KiB", hold.pending, hold.before)
		}
		if st, ok := d.Engine.Transfer("held"); ok && (st.Finished || st.Accepted+st.Rejected >= 10) {
			t.Errorf("decode worker's transfer at the hold: %+v: want it unfinished", st)
		}
		d.Close() // in-flight streams fail, as when a worker dies
		killed := time.Now()
		hold.release()
		err := <-done
		if !errors.Is(err, engine.ErrTransfer) || pool.IsWorkerFault(err) {
			t.Errorf("Prefill: %v (worker fault %v): want a failed transfer, not the prefill worker's fault", err, pool.IsWorkerFault(err))
		}
		if waited := time.Since(killed); waited >= deadline {
			t.Errorf("Prefill failed %s after the kill: at the transfer deadline, not when the decode worker died", waited)
		}
	})

	t.Run("released at its bound", func(t *testing.T) {
		d := startSim(t, sim.RoleDecode)
		link := startLink(t, d.GRPCAddr)
		const bound = 200 * time.Millisecond
		hold := link.holdPush(0, bound)
		if err := <-prefill("bound", link); err != nil {
			t.Fatalf("Prefill: %v", err)
		}
		select {
		case <-hold.held:
		default:
			t.Fatal("no push held")
		}
		if waited := time.Since(hold.at); waited < bound {
			t.Errorf("Prefill returned %s after its push was held, before the hold's bound, %s", waited, bound)
		}
		if st, ok := d.Engine.Transfer("bound"); !ok || st.Err != nil || st.Rejected != 0 || st.Accepted < 10 {
			t.Errorf("decode worker's transfer: %+v (known %v): want every block accepted", st, ok)
		}
		if link.hold.Load() != nil {
			t.Error("the hold is still armed after it held a push")
		}
	})
}
