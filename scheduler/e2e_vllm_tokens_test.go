package scheduler_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/openai/openaitest"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// startPublishingEngine starts a fake vLLM whose chat completions publish
// their prompt's blocks, and returns it with its worker's configuration.
func startPublishingEngine(t *testing.T, name string) (*fakeEngine, scheduler.WorkerConfig) {
	t.Helper()
	eng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	pub, err := kveventstest.NewPublisher(kveventstest.PublisherConfig{
		Endpoint: "tcp://127.0.0.1:0", Topic: "kv-events", Replay: true, Encoding: kveventstest.TaggedMaps,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	eng.mu.Lock()
	eng.pub = pub
	eng.mu.Unlock()
	return eng, scheduler.WorkerConfig{
		Name: name, Kind: scheduler.KindVLLM, Address: eng.srv.URL,
		EngineConfig: scheduler.EngineConfig{
			Events: pub.Endpoint(), EventsReplay: pub.ReplayEndpoint(), EventsTopic: "kv-events",
			MetricsInterval: 50 * time.Millisecond,
		},
	}
}

// predictedHit reads the hit ratio of a kv_aware route header.
func predictedHit(t *testing.T, route string) float64 {
	t.Helper()
	_, rest, ok := strings.Cut(route, "predicted_hit=")
	if !ok {
		t.Fatalf("route %q has no predicted_hit", route)
	}
	v, err := strconv.ParseFloat(strings.SplitN(rest, ";", 2)[0], 64)
	if err != nil {
		t.Fatalf("route %q: %v", route, err)
	}
	return v
}

// longPrefix is a system prompt of n distinct words.
func longPrefix(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "w%d ", i)
	}
	return b.String()
}

// TestVLLMTokenKeys: a request is keyed by the engine's tokens, so
// kv_aware sends a prompt whose prefix an engine reported holding (it was
// served there without this scheduler) to that engine, predicting a hit.
func TestVLLMTokenKeys(t *testing.T) {
	e0, w0 := startPublishingEngine(t, "v0")
	e1, w1 := startPublishingEngine(t, "v1")
	s, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{w0, w1},
	})
	for _, e := range []*fakeEngine{e0, e1} {
		if err := e.pub.WaitSubscribed(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
	}

	prefix := longPrefix(400)
	first := []openaitest.Message{{Role: "system", Content: json.RawMessage(strconv.Quote(prefix))}, {Role: "user", Content: json.RawMessage(`"first question"`)}}
	body, _ := json.Marshal(map[string]any{"model": model, "messages": first})
	resp, err := http.Post(e1.srv.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	keys := blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt(model, "", "")), fakeTokens(first), fakeBlockSize)
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v1", keys); m.GPU != len(keys) {
			return fmt.Errorf("index has %d of v1's %d blocks", m.GPU, len(keys))
		}
		return nil
	})

	got := chat(t, oaClient(t, addr), openai.ChatCompletionNewParams{
		Model:    model,
		Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(prefix), openai.UserMessage("second question")},
	})
	if got.worker != "v1" {
		t.Errorf("request sharing v1's prefix went to %q (%s), want v1", got.worker, got.route)
	}
	if hit := predictedHit(t, got.route); hit < 0.9 {
		t.Errorf("route %q: predicted hit %v, want the shared prefix, over 0.9 of the prompt", got.route, hit)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if got, _ := metric(m, "baton_tokenize_total", `outcome="miss"`); got != 1 {
		t.Errorf(`baton_tokenize_total{outcome="miss"} = %v, want 1`, got)
	}
}

// TestVLLMTokenizeCache: a repeated prompt's tokens come from the cache,
// not from another call to the engine.
func TestVLLMTokenizeCache(t *testing.T) {
	eng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "v0", Kind: scheduler.KindVLLM, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 50 * time.Millisecond},
		}},
	})
	c := oaClient(t, addr)
	p := chatParams(longPrefix(100), 8)
	for range 2 {
		chat(t, c, p)
	}
	if got := eng.tokenizeCalls(); got != 1 {
		t.Errorf("the engine tokenized the same prompt %d times, want once", got)
	}
	chat(t, c, chatParams(longPrefix(101), 8))
	if got := eng.tokenizeCalls(); got != 2 {
		t.Errorf("after another prompt the engine tokenized %d times, want 2", got)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	for outcome, want := range map[string]float64{"hit": 1, "miss": 2, "failed": 0} {
		if got, _ := metric(m, "baton_tokenize_total", `outcome="`+outcome+`"`); got != want {
			t.Errorf(`baton_tokenize_total{outcome=%q} = %v, want %v`, outcome, got, want)
		}
	}
}

