package vllmtest_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket never stops its writer goroutine on Close.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

func start(t *testing.T, cfg vllmtest.Config) *vllmtest.Server {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1e6 // modelled times of microseconds
	}
	s, err := vllmtest.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// subscribe collects the server's KV event batches.
func subscribe(t *testing.T, s *vllmtest.Server) <-chan kvevents.Message {
	t.Helper()
	sub, err := kvevents.New(kvevents.SubscriberConfig{Endpoint: s.EventsEndpoint(), Topic: s.Topic(), ReplayEndpoint: s.ReplayEndpoint()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
	return sub.Messages()
}

func next(t *testing.T, msgs <-chan kvevents.Message) kvevents.Batch {
	t.Helper()
	select {
	case m := <-msgs:
		if m.Err != nil || m.Reset {
			t.Fatalf("event message %+v", m)
		}
		return m.Batch
	case <-time.After(10 * time.Second):
		t.Fatal("no event batch")
	}
	return kvevents.Batch{}
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func post(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	out.ReadFrom(resp.Body)
	return resp.StatusCode, out.Bytes()
}

// chat sends a non-streamed chat completion and returns its usage.
func chat(t *testing.T, s *vllmtest.Server, text, salt string) usage {
	t.Helper()
	body := map[string]any{"model": s.Model(), "max_tokens": 3, "messages": []map[string]any{{"role": "user", "content": text}}}
	if salt != "" {
		body["cache_salt"] = salt
	}
	status, b := post(t, s.URL+"/v1/chat/completions", body)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, b)
	}
	var r struct {
		Object  string `json:"object"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if r.Object != "chat.completion" || len(r.Choices) != 1 || r.Choices[0].Message.Content != "ok ok ok " {
		t.Fatalf("response %s", b)
	}
	return r.Usage
}

func words(n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "w%d ", i)
	}
	return b.String()
}

func cachedOf(u usage) int {
	if u.PromptTokensDetails == nil {
		return -1
	}
	return u.PromptTokensDetails.CachedTokens
}

// TestPrefixCache: a repeated prompt finds its full blocks cached, all but
// the one holding its last token; another cache salt finds none; the
// events tell each stored block, under the engine's hashes, with its
// tokens.
func TestPrefixCache(t *testing.T) {
	s := start(t, vllmtest.Config{Encoding: kveventstest.TaggedMaps})
	msgs := subscribe(t, s)
	text := words(100) // 100 words, 4 template tokens before, 6 after: 110 tokens
	toks := vllmtest.ChatTokens([]vllmtest.Message{{Role: "user", Content: json.RawMessage(`"` + text + `"`)}}, true)
	if len(toks) != 110 {
		t.Fatalf("%d tokens, want 110", len(toks))
	}

	if u := chat(t, s, text, ""); u.PromptTokens != 110 || cachedOf(u) != 0 || u.CompletionTokens != 3 {
		t.Errorf("first request's usage %+v, want 110 prompt tokens, 0 cached, 3 completion", u)
	}
	b := next(t, msgs)
	st, ok := b.Events[0].(*kvevents.BlockStored)
	if len(b.Events) != 1 || !ok {
		t.Fatalf("first batch %+v, want one BlockStored", b)
	}
	if len(st.BlockHashes) != 6 || st.BlockSize != 16 || !st.Parent.IsZero() || !cmp.Equal(st.TokenIDs, toks[:96]) {
		t.Errorf("stored %d hashes of block size %d, parent %v, tokens %v; want 6 blocks of 16 from the start, the prompt's first 96 tokens",
			len(st.BlockHashes), st.BlockSize, st.Parent, st.TokenIDs)
	}
	if got := s.Cached(toks, ""); got != 96 {
		t.Errorf("Cached = %d, want 96", got)
	}

	if u := chat(t, s, text, ""); cachedOf(u) != 96 {
		t.Errorf("repeated prompt: %d cached tokens, want 96", cachedOf(u))
	}
	// It stored nothing: the next batch is the salted prompt's.
	if u := chat(t, s, text, "tenant-b"); cachedOf(u) != 0 {
		t.Errorf("same prompt under another cache salt: %d cached tokens, want 0", cachedOf(u))
	}
	b = next(t, msgs)
	st = b.Events[0].(*kvevents.BlockStored)
	if len(st.ExtraKeys) == 0 || !cmp.Equal(st.ExtraKeys[0], []string{"tenant-b"}) {
		t.Errorf("salted blocks' extra keys %q, want the salt first", st.ExtraKeys)
	}

	// A prompt of exactly 6 blocks, all cached, recomputes its last one.
	exact := vllmtest.CompletionTokens(words(95), true) // 96 tokens with BOS
	for i, want := range []int{0, 80} {
		status, body := post(t, s.URL+"/v1/completions", map[string]any{"model": s.Model(), "prompt": exact, "max_tokens": 1})
		var r struct{ Usage usage }
		json.Unmarshal(body, &r)
		if status != http.StatusOK || r.Usage.PromptTokens != 96 || cachedOf(r.Usage) != want {
			t.Errorf("block-aligned prompt %d: status %d, usage %+v; want 96 prompt tokens, %d cached", i, status, r.Usage, want)
		}
	}

	if st := s.Stats(); st.Requests != 5 || st.CachedTokens != 96+80 {
		t.Errorf("stats %+v, want 5 requests, 176 cached tokens", st)
	}
}

// TestEviction: a full cache evicts its least recently used blocks, and
// says so; a cleared cache says so too.
func TestEviction(t *testing.T) {
	s := start(t, vllmtest.Config{GPUBlocks: 8})
	msgs := subscribe(t, s)
	a, b := words(60), "x "+words(60) // 4 blocks each (70 and 71 tokens)
	chat(t, s, a, "")
	next(t, msgs)
	chat(t, s, b, "")
	next(t, msgs)
	if got := s.CachedBlocks(); got != 8 {
		t.Fatalf("%d blocks cached, want 8", got)
	}
	chat(t, s, a, "")     // a is used again, storing nothing: b is now the least recent
	c := "y " + words(40) // 3 blocks
	chat(t, s, c, "")
	batch := next(t, msgs)
	rm, ok := batch.Events[0].(*kvevents.BlockRemoved)
	if !ok || len(rm.BlockHashes) != 3 {
		t.Fatalf("batch %+v, want 3 blocks removed first", batch)
	}
	if u := chat(t, s, a, ""); cachedOf(u) != 64 {
		t.Errorf("a after the eviction: %d cached, want all 64 (b's blocks were evicted)", cachedOf(u))
	}
	if err := s.ResetPrefixCache(); err != nil {
		t.Fatal(err)
	}
	if batch := next(t, msgs); len(batch.Events) != 1 || batch.Events[0].Tag() != "AllBlocksCleared" {
		t.Errorf("after a reset: %+v, want AllBlocksCleared", batch)
	}
	if got := s.CachedBlocks(); got != 0 {
		t.Errorf("%d blocks cached after a reset", got)
	}
	if u := chat(t, s, a, ""); cachedOf(u) != 0 {
		t.Errorf("a after a reset: %d cached, want 0", cachedOf(u))
	}
}

// TestStream: a streamed chat completion sends a role chunk, a chunk per
// token, the usage when asked, and [DONE].
func TestStream(t *testing.T) {
	s := start(t, vllmtest.Config{NoEvents: true})
	b, _ := json.Marshal(map[string]any{"model": s.Model(), "max_tokens": 4, "stream": true,
		"stream_options": map[string]any{"include_usage": true},
		"messages":       []map[string]any{{"role": "user", "content": []map[string]any{{"type": "text", "text": words(40)}}}}})
	resp, err := http.Post(s.URL+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var content strings.Builder
	var last usage
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		events = append(events, data)
		if data == "[DONE]" {
			break
		}
		var c struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Usage *usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("%q: %v", data, err)
		}
		for _, ch := range c.Choices {
			content.WriteString(ch.Delta.Content)
		}
		if c.Usage != nil {
			last = *c.Usage
		}
	}
	if len(events) != 7 || events[6] != "[DONE]" {
		t.Errorf("%d events ending %q, want role, 4 tokens, usage, [DONE]", len(events), events[len(events)-1])
	}
	if content.String() != "ok ok ok ok " || last.PromptTokens != 50 || last.CompletionTokens != 4 || cachedOf(last) != 0 {
		t.Errorf("content %q, usage %+v; want 4 tokens, 50 prompt tokens, 0 cached", content.String(), last)
	}
}

// TestTokenize: /tokenize answers both of vLLM's forms with the tokens a
// completion of the same request is charged for.
func TestTokenize(t *testing.T) {
	s := start(t, vllmtest.Config{NoEvents: true})
	// BOS; system header (4), "be brief" (3: "brief" is 2 pieces), end of
	// turn; user header (3), 20 words, end of turn; assistant header (5).
	msgs := []map[string]any{{"role": "system", "content": "be brief"}, {"role": "user", "content": words(20)}}
	for _, c := range []struct {
		name string
		body map[string]any
		want int
	}{
		{"chat", map[string]any{"model": s.Model(), "messages": msgs, "add_generation_prompt": true}, 38},
		{"chat without the generation prompt", map[string]any{"messages": msgs, "add_generation_prompt": false}, 33},
		{"completion", map[string]any{"model": s.Model(), "prompt": words(20)}, 21},
	} {
		status, b := post(t, s.URL+"/tokenize", c.body)
		var r struct {
			Count  int      `json:"count"`
			Tokens []uint32 `json:"tokens"`
		}
		json.Unmarshal(b, &r)
		if status != http.StatusOK || r.Count != c.want || len(r.Tokens) != c.want {
			t.Errorf("%s: status %d, count %d, %d tokens; want %d: %s", c.name, status, r.Count, len(r.Tokens), c.want, b)
		}
	}
	status, b := post(t, s.URL+"/v1/chat/completions", map[string]any{"model": s.Model(), "messages": msgs, "max_tokens": 1})
	var r struct{ Usage usage }
	json.Unmarshal(b, &r)
	if status != http.StatusOK || r.Usage.PromptTokens != 38 {
		t.Errorf("chat completion: status %d, %d prompt tokens, want 38", status, r.Usage.PromptTokens)
	}
	if status, _ := post(t, s.URL+"/tokenize", map[string]any{"model": "other", "prompt": "x"}); status != http.StatusNotFound {
		t.Errorf("another model: status %d, want 404", status)
	}
}

// TestMetrics: /metrics parses as vLLM's, with the cache's geometry, and
// a request waiting for a running slot counts as waiting.
func TestMetrics(t *testing.T) {
	s := start(t, vllmtest.Config{NoEvents: true, GPUBlocks: 500, BlockSize: 32, MaxRunning: 1, TimeScale: 1})
	read := func() vllm.Metrics {
		resp, err := http.Get(s.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		m, err := vllm.Parse(resp.Body, vllm.VLLM)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := read(); m.BlockSize != 32 || m.GPUBlocks != 500 || !m.HasLoad || m.Running != 0 || m.Waiting != 0 {
		t.Errorf("idle metrics %+v, want block size 32, 500 blocks, nothing running", m)
	}
	// Two requests of a long decode at real time: one runs, one waits.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range 2 {
		b, _ := json.Marshal(map[string]any{"model": s.Model(), "max_tokens": 10000, "prompt": words(200)})
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/v1/completions", bytes.NewReader(b))
		go func() {
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	waitMetrics(t, read, "1 running, 1 waiting, some KV usage", func(m vllm.Metrics) bool {
		return m.Running == 1 && m.Waiting == 1 && m.KVUsage > 0
	})
	cancel()
	waitMetrics(t, read, "nothing running or waiting after the clients left", func(m vllm.Metrics) bool {
		return m.Running == 0 && m.Waiting == 0
	})
}

// waitMetrics reads the metrics every 10 ms until want holds, failing t
// after 10 s: the requests reach the engine over HTTP.
func waitMetrics(t *testing.T, read func() vllm.Metrics, what string, want func(vllm.Metrics) bool) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for m := read(); !want(m); m = read() {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("metrics %+v, want %s", m, what)
		}
	}
}

// BenchmarkTokenize8000 measures what asking a fake engine's /tokenize for
// an 8,000-token chat prompt costs, over loopback HTTP, through the
// scheduler's client (vllm.Tokenizer): the JSON both ways and the fake's
// tokenizer. p99-ns is the 99th percentile of one call.
func BenchmarkTokenize8000(b *testing.B) {
	s, err := vllmtest.New(vllmtest.Config{NoEvents: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(s.Close)
	tok, err := vllm.NewTokenizer(s.URL, "")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { tok.Close() })
	body, _ := json.Marshal(map[string]any{"model": s.Model(), "messages": []map[string]any{{"role": "user", "content": strings.Repeat("word ", 8000)}}})
	req := &engine.Request{Model: s.Model(), Path: "/v1/chat/completions", Body: body}
	ctx := context.Background()
	took := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		toks, err := tok.Tokenize(ctx, req)
		took = append(took, time.Since(t0))
		if err != nil || len(toks) != 8010 {
			b.Fatalf("%d tokens, %v; want 8,010", len(toks), err)
		}
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)*99/100]), "p99-ns")
}

// TestChurn: Churn stores a prompt's blocks and publishes them as a
// prefill would, and once the cache is full each new prompt evicts as many
// blocks as it stores.
func TestChurn(t *testing.T) {
	s := start(t, vllmtest.Config{Encoding: kveventstest.TaggedMaps, GPUBlocks: 8, BlockSize: 4})
	msgs := subscribe(t, s)
	prompt := func(seed uint32) []uint32 {
		p := make([]uint32, 16) // 4 blocks
		for i := range p {
			p[i] = seed*100 + uint32(i)
		}
		return p
	}
	stored, removed := 0, 0
	for seed := range uint32(3) {
		s.Churn(prompt(seed + 1))
		b := next(t, msgs)
		for _, ev := range b.Events {
			switch ev := ev.(type) {
			case *kvevents.BlockStored:
				stored += len(ev.BlockHashes)
				if len(ev.TokenIDs) != 16 {
					t.Errorf("prompt %d: %d token ids, want 16", seed, len(ev.TokenIDs))
				}
			case *kvevents.BlockRemoved:
				removed += len(ev.BlockHashes)
			}
		}
	}
	if stored != 12 || removed != 4 {
		t.Errorf("three prompts of 4 blocks into 8: stored %d, removed %d; want 12 and 4", stored, removed)
	}
}

// TestMetricsNamed: a scrape naming series gets, family by family, what
// the whole page holds of them, as the served requests change (the
// static families' restriction is kept between scrapes).
func TestMetricsNamed(t *testing.T) {
	s := start(t, vllmtest.Config{NoEvents: true, TimeScale: 1e6, MaxLoRAs: 2})
	get := func(query string) map[string]string {
		t.Helper()
		resp, err := http.Get(s.URL + "/metrics" + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		// Family name (from its HELP line) → its lines.
		fams := map[string]string{}
		var name string
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line := sc.Text()
			if f, ok := strings.CutPrefix(line, "# HELP "); ok {
				name, _, _ = strings.Cut(f, " ")
			}
			if strings.HasPrefix(line, "vllm:lora_requests_info{") {
				line = line[:strings.LastIndexByte(line, ' ')] + " (the time)"
			}
			fams[name] += line + "\n"
		}
		return fams
	}
	names := []string{"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
		"vllm:request_prompt_tokens_count", "vllm:lora_requests_info", "vllm:no_such_series"}
	query := "?name[]=" + strings.Join(names, "&name[]=")
	for round := range 3 {
		whole := get("")
		named := get(query)
		want := map[string]string{}
		for fam, text := range whole {
			var kept []string
			for line := range strings.Lines(text) {
				sample, _, _ := strings.Cut(line, "{")
				sample, _, _ = strings.Cut(sample, " ")
				if strings.HasPrefix(line, "#") || slices.Contains(names, strings.TrimSpace(sample)) {
					kept = append(kept, line)
				}
			}
			if len(kept) > 2 { // more than its HELP and TYPE
				want[fam] = strings.Join(kept, "")
			}
		}
		if len(want) != 5 {
			t.Fatalf("round %d: the whole page has %d of the 5 named families: %v", round, len(want), want)
		}
		if diff := cmp.Diff(want, named); diff != "" {
			t.Errorf("round %d: named scrape, by family (-whole page's +named):\n%s", round, diff)
		}
		if status, b := post(t, s.URL+"/v1/completions", map[string]any{"model": s.Model(), "prompt": words(50), "max_tokens": 2}); status != http.StatusOK {
			t.Fatalf("completion: status %d: %s", status, b)
		}
	}
}
