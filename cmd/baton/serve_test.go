package main

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/sim"
)

// TestServeDrainsOnSignal: baton serve, whose context ends as on SIGTERM,
// drains and returns nil well within its drain timeout.
func TestServeDrainsOnSignal(t *testing.T) {
	w, err := sim.Start(sim.Config{TimeScale: 500}, "127.0.0.1:0", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--worker", w.GRPCAddr, "--drain-timeout", "20s"}, io.Discard, &logs)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logs.String(), "scheduler listening") {
		if time.Now().After(deadline) {
			t.Fatalf("serve did not start:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve ended with %v, want nil", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not end within its drain timeout")
	}
	t.Logf("drained in %v", time.Since(start))
	for _, m := range []string{"msg=draining", "msg=drained", "timeout=20s"} {
		if !strings.Contains(logs.String(), m) {
			t.Errorf("log lacks %q:\n%s", m, logs.String())
		}
	}
}