// TestVLLMTokenizeFails: when the engine's /tokenize fails, requests are
// keyed by their text and served; the failure is counted, and logged once
// until tokenization works again.
func TestVLLMTokenizeFails(t *testing.T) {
	eng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	eng.mu.Lock()
	eng.tokenizeFails = true
	eng.mu.Unlock()
	logs := &logRecorder{level: slog.LevelInfo}
	_, addr := startSchedulerLog(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "v0", Kind: scheduler.KindVLLM, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 50 * time.Millisecond, TokenizeCacheTokens: -1},
		}},
	}, slog.New(logs))
	c := oaClient(t, addr)
	for i := range 3 {
		if got := chat(t, c, chatParams(longPrefix(50+i), 8)); got.worker != "v0" || got.content != "Hello there." {
			t.Fatalf("request %d with a failing /tokenize: %+v, want v0's answer", i, got)
		}
	}
	eng.mu.Lock()
	eng.tokenizeFails = false
	eng.mu.Unlock()
	chat(t, c, chatParams(longPrefix(60), 8))

	m := scrape(t, httpClient(t), addr)
	for outcome, want := range map[string]float64{"failed": 3, "miss": 1} {
		if got, _ := metric(m, "baton_tokenize_total", `outcome="`+outcome+`"`); got != want {
			t.Errorf(`baton_tokenize_total{outcome=%q} = %v, want %v`, outcome, got, want)
		}
	}
	var failed, recovered int
	for _, msg := range logs.messages() {
		switch {
		case strings.Contains(msg, "tokenization failed"):
			failed++
		case strings.Contains(msg, "tokenization works again"):
			recovered++
		}
	}
	if failed != 1 || recovered != 1 {
		t.Errorf("logged %d failures and %d recoveries, want one of each: %q", failed, recovered, logs.messages())
	}
}

// TestVLLMTenantCacheSalt: a request's tenant reaches a vLLM engine as
// its cache_salt, so the engine keeps each tenant's blocks apart, and
// kv_aware keys the request with the same salt: a prompt one tenant
// cached is a hit for that tenant only. A client's own cache_salt stands.
func TestVLLMTenantCacheSalt(t *testing.T) {
	e0, w0 := startPublishingEngine(t, "v0")
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{w0},
	})
	if err := e0.pub.WaitSubscribed(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	c := oaClient(t, addr)
	prefix := longPrefix(400)
	ask := func(tenant, question string) chatResult {
		p := openai.ChatCompletionNewParams{
			Model:    model,
			Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(prefix), openai.UserMessage(question)},
		}
		if tenant != "" {
			p.PromptCacheKey = openai.String(tenant)
		}
		return chat(t, c, p)
	}
	ask("tenant-a", "first question")
	// The engine's events reach the index: tenant a's next request is a
	// predicted hit.
	var hitA float64
	eventually(t, 10*time.Second, func() error {
		hitA = predictedHit(t, ask("tenant-a", "again").route)
		if hitA < 0.9 {
			return fmt.Errorf("tenant a's repeated prefix: predicted hit %v", hitA)
		}
		return nil
	})
	if hit := predictedHit(t, ask("tenant-b", "first question").route); hit != 0 {
		t.Errorf("tenant b on tenant a's prefix: predicted hit %v, want 0", hit)
	}
	e0.mu.Lock()
	salts := append([]string(nil), e0.salts...)
	e0.mu.Unlock()
	if len(salts) < 3 || salts[0] != "tenant-a" || salts[len(salts)-1] != "tenant-b" {
		t.Errorf("cache_salt the engine saw: %q, want tenant-a first and tenant-b last", salts)
	}
	// A client that sets cache_salt itself keeps it.
	body := `{"model":"` + model + `","prompt_cache_key":"tenant-a","cache_salt":"mine","messages":[{"role":"user","content":"hello"}]}`
	if r := do(t, httpClient(t), http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil); r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	e0.mu.Lock()
	last := e0.salts[len(e0.salts)-1]
	e0.mu.Unlock()
	if last != "mine" {
		t.Errorf("the client's cache_salt became %q, want mine", last)
	}
}
