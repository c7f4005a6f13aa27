package scheduler_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/workers/sim"
)

// httpFleet starts two simulated workers with their own OpenAI endpoints
// and a scheduler reaching them as http engines.
func httpFleet(t *testing.T, strategy string) (*scheduler.Scheduler, string, []*sim.Worker) {
	var workers []scheduler.WorkerConfig
	var sims []*sim.Worker
	for _, name := range []string{"h0", "h1"} {
		w := startWorker(t, name, fastScale, "127.0.0.1:0", true)
		sims = append(sims, w)
		workers = append(workers, scheduler.WorkerConfig{Name: name, Kind: "http", Address: "http://" + w.HTTPAddr, Models: []string{model}})
	}
	s, addr := startScheduler(t, scheduler.Config{Strategy: strategy, Workers: workers, Pool: fastPool()})
	return s, addr, sims
}

// TestHTTPBackend: OpenAI-compatible HTTP engines behind the scheduler
// answer streaming and non-streaming requests, keep prefix affinity and
// their cache, and share round_robin traffic.
func TestHTTPBackend(t *testing.T) {
	t.Run("prefix_aware", func(t *testing.T) {
		_, addr, _ := httpFleet(t, "prefix_aware")
		c := oaClient(t, addr)
		p := chatParams(text("http backend", 2500), 8)
		first := chat(t, c, p)
		if first.content == "" || first.finish == "" || first.prompt == 0 {
			t.Errorf("chat = %+v, want content, finish_reason and usage", first)
		}
		if first.worker != "h0" && first.worker != "h1" {
			t.Errorf("X-Baton-Worker = %q, want h0 or h1", first.worker)
		}
		if first.cached != 0 {
			t.Errorf("first request: cached_tokens = %d, want 0", first.cached)
		}
		second, err := streamChat(t, c, p)
		if err != nil {
			t.Fatal(err)
		}
		if second.content == "" || second.finish == "" {
			t.Errorf("streamed chat = %+v, want content and finish_reason", second)
		}
		if second.worker != first.worker {
			t.Errorf("X-Baton-Worker: repeated prompt on %q, first on %q; want the same", second.worker, first.worker)
		}
		if second.cached == 0 {
			t.Errorf("repeated prompt: cached_tokens = 0 (prompt %d), want > 0", second.prompt)
		}
		m := scrapeSettled(t, httpClient(t), addr)
		if v, _ := metric(m, "baton_cached_tokens_total", `worker="`+first.worker+`"`); v == 0 {
			t.Errorf("baton_cached_tokens_total{worker=%q} = 0, want the cached tokens of the repeated prompt", first.worker)
		}
	})

	t.Run("round_robin", func(t *testing.T) {
		_, addr, _ := httpFleet(t, "round_robin")
		c := oaClient(t, addr)
		used := map[string]int{}
		for i := range 6 {
			p := chatParams(fmt.Sprintf("round robin %d", i), 4)
			var got chatResult
			if i%2 == 0 {
				got = chat(t, c, p)
			} else {
				var err error
				if got, err = streamChat(t, c, p); err != nil {
					t.Fatal(err)
				}
			}
			used[got.worker]++
		}
		if used["h0"] != 3 || used["h1"] != 3 {
			t.Errorf("6 round_robin requests went to %v, want 3 each on h0 and h1", used)
		}
	})
}

// TestHTTPBackendFailover: an http engine that stops costs no request: the
// call fails before its first byte and is retried on the other engine.
func TestHTTPBackendFailover(t *testing.T) {
	s, addr, sims := httpFleet(t, "round_robin")
	c := oaClient(t, addr)
	used := map[string]int{}
	for i := range 20 {
		if i == 4 {
			sims[0].Close()
		}
		p := chatParams(fmt.Sprintf("http failover %d", i), 4)
		if i%2 == 0 {
			used[chat(t, c, p).worker]++
			continue
		}
		got, err := streamChat(t, c, p)
		if err != nil {
			t.Fatalf("request %d after h0 stopped: %v", i, err)
		}
		used[got.worker]++
	}
	if used["h0"] != 2 || used["h1"] != 18 {
		t.Errorf("requests per worker = %v, want h0 2 (before it stopped) and h1 18", used)
	}
	eventually(t, 5*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker("h0"); w.Available() {
			return fmt.Errorf("stopped engine h0 still available (healthy %v, breaker %v)", w.Healthy(), w.BreakerState())
		}
		return nil
	})
}
