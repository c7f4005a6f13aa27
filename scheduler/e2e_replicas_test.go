package scheduler_test

import (
	"math/rand/v2"
	"testing"

	"github.com/openai/openai-go/v3"
)

// TestReplicasKVAwareDocumentsOneEngine: four kv_aware replicas, configured
// alike, in front of two llama-servers that publish no cache events, each
// replica knowing only what it routed itself. Sequential questions about a
// few shared documents, shuffled, go to the replicas in turn (request n to
// replica n mod 4), as a round-robin load balancer sends them: every
// replica must send a document's questions to the same engine, so that
// each document is computed once and hit after.
func TestReplicasKVAwareDocumentsOneEngine(t *testing.T) {
	const (
		replicas  = 4
		questions = 4
	)
	srvs := llamaServers(t, 2)
	clients := make([]openai.Client, replicas)
	for r := range replicas {
		_, addr := llamaFleet(t, "kv_aware", srvs)
		clients[r] = oaClient(t, addr)
	}
	type ask struct{ d, q int }
	var asks []ask
	for d := range docs {
		for q := range questions {
			asks = append(asks, ask{d, q})
		}
	}
	rand.New(rand.NewPCG(25, 1)).Shuffle(len(asks), func(i, j int) { asks[i], asks[j] = asks[j], asks[i] })

	engines := make([]map[string][]int, docs) // per document, engine → requests
	for d := range engines {
		engines[d] = map[string][]int{}
	}
	for n, a := range asks {
		r, err := streamChat(t, clients[n%replicas], docQuestion(a.d, a.q))
		if err != nil {
			t.Fatalf("request %d (document %d, question %d) to replica %d: %v", n, a.d, a.q, n%replicas, err)
		}
		engines[a.d][r.worker] = append(engines[a.d][r.worker], n)
	}
	for d, by := range engines {
		if len(by) != 1 {
			t.Errorf("document %d: requests went to %d engines, want 1 (engine: requests) %v", d, len(by), by)
		}
	}
	// Each engine's slots hold its documents: after the first question of
	// a document, every later one finds it cached.
	var prompt, cached int
	for _, srv := range srvs {
		for _, r := range srv.Requests() {
			prompt += r.PromptTokens
			cached += r.CachedTokens
		}
	}
	want := float64(questions-1) / float64(questions) * 0.9
	if rate := float64(cached) / float64(prompt); rate < want {
		t.Errorf("hit rate %.3f (%d of %d prompt tokens cached), want at least %.3f", rate, cached, prompt, want)
	}
}
