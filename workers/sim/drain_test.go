package sim

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/engine"
)

// TestWorkerDrain: a draining worker reports NOT_SERVING, refuses new
// sequences with Unavailable, finishes the one it runs, then writes its
// blocks to the shared tier (under the demotion policy, which had not).
func TestWorkerDrain(t *testing.T) {
	store := kvstore.NewMemory(kvstore.MemoryConfig{})
	t.Cleanup(func() { store.Close() })
	// Slow enough that 40 tokens take seconds.
	w, c := startWorker(t, Config{TimeScale: 0.05, Tiers: Tiers{Store: store}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req := &engine.Request{Model: testModel, Prompt: longPrompt("drain", 8), MaxTokens: 40}
	st, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	first, err := st.Recv()
	if err != nil {
		t.Fatalf("first Recv: %v", err)
	}

	drained := make(chan DrainResult, 1)
	go func() { drained <- w.Drain(ctx) }()
	waitFor(t, "the worker to stop serving", func() bool { return c.Check(ctx) != nil })
	if err := c.Check(ctx); !errors.Is(err, engine.ErrUnavailable) || !strings.Contains(err.Error(), "NOT_SERVING") {
		t.Errorf("health of a draining worker: %v, want NOT_SERVING", err)
	}
	st2, err := c.Generate(ctx, &engine.Request{Model: testModel, Prompt: longPrompt("after", 2), MaxTokens: 4})
	if err == nil {
		_, err = st2.Recv()
		st2.Close()
	}
	if !errors.Is(err, engine.ErrUnavailable) || status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "draining") {
		t.Errorf("Generate on a draining worker: %v, want Unavailable, draining", err)
	}

	r, err := collect(t, st)
	if err != nil {
		t.Fatalf("the running sequence during the drain: %v", err)
	}
	if r.final == nil || r.final.CompletionTokens < 2 || first.Text == "" {
		t.Errorf("the running sequence ended with %+v, want its completion", r.final)
	}
	var res DrainResult
	select {
	case res = <-drained:
	case <-ctx.Done():
		t.Fatal("Drain did not return")
	}
	if res.Left != 0 {
		t.Errorf("Drain left %d calls running, want 0", res.Left)
	}
	keys := requestKeys(req)
	if res.HotBlocks < len(keys) {
		t.Errorf("Drain wrote %d blocks to the shared tier, want at least the prompt's %d", res.HotBlocks, len(keys))
	}
	ns := transfer.Namespace{Model: testModel, Salt: blockkey.Seed(testModel, "")}
	held, err := store.Exists(ctx, ns, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range held {
		if !ok {
			t.Errorf("the shared tier lacks prompt block %d after the drain", i)
		}
	}
}

// TestWorkerDrainTimesOut: a sequence longer than the drain's context is
// reported left running.
func TestWorkerDrainTimesOut(t *testing.T) {
	w, c := startWorker(t, Config{TimeScale: 0.05})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := c.Generate(ctx, &engine.Request{Model: testModel, Prompt: longPrompt("long", 4), MaxTokens: 200})
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer st.Close()
	if _, err := st.Recv(); err != nil {
		t.Fatalf("first Recv: %v", err)
	}
	dctx, dcancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer dcancel()
	if res := w.Drain(dctx); res.Left != 1 || res.HotBlocks != 0 {
		t.Errorf("Drain = %+v, want 1 call left and no block written (no shared tier)", res)
	}
}
