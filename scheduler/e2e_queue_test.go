package scheduler_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
)

// startQueued starts one slow worker (its clock at scale) behind a
// prefix_aware scheduler that keeps at most one request in flight on it,
// so a second concurrent request finds every worker full.
func startQueued(t *testing.T, scale float64, fc frontend.Config) (*scheduler.Scheduler, string) {
	_, workers := startWorkers(t, 1, scale)
	fc.Models = nil
	cfg := scheduler.Config{Strategy: "prefix_aware", Config: fc, Workers: workers, Pool: fastPool()}
	cfg.MaxInFlight = 1
	return startScheduler(t, cfg)
}

func TestQueueWhenEveryWorkerIsFull(t *testing.T) {
	// The worker runs 4 times slower than modelled: its first request
	// (32 tokens at least) outlasts the queue's filling and the third
	// request even on a loaded machine.
	s, addr := startQueued(t, 0.25, frontend.Config{MaxQueue: 1, QueueTimeout: 20 * time.Second})
	c := oaClient(t, addr)
	hc := httpClient(t)
	depth := func() float64 { v, _ := metric(scrape(t, hc, addr), "baton_queue_depth"); return v }

	long := make(chan chatResult, 1)
	go func() { long <- chat(t, c, chatParams(text("busy", 400), 60)) }()
	eventually(t, 5*time.Second, func() error {
		if s.Pool.Snapshot().Workers[0].InFlight() == 0 {
			return fmt.Errorf("first request not in flight")
		}
		return nil
	})
	queued := make(chan chatResult, 1)
	go func() { queued <- chat(t, c, chatParams(text("waits", 400), 4)) }()
	eventually(t, 5*time.Second, func() error {
		if d := depth(); d != 1 {
			return fmt.Errorf("queue depth %v, want 1", d)
		}
		return nil
	})
	// The queue is full: the next request is turned away at once.
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"one too many"}]}`
	r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil)
	if _, _, code, _ := decodeError(t, r.body); r.status != http.StatusTooManyRequests || code != "overloaded" || r.header.Get("Retry-After") == "" {
		t.Errorf("third request: status %d code %q Retry-After %q, want 429 overloaded with Retry-After", r.status, code, r.header.Get("Retry-After"))
	}
	if first, second := <-long, <-queued; first.content == "" || second.content == "" {
		t.Errorf("queued request lost: %+v %+v", first, second)
	}
	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_queue_rejections_total", `reason="full"`); v != 1 {
		t.Errorf("rejections for a full queue = %v, want 1", v)
	}
	if v, _ := metric(m, "baton_requests_failed_total", `outcome="overloaded"`); v != 1 {
		t.Errorf("overloaded outcomes = %v, want 1", v)
	}
}

func TestQueueTimeout(t *testing.T) {
	s, addr := startQueued(t, 5, frontend.Config{MaxQueue: 4, QueueTimeout: 150 * time.Millisecond})
	c := oaClient(t, addr)
	hc := httpClient(t)
	long := make(chan chatResult, 1)
	go func() { long <- chat(t, c, chatParams(text("busy", 400), 200)) }()
	eventually(t, 5*time.Second, func() error {
		if s.Pool.Snapshot().Workers[0].InFlight() == 0 {
			return fmt.Errorf("first request not in flight")
		}
		return nil
	})
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"waits too long"}]}`
	start := time.Now()
	r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil)
	if r.status != http.StatusTooManyRequests {
		t.Errorf("status %d, want 429", r.status)
	}
	if d := time.Since(start); d < 150*time.Millisecond || d > 5*time.Second {
		t.Errorf("answered after %v, want after the 150ms queue timeout", d)
	}
	<-long
	if v, _ := metric(scrape(t, hc, addr), "baton_queue_rejections_total", `reason="timeout"`); v != 1 {
		t.Errorf("timeouts = %v, want 1", v)
	}
}
