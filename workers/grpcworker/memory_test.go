package grpcworker

import (
	"context"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

// TestPrefillsInFlightHoldLittle: a burst of long Prefill calls in flight
// (each waits for its transfer, seconds in a real fleet) must not keep a
// buffered copy of every request for gRPC's retries: the scheduler's heap
// stays near the prompts' own size.
func TestPrefillsInFlightHoldLittle(t *testing.T) {
	if testing.Short() {
		t.Skip("a memory burst")
	}
	const calls, promptBytes = 200, 32 << 10
	release := make(chan struct{})
	var arrived sync.WaitGroup
	arrived.Add(calls)
	w := &fakeWorker{prefill: func(ctx context.Context, _ *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
		arrived.Done()
		select {
		case <-release:
		case <-ctx.Done():
		}
		return &workerpb.PrefillResult{}, nil
	}}
	srv := startServer(t, w)
	c := dial(t, srv.addr)
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	idle := ms.HeapInuse

	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			prompt := strings.Repeat(string(rune('a'+i%26)), promptBytes)
			req := &engine.PrefillRequest{Request: &engine.Request{Model: "m", Prompt: prompt, MaxTokens: 1}, TransferID: "t"}
			if _, err := c.Prefill(testContext(t), req); err != nil {
				t.Errorf("prefill: %v", err)
			}
		})
	}
	arrived.Wait() // every call is in flight, waiting on the worker
	// Twice: buffers given back to sync.Pools survive one collection.
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	held := ms.HeapInuse - idle
	close(release)
	wg.Wait()
	// The requests' own prompts and the fake worker's decoded copies come
	// to 2 × 6.25 MiB; a retry buffer per call kept a 1 MiB pooled buffer
	// each (200 MiB).
	const limit = 48 << 20
	t.Logf("heap with %d prefills of %d KiB in flight: %.1f MiB above idle", calls, promptBytes>>10, float64(held)/(1<<20))
	if held > limit {
		t.Errorf("heap with %d prefills in flight: %.1f MiB above idle, want at most %d MiB", calls, float64(held)/(1<<20), limit>>20)
	}
}
