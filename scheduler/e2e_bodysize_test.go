package scheduler_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/workers/sim"
)

// chatBody returns a one-message chat body of exactly n bytes.
func chatBody(t testing.TB, n int) string {
	t.Helper()
	head := `{"model":"` + model + `","max_tokens":1,"messages":[{"role":"user","content":"`
	tail := `"}]}`
	if n < len(head)+len(tail) {
		t.Fatalf("chatBody(%d): too small", n)
	}
	return head + strings.Repeat("x", n-len(head)-len(tail)) + tail
}

// TestBodySizeLimits: bodies at each size limit get the right answer, and
// a request too large for a worker is a 413 that no breaker hears and no
// other worker is asked.
func TestBodySizeLimits(t *testing.T) {
	// The workers accept at most 1 MiB per request; the scheduler 2 MiB.
	const workerLimit, bodyLimit = 1 << 20, 2 << 20
	cfg := scheduler.Config{Strategy: "prefix_aware", Pool: fastPool(), Config: frontend.Config{MaxBodyBytes: bodyLimit}}
	cfg.Pool.BreakerFailures = 1
	for i := range 2 {
		name := fmt.Sprintf("w%d", i)
		w, err := sim.Start(sim.Config{Name: name, TimeScale: fastScale}, "127.0.0.1:0", "", nil, sim.WithMaxRequestBytes(workerLimit))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		cfg.Workers = append(cfg.Workers, scheduler.WorkerConfig{Name: name, Address: w.GRPCAddr})
	}
	_, addr := startScheduler(t, cfg)
	hc := httpClient(t)
	url := "http://" + addr + "/v1/chat/completions"

	for _, tt := range []struct {
		name   string
		size   int
		status int
	}{
		{"small", 200, http.StatusOK},
		{"just under the worker limit", workerLimit - 64<<10, http.StatusOK},
		{"over the worker limit", workerLimit + 64<<10, http.StatusRequestEntityTooLarge},
		{"at the body limit", bodyLimit, http.StatusRequestEntityTooLarge},
		{"one byte over the body limit", bodyLimit + 1, http.StatusRequestEntityTooLarge},
	} {
		t.Run(tt.name, func(t *testing.T) {
			for range 3 { // more than BreakerFailures, on every worker
				r := do(t, hc, http.MethodPost, url, chatBody(t, tt.size), nil)
				if r.status != tt.status {
					t.Fatalf("%d-byte body: status %d, want %d: %s", tt.size, r.status, tt.status, r.body)
				}
				if r.status != http.StatusOK {
					if _, _, code, _ := decodeError(t, r.body); code != "request_too_large" {
						t.Errorf("%d-byte body: code %q, want request_too_large", tt.size, code)
					}
				}
			}
		})
	}
	m := scrape(t, hc, addr)
	if v, _ := metric(m, "baton_breaker_transitions_total"); v != 0 {
		t.Errorf("baton_breaker_transitions_total = %v after too-large requests, want 0", v)
	}
	if v, _ := metric(m, "baton_retries_total"); v != 0 {
		t.Errorf("baton_retries_total = %v: a request too large for one worker was tried on another", v)
	}
	if r := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil); r.status != http.StatusOK {
		t.Errorf("/readyz after too-large requests: %d, want 200", r.status)
	}
}

// TestDefaultLimitsLargeBody: with the defaults, a body just under
// max_body_bytes (6 MiB) reaches a worker, which answers it on its merits
// (here: the prompt needs more KV blocks than the worker has, a 400), and
// no breaker hears of it however often it comes.
func TestDefaultLimitsLargeBody(t *testing.T) {
	_, workers := startWorkers(t, 2, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "prefix_aware", Workers: workers, Pool: fastPool()})
	hc := httpClient(t)
	for range 5 {
		r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", chatBody(t, 5_200_000), nil)
		if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "capacity") {
			t.Fatalf("5.2 MB body: status %d, want 400 for the worker's KV capacity: %.300s", r.status, r.body)
		}
	}
	if v, _ := metric(scrape(t, hc, addr), "baton_breaker_transitions_total"); v != 0 {
		t.Errorf("baton_breaker_transitions_total = %v after large requests, want 0", v)
	}
	if r := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil); r.status != http.StatusOK {
		t.Errorf("/readyz after large requests: %d, want 200", r.status)
	}
}
