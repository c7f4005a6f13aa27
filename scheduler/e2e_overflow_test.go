package scheduler_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// TestPrefixAwareOverflow: once a prefix's home worker has
// concurrency_threshold requests in flight, further requests for that
// prefix spill to other workers, say so in X-Baton-Route and count in
// baton_overflow_spills_total; none fails.
func TestPrefixAwareOverflow(t *testing.T) {
	// Slow workers (a quarter of real time): a completion of 32+ tokens
	// takes 400+ ms, so the requests of the second wave meet those of the
	// first still in flight.
	_, workers := startWorkers(t, 3, 0.25)
	const threshold = 2
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "prefix_aware",
		Params:   routing.Params{ConcurrencyThreshold: threshold},
		Workers:  workers,
		Pool:     fastPool(),
	})
	c := oaClient(t, addr)
	hc := httpClient(t)
	prompt := text("overflow", 3000)

	// The first wave fills the home to the threshold; the second, sent
	// once the scheduler counts it full, spills. Six requests in all, so
	// the three workers are never all at the threshold.
	const first, n = threshold, 6
	results := make([]chatResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	send := func(from, to int) {
		for i := from; i < to; i++ {
			wg.Go(func() { results[i], errs[i] = streamChat(t, c, chatParams(prompt, 64)) })
		}
	}
	send(0, first)
	eventually(t, 10*time.Second, func() error {
		m := scrape(t, hc, addr)
		for _, w := range workers {
			if v, _ := metric(m, "baton_worker_in_flight", `worker="`+w.Name+`"`); v >= threshold {
				return nil
			}
		}
		return fmt.Errorf("no worker has %d requests in flight:\n%s", threshold, grep(m, "baton_worker_in_flight"))
	})
	send(first, n)
	wg.Wait()

	used := map[string]int{}
	spilled := 0
	home := "" // the prefix's home serves every request that did not spill
	for i, r := range results {
		if errs[i] != nil {
			t.Errorf("request %d: %v", i, errs[i])
			continue
		}
		if r.content == "" {
			t.Errorf("request %d: empty completion", i)
		}
		used[r.worker]++
		switch r.route {
		case "prefix_aware; spill=true":
			spilled++
		case "prefix_aware; spill=false":
			if home != "" && home != r.worker {
				t.Errorf("requests that did not spill went to %s and %s, want one home worker", home, r.worker)
			}
			home = r.worker
		default:
			t.Errorf("request %d: X-Baton-Route = %q", i, r.route)
		}
	}
	if spilled == 0 || len(used) < 2 {
		t.Errorf("%d same-prefix requests: %d spilled, workers %v; want some spilled to more than one worker", n, spilled, used)
	}
	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_overflow_spills_total", `strategy="prefix_aware"`); v != float64(spilled) {
		t.Errorf("baton_overflow_spills_total = %v, want %d (the responses marked spill=true)", v, spilled)
	}
	// The metric's worker label is documented as the worker spilled from:
	// the prefix's home.
	if v, _ := metric(m, "baton_overflow_spills_total", `worker="`+home+`"`); home != "" && v != float64(spilled) {
		t.Errorf("baton_overflow_spills_total{worker=%q} (the home, spilled from) = %v, want %d; by worker:\n%s",
			home, v, spilled, grep(m, "baton_overflow_spills_total"))
	}
	if v, _ := metric(m, "baton_requests_completed_total"); v != n {
		t.Errorf("baton_requests_completed_total = %v, want %d", v, n)
	}
	if !strings.Contains(m, "baton_worker_in_flight") {
		t.Error("/metrics lacks baton_worker_in_flight")
	}
}

// grep returns the lines of text that start with prefix.
func grep(text, prefix string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
