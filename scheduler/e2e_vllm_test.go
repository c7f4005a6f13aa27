package scheduler_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/openai/openaitest"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// fakeEngine is a vLLM (or SGLang) server enough for the scheduler: the
// OpenAI chat completions it relays, /v1/models, /health, /metrics in the
// engine's exposition format, as set by the test, and /tokenize (fakeTokens).
// With a publisher (publish), each chat completion publishes BlockStored
// for the full 16-token blocks of its prompt's tokens.
type fakeEngine struct {
	srv *httptest.Server

	mu            sync.Mutex
	metrics       string
	chats         int
	tokenizes     int
	tokenizeFails bool
	salts         []string // cache_salt of each chat completion
	pub           *kveventstest.Publisher
	ts            float64 // of the last batch published
}

// fakeBlockSize is the fake engine's tokens a block.
const fakeBlockSize = 16

// fakeTokens is the fake engine's tokenizer and chat template: a token for
// each message's role, one for each word of its text, and one for the
// generation prompt. A token id is a hash of its word.
func fakeTokens(msgs []openaitest.Message) []uint32 {
	tok := func(w string) uint32 { return uint32(xxhash.Sum64String(w) % 100000) }
	var out []uint32
	for _, m := range msgs {
		out = append(out, tok("<|"+m.Role+"|>"))
		for _, w := range strings.Fields(m.Text()) {
			out = append(out, tok(w))
		}
	}
	return append(out, tok("<|assistant|>"))
}

// publish publishes the blocks of tokens as stored, under the engine's own
// chained hashes, salted as vLLM does with the request's cache_salt (the
// last of the first block's extra keys).
func (f *fakeEngine) publish(tokens []uint32, salt string) error {
	var hashes []kvevents.Hash
	n := len(tokens) / fakeBlockSize * fakeBlockSize
	var h uint64 = 7 + xxhash.Sum64String(salt) // the engine's seed, unlike baton's
	for i := 0; i < n; i += fakeBlockSize {
		h = blockkey.NextTokenKey(h, tokens[i:i+fakeBlockSize])
		hashes = append(hashes, kvevents.IntHash(h))
	}
	if len(hashes) == 0 {
		return nil
	}
	f.ts++
	ev := &kvevents.BlockStored{BlockHashes: hashes, TokenIDs: tokens[:n], BlockSize: fakeBlockSize, Medium: "GPU"}
	if salt != "" {
		ev.ExtraKeys = make([][]string, len(hashes))
		ev.ExtraKeys[0] = []string{salt}
	}
	_, err := f.pub.Publish(kvevents.Batch{TS: f.ts, Events: []kvevents.Event{ev}})
	return err
}

