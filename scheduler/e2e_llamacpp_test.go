package scheduler_test

import (
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

// The documents workload: docs documents of docChars characters, shorter
// than the default prefix_length (4,096), each asked questions in turn,
// one request at a time; two llama-servers of two slots each hold every
// document, but neither holds them all.
const (
	docs     = 4
	docChars = 3000
	slots    = 2
)

// docQuestion is question q about document d: the document as the system
// message, the question as the user's.
func docQuestion(d, q int) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model: model,
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage(text(fmt.Sprintf("document %d", d), docChars)),
			openai.UserMessage(fmt.Sprintf("Question %d about document %d: what does it say?", q, d)),
		},
		MaxTokens: openai.Int(4),
	}
}

// llamaServers starts n fake llama-servers of slots slots that report
// cached tokens only in their timings, as servers before 2025 do.
func llamaServers(t *testing.T, n int) []*llamatest.Server {
	var srvs []*llamatest.Server
	for range n {
		srvs = append(srvs, llamatest.Start(t, llamatest.Config{Slots: slots, Model: model, NoUsageDetails: true}))
	}
	return srvs
}

// llamaFleet starts a scheduler with strategy over srvs as llamacpp
// workers l0, l1…, and waits until it has read their slots.
func llamaFleet(t *testing.T, strategy string, srvs []*llamatest.Server) (*scheduler.Scheduler, string) {
	return llamaFleetWith(t, scheduler.Config{Strategy: strategy}, srvs)
}

// llamaFleetWith is llamaFleet with cfg's settings besides its workers
// and pool.
func llamaFleetWith(t *testing.T, cfg scheduler.Config, srvs []*llamatest.Server) (*scheduler.Scheduler, string) {
	t.Helper()
	cfg.Workers, cfg.Pool = llamaWorkers(srvs), fastPool()
	s, addr := startScheduler(t, cfg)
	waitSlots(t, s, cfg.Workers)
	return s, addr
}

// llamaWorkers are srvs as llamacpp workers l0, l1….
func llamaWorkers(srvs []*llamatest.Server) []scheduler.WorkerConfig {
	var workers []scheduler.WorkerConfig
	for i, srv := range srvs {
		workers = append(workers, scheduler.WorkerConfig{Name: fmt.Sprintf("l%d", i), Kind: scheduler.KindLlamaCPP, Address: srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond}})
	}
	return workers
}

// waitSlots waits until s's index has read the slots of each of workers.
func waitSlots(t *testing.T, s *scheduler.Scheduler, workers []scheduler.WorkerConfig) {
	t.Helper()
	names := make([]string, len(workers))
	for i, w := range workers {
		names[i] = w.Name
	}
	eventually(t, 10*time.Second, func() error {
		ms := make([]kvindex.Match, len(names))
		s.Index.Lookup(nil, names, ms)
		for i, m := range ms {
			if m.Load.Slots != slots {
				return fmt.Errorf("worker %s: index has %d slots, want %d", names[i], m.Load.Slots, slots)
			}
		}
		return nil
	})
}

// served is what the engine did with one question.
type served struct {
	worker         string
	prompt, cached int
}

// askAll asks question q of every document through the scheduler at c
// and returns what the engines did, by document.
func askAll(t *testing.T, c openai.Client, srvs []*llamatest.Server, q int) []served {
	t.Helper()
	out := make([]served, docs)
	for d := range docs {
		r := chat(t, c, docQuestion(d, q))
		var i int
		if _, err := fmt.Sscanf(r.worker, "l%d", &i); err != nil || i >= len(srvs) {
			t.Fatalf("X-Baton-Worker = %q", r.worker)
		}
		reqs := srvs[i].Requests()
		last := reqs[len(reqs)-1]
		out[d] = served{worker: r.worker, prompt: last.PromptTokens, cached: last.CachedTokens}
	}
	return out
}

