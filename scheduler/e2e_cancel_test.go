package scheduler_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
)

// TestClientDisconnectCancelsWorker: a client that goes away mid-stream
// cancels the generation on the worker and frees its in-flight slot.
func TestClientDisconnectCancelsWorker(t *testing.T) {
	for _, kind := range []string{"grpc", "http"} {
		t.Run(kind, func(t *testing.T) {
			// A very slow worker: each decode step takes over 100 ms, so
			// even the shortest natural completion (32 tokens) runs for
			// seconds, far longer than the cancellation may take.
			w := startWorker(t, "slow", 0.05, "127.0.0.1:0", kind == "http")
			wc := scheduler.WorkerConfig{Name: "slow", Address: w.GRPCAddr}
			if kind == "http" {
				wc = scheduler.WorkerConfig{Name: "slow", Kind: "http", Address: "http://" + w.HTTPAddr, Models: []string{model}}
			}
			// One worker fault would open the breaker: a client that goes
			// away must not count as one.
			pc := fastPool()
			pc.BreakerFailures = 1
			s, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Workers: []scheduler.WorkerConfig{wc}, Pool: pc})
			c := oaClient(t, addr)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			stream := c.Chat.Completions.NewStreaming(ctx, chatParams("Tell me a very long story.", 4000))
			defer stream.Close()
			gotChunk := false
			for !gotChunk && stream.Next() {
				for _, ch := range stream.Current().Choices {
					gotChunk = gotChunk || ch.Delta.Content != ""
				}
			}
			if !gotChunk {
				t.Fatalf("no content chunk before the stream ended (err %v)", stream.Err())
			}
			if l := w.Engine.Load(); l.Running+l.Waiting != 1 {
				t.Fatalf("worker load while streaming = %+v, want one sequence", l)
			}
			if n := s.Pool.Snapshot().Worker("slow").InFlight(); n != 1 {
				t.Fatalf("in flight while streaming = %d, want 1", n)
			}
			cancel()
			stream.Close()

			start := time.Now()
			eventually(t, 2*time.Second, func() error {
				if l := w.Engine.Load(); l.Running != 0 || l.Waiting != 0 {
					return fmt.Errorf("worker still runs the abandoned request: load %+v", l)
				}
				if n := s.Pool.Snapshot().Worker("slow").InFlight(); n != 0 {
					return fmt.Errorf("scheduler still counts %d in flight on the worker", n)
				}
				return nil
			})
			t.Logf("cancellation reached the worker in %v", time.Since(start))

			// The client went away: that is no fault of the worker.
			hc := httpClient(t)
			eventually(t, 2*time.Second, func() error {
				m := scrape(t, hc, addr)
				if v, _ := metric(m, "baton_requests_failed_total", `outcome="canceled"`); v != 1 {
					return fmt.Errorf(`baton_requests_failed_total{outcome="canceled"} = %v, want 1`, v)
				}
				return nil
			})
			if st := s.Pool.Snapshot().Worker("slow").BreakerState().String(); st != "closed" {
				t.Errorf("breaker after a client disconnect = %s, want closed", st)
			}
			if v, _ := metric(scrape(t, hc, addr), "baton_breaker_transitions_total"); v != 0 {
				t.Errorf("baton_breaker_transitions_total = %v after a client disconnect, want 0", v)
			}
		})
	}
}