func startFakeEngine(t *testing.T, metrics string) *fakeEngine {
	t.Helper()
	f := &fakeEngine{metrics: metrics}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		openaitest.Models(w, "application/json", map[string]any{"id": model, "object": "model", "created": 1,
			"owned_by": "vllm", "root": model, "parent": nil, "max_model_len": 8192})
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		f.mu.Lock()
		defer f.mu.Unlock()
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		fmt.Fprint(w, f.metrics)
	})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model     string               `json:"model"`
			Messages  []openaitest.Message `json:"messages"`
			CacheSalt string               `json:"cache_salt"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Model != model {
			http.Error(w, `{"error":{"message":"bad request","type":"BadRequestError","code":400}}`, http.StatusBadRequest)
			return
		}
		f.mu.Lock()
		f.chats++
		f.salts = append(f.salts, req.CacheSalt)
		if f.pub != nil {
			if err := f.publish(fakeTokens(req.Messages), req.CacheSalt); err != nil {
				t.Errorf("fake engine: publishing: %v", err)
			}
		}
		f.mu.Unlock()
		c := openaitest.Completion{ID: "chatcmpl-1", Model: model, Created: 1, Chat: true}
		openaitest.WriteJSON(w, http.StatusOK, "application/json",
			c.Body(c.Choice("Hello there.", "stop", nil), openaitest.Usage(12, 3, openaitest.Cached(0), false), nil))
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model               string               `json:"model"`
			Messages            []openaitest.Message `json:"messages"`
			AddGenerationPrompt bool                 `json:"add_generation_prompt"`
		}
		f.mu.Lock()
		f.tokenizes++
		fails := f.tokenizeFails
		f.mu.Unlock()
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Model != model || len(req.Messages) == 0 || !req.AddGenerationPrompt || fails {
			http.Error(w, `{"error":{"message":"bad request","type":"BadRequestError","code":400}}`, http.StatusBadRequest)
			return
		}
		toks := fakeTokens(req.Messages)
		w.Header().Set("Content-Type", "application/json")
		b, _ := json.Marshal(map[string]any{"count": len(toks), "max_model_len": 8192, "tokens": toks})
		w.Write(b)
	})
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeEngine) tokenizeCalls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.tokenizes
}

func (f *fakeEngine) setMetrics(text string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.metrics = text
}

// vllmMetrics renders vLLM's /metrics (v0.11, cut to a few families of
// each type) for a load.
func vllmMetrics(running, waiting int, usage float64, gpuBlocks int) string {
	const m = `model_name="` + model + `"`
	return fmt.Sprintf(`# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14526.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",%[1]s} %[2]d.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",%[1]s} %[3]d.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",%[1]s} %[4]g
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",%[1]s} 81920.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",%[1]s} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",%[1]s} 40.0
vllm:time_to_first_token_seconds_count{engine="0",%[1]s} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",%[1]s} 3.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="%[5]d",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
`, m, running, waiting, usage, gpuBlocks)
}

// lookup returns what the scheduler's index knows of worker for keys.
func lookup(s *scheduler.Scheduler, worker string, keys []uint64) kvindex.Match {
	out := make([]kvindex.Match, 1)
	s.Index.Lookup(keys, []string{worker}, out)
	return out[0]
}

// tokens returns n distinct token ids from start.
func tokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

// TestVLLMWorker: a vllm worker serves requests as an http engine; the
// scheduler learns its load from /metrics and its blocks from its KV
// events, under baton's keys.
func TestVLLMWorker(t *testing.T) {
	eng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	pub, err := kveventstest.NewPublisher(kveventstest.PublisherConfig{
		Endpoint: "tcp://127.0.0.1:0", Topic: "kv-events", Replay: true, Encoding: kveventstest.TaggedMaps,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	s, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "v0", Kind: scheduler.KindVLLM, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{
				Events: pub.Endpoint(), EventsReplay: pub.ReplayEndpoint(), EventsTopic: "kv-events",
				MetricsInterval: 50 * time.Millisecond,
			},
		}},
	})

	got := chat(t, oaClient(t, addr), chatParams("Say hello.", 8))
	if got.worker != "v0" || got.content != "Hello there." {
		t.Errorf("chat = %+v, want the fake engine's answer from v0", got)
	}

	// The first scrape first (the chat may be answered before it), so
	// that the load below is learned from a later one.
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v0", nil); !m.Known || m.Load.GPUBlocksTotal != 1000 {
			return fmt.Errorf("index has v0 known=%v load %+v before the first scrape's", m.Known, m.Load)
		}
		return nil
	})
	eng.setMetrics(vllmMetrics(3, 2, 0.25, 1000))
	eventually(t, 10*time.Second, func() error {
		m := lookup(s, "v0", nil)
		want := kvindex.Load{Running: 3, Waiting: 2, GPUBlocksUsed: 250, GPUBlocksTotal: 1000}
		if !m.Known || m.Load != want || m.BlockTokens != 16 {
			return fmt.Errorf("index has v0 known=%v load %+v block tokens %d; want load %+v, 16 tokens a block", m.Known, m.Load, m.BlockTokens, want)
		}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
	prompt := tokens(100, 48) // three blocks of 16
	keys := blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt(model, "", "")), prompt, 16)
	other := blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt("another-model", "", "")), prompt, 16)
	for _, b := range []kvevents.Batch{
		{TS: 1, Events: []kvevents.Event{&kvevents.BlockStored{
			BlockHashes: []kvevents.Hash{kvevents.IntHash(11), kvevents.IntHash(12)},
			TokenIDs:    prompt[:32], BlockSize: 16, Medium: "GPU",
		}}},
		{TS: 2, Events: []kvevents.Event{&kvevents.BlockStored{
			BlockHashes: []kvevents.Hash{kvevents.IntHash(13)}, Parent: kvevents.IntHash(12),
			TokenIDs: prompt[32:], BlockSize: 16, Medium: "GPU",
		}}},
	} {
		if _, err := pub.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v0", keys); m.GPU != 3 {
			return fmt.Errorf("index has %d of the 3 stored blocks on v0 under baton's keys", m.GPU)
		}
		return nil
	})
	if m := lookup(s, "v0", other); m.GPU != 0 {
		t.Errorf("blocks of another model's keys: %d on v0, want 0 (keys are salted by the served model)", m.GPU)
	}

	if _, err := pub.Publish(kvevents.Batch{TS: 3, Events: []kvevents.Event{&kvevents.AllBlocksCleared{}}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		m := lookup(s, "v0", keys)
		if m.GPU != 0 {
			return fmt.Errorf("after AllBlocksCleared the index still has %d blocks on v0", m.GPU)
		}
		if m.Load.Running != 3 {
			return fmt.Errorf("after AllBlocksCleared v0's load is %+v, want the latest scraped (3 running)", m.Load)
		}
		return nil
	})

	m := scrape(t, httpClient(t), addr)
	for _, c := range []struct {
		name, label string
		want        float64
	}{
		{"baton_kv_events_total", `outcome="stored"`, 3},
		{"baton_kv_events_total", `outcome="cleared"`, 1},
		{"baton_kv_event_stream_total", `event="batch"`, 3},
		{"baton_engine_scrapes_total", `outcome="garbage"`, 0},
	} {
		if got, _ := metric(m, c.name, `worker="v0"`, c.label); got != c.want {
			t.Errorf("%s{worker=\"v0\",%s} = %v, want %v", c.name, c.label, got, c.want)
		}
	}
	if got, _ := metric(m, "baton_engine_scrapes_total", `worker="v0"`, `outcome="ok"`); got < 2 {
		t.Errorf(`baton_engine_scrapes_total{worker="v0",outcome="ok"} = %v, want the scrapes that taught the load`, got)
	}
}

// TestVLLMMetricsGarbage: garbage in an engine's /metrics is counted and
// logged once, never fatal: the worker keeps serving, and its load is
// learned once the metrics are sane again.
func TestVLLMMetricsGarbage(t *testing.T) {
	eng := startFakeEngine(t, "<html><body>502 Bad Gateway</body></html>\n")
	logs := &logRecorder{level: slog.LevelWarn}
	s, addr := startSchedulerLog(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "v0", Kind: scheduler.KindVLLM, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond},
		}},
	}, slog.New(logs))
	hc := httpClient(t)
	eventually(t, 10*time.Second, func() error {
		if got, _ := metric(scrape(t, hc, addr), "baton_engine_scrapes_total", `worker="v0"`, `outcome="garbage"`); got < 3 {
			return fmt.Errorf(`baton_engine_scrapes_total{worker="v0",outcome="garbage"} = %v, want 3 or more`, got)
		}
		return nil
	})
	if got := chat(t, oaClient(t, addr), chatParams("Say hello.", 8)); got.worker != "v0" {
		t.Errorf("chat went to %q with garbage metrics, want v0", got.worker)
	}
	var warned int
	for _, msg := range logs.messages() {
		if strings.Contains(msg, "engine metrics unusable") {
			warned++
		}
	}
	if warned != 1 {
		t.Errorf("garbage metrics logged %d times, want once: %q", warned, logs.messages())
	}

	eng.setMetrics(vllmMetrics(5, 1, 0.5, 2000))
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v0", nil); m.Load.Running != 5 || m.Load.Waiting != 1 || m.Load.GPUBlocksTotal != 2000 {
			return fmt.Errorf("v0's load is %+v, want 5 running, 1 waiting, 2000 blocks", m.Load)
		}
		return nil
	})
}

// TestSGLangWorker: an sglang worker's load comes from SGLang's metrics,
// its capacity in blocks from its tokens and the configured block size.
func TestSGLangWorker(t *testing.T) {
	eng := startFakeEngine(t, `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="`+model+`"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="`+model+`"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="`+model+`"} 0.5
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="`+model+`"} 80000.0
`)
	s, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "s0", Kind: scheduler.KindSGLang, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond, BlockSize: 32},
		}},
	})
	eventually(t, 10*time.Second, func() error {
		m := lookup(s, "s0", nil)
		want := kvindex.Load{Running: 7, Waiting: 4, GPUBlocksUsed: 1250, GPUBlocksTotal: 2500}
		if m.Load != want || m.BlockTokens != 32 {
			return fmt.Errorf("s0: load %+v, block tokens %d; want %+v, 32", m.Load, m.BlockTokens, want)
		}
		return nil
	})
	m := scrape(t, httpClient(t), addr)
	if got, _ := metric(m, "baton_engine_scrapes_total", `worker="s0"`, `outcome="ok"`); got < 1 {
		t.Errorf(`baton_engine_scrapes_total{worker="s0",outcome="ok"} = %v, want 1 or more`, got)
	}
	if _, found := metric(m, "baton_kv_events_total", `worker="s0"`); found {
		t.Error(`baton_kv_events_total{worker="s0"} exported for a worker without events`)
	}
}
