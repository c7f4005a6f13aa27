package scheduler_test

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/kvindex"
)

// TestKVAwareCommitsTheServingWorker: kv_aware's record of where requests
// went (predicted blocks, Routed) follows the worker that served each
// request, after the front end replaced the strategy's choice for a full
// worker, and a request that waited in the queue, picking again on each
// wake-up, counts once.
func TestKVAwareCommitsTheServingWorker(t *testing.T) {
	// Slow workers, one request each at most: a long stream holds its
	// worker for seconds.
	_, s, addr := startTiered(t, 2, 0.05, nil, nil, func(c *scheduler.Config) {
		c.Config = frontend.Config{MaxInFlight: 1, QueueTimeout: time.Minute}
	})
	doc := text("a shared document", 3000)
	hc := httpClient(t)
	served := map[string]int{}

	// ask sends a chat on doc plus q and returns its worker; a stream is
	// left running (stop ends it) once its first chunk arrived.
	ask := func(q string, stream bool) (worker string, stop func()) {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		max := 1
		if stream {
			max = 4000
		}
		body := fmt.Sprintf(`{"model":%q,"stream":%t,"max_tokens":%d,"messages":[{"role":"user","content":%q}]}`, model, stream, max, doc+q)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: status %d", q, resp.StatusCode)
		}
		worker = resp.Header.Get("X-Baton-Worker")
		t.Logf("%s: %s (%s)", q, worker, resp.Header.Get("X-Baton-Route"))
		served[worker]++
		if !stream {
			resp.Body.Close()
			return worker, cancel
		}

		br := bufio.NewReader(resp.Body)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("%s: stream ended before its first chunk: %v", q, err)
			}
			if strings.Contains(line, `"content"`) {
				break
			}
		}
		return worker, func() { cancel(); resp.Body.Close() }
	}

	// The index records only what it routes to workers it knows: wait
	// until both workers' watch streams have reported.
	out := make([]kvindex.Match, 2)
	names := []string{"w0", "w1"}
	eventually(t, 5*time.Second, func() error {
		s.Index.Lookup(userKeys(doc), names, out)
		for i, m := range out {
			if !m.Known {
				return fmt.Errorf("index does not know %s yet", names[i])
			}
		}
		return nil
	})

	home, _ := ask(" Warm up.", false)
	indexed(t, s, home, doc)
	w1, stop1 := ask(" Tell a long story.", true) // holds its worker
	w2, _ := ask(" A short question.", false)     // its cached worker may be full
	w3, stop3 := ask(" Another long story.", true)
	if w1 == w2 && w2 == w3 {
		t.Fatalf("every request went to %s with max_in_flight 1", w1)
	}
	// Both workers are full: the next request waits in the queue until a
	// stream ends.
	picks := func() float64 {
		v, _ := metric(scrape(t, hc, addr), "baton_routing_decision_seconds_count")
		return v
	}
	before := picks()
	done := make(chan string, 1)
	go func() { w, _ := ask(" Queued question.", false); done <- w }()
	// Its first pick finds both full; so does the queue's, after which
	// it waits for a worker to free up.
	eventually(t, 5*time.Second, func() error {
		if v, _ := metric(scrape(t, hc, addr), "baton_queue_depth"); v != 1 {
			return fmt.Errorf("queue depth %v, want 1", v)
		}
		if n := picks() - before; n < 2 {
			return fmt.Errorf("%v picks of the queued request, want 2", n)
		}
		return nil
	})
	stop1()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the queued request was not served after a worker freed up")
	}
	stop3()

	s.Index.Lookup(userKeys(doc), names, out)
	for i, m := range out {
		// Routed decays by half a minute; the test lasts seconds.
		if want := float64(served[names[i]]); math.Abs(m.Routed-want) > 0.1*want+0.05 {
			t.Errorf("%s: routed %.2f, want %.0f, the requests it served (served %v)", names[i], m.Routed, want, served)
		}
	}
}