// hit reports whether the engine found the question's document cached
// (all but the question, the last few percent of the prompt).
func (s served) hit() bool { return s.cached >= s.prompt*9/10 }

// TestLlamaCPPKVAwareDocuments: kv_aware with its defaults sends every
// question of a document to the llama-server that holds it, though the
// documents are shorter than prefix_length and the engines publish
// nothing, long after the requests that put them there; and when a
// server restarts with an empty cache, its documents' next questions
// miss once and hit again after.
func TestLlamaCPPKVAwareDocuments(t *testing.T) {
	srvs := llamaServers(t, 2)
	var later atomic.Int64 // the index's clock runs this far ahead
	_, addr := llamaFleetWith(t, scheduler.Config{Strategy: "kv_aware",
		IndexNow: func() time.Time { return time.Now().Add(time.Duration(later.Load())) }}, srvs)
	c := oaClient(t, addr)
	home := map[int]string{}
	perWorker := map[string]int{}
	for d, s := range askAll(t, c, srvs, 0) {
		home[d] = s.worker
		perWorker[s.worker]++
	}
	for w, n := range perWorker {
		if n > slots {
			t.Errorf("worker %s got the first question of %d documents; it holds %d", w, n, slots)
		}
	}
	// Past the TTL of the predictions of engines that publish events, on
	// the index's clock.
	later.Add(int64(kvindex.DefaultPredictTTL + 200*time.Millisecond))
	check := func(round string, got []served, wantHit func(d int) bool) {
		t.Helper()
		for d, s := range got {
			if s.worker != home[d] {
				t.Errorf("%s: document %d on %s, want %s, which holds it", round, d, s.worker, home[d])
			}
			if s.hit() != wantHit(d) {
				t.Errorf("%s: document %d on %s: %d of %d prompt tokens cached, want hit=%v", round, d, s.worker, s.cached, s.prompt, wantHit(d))
			}
		}
	}
	always := func(int) bool { return true }
	for q := 1; q <= 3; q++ {
		check(fmt.Sprintf("question %d", q), askAll(t, c, srvs, q), always)
	}

	srvs[0].Restart()
	check("first question after l0 restarted", askAll(t, c, srvs, 4), func(d int) bool { return home[d] != "l0" })
	check("second question after l0 restarted", askAll(t, c, srvs, 5), always)
}

// TestLlamaCPPHitRateByDocument: on documents shorter than prefix_length,
// kv_aware with its defaults finds within 5 points as many prompt tokens
// cached as sending each document to its own server by hand.
func TestLlamaCPPHitRateByDocument(t *testing.T) {
	const questions = 5
	rate := func(srvs []*llamatest.Server) float64 {
		var prompt, cached int
		for _, srv := range srvs {
			for _, r := range srv.Requests() {
				prompt += r.PromptTokens
				cached += r.CachedTokens
			}
		}
		return float64(cached) / float64(prompt)
	}

	// By document, straight to the servers.
	byDoc := llamaServers(t, 2)
	for q := range questions {
		for d := range docs {
			srv := byDoc[d%len(byDoc)]
			c := oaClient(t, srv.URL[len("http://"):])
			if _, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), docQuestion(d, q), option.WithJSONSet("cache_prompt", true)); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := rate(byDoc)

	got := map[string]float64{}
	for _, strategy := range []string{"kv_aware", "prefix_aware"} {
		srvs := llamaServers(t, 2)
		_, addr := llamaFleet(t, strategy, srvs)
		c := oaClient(t, addr)
		for q := range questions {
			askAll(t, c, srvs, q)
		}
		got[strategy] = rate(srvs)
	}
	t.Logf("hit rate: by document %.3f, kv_aware %.3f, prefix_aware %.3f", want, got["kv_aware"], got["prefix_aware"])
	if math.Abs(got["kv_aware"]-want) > 0.05 {
		t.Errorf("kv_aware hit rate %.3f, by document %.3f: more than 5 points apart", got["kv_aware"], want)
	}
}
