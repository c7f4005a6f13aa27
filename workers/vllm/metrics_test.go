package vllm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// vllmText is vLLM v0.11's /metrics, cut to a few families of each type.
const vllmText = `# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14526.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 81920.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27189",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
`

// sglangText is SGLang's /metrics (--enable-metrics), cut down.
const sglangText = `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 40000.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 80000.0
`

func TestParse(t *testing.T) {
	cases := []struct {
		name   string
		engine vllm.Engine
		text   string
		want   vllm.Metrics
		// garbage is a fragment of the error, "" for none.
		garbage string
	}{
		{name: "vllm", engine: vllm.VLLM, text: vllmText, want: vllm.Metrics{
			Running: 3, Waiting: 2, HasLoad: true, KVUsage: 0.25, HasKVUsage: true, BlockSize: 16, GPUBlocks: 27189,
		}},
		{name: "vllm before v0.10", engine: vllm.VLLM, text: `vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
`, want: vllm.Metrics{Running: 1, HasLoad: true, KVUsage: 0.5, HasKVUsage: true}},
		{name: "vllm data parallel", engine: vllm.VLLM, text: `vllm:num_requests_running{engine="0"} 1
vllm:num_requests_running{engine="1"} 2
vllm:num_requests_waiting{engine="0"} 3
vllm:num_requests_waiting{engine="1"} 4
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.4
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="100"} 1
`, want: vllm.Metrics{Running: 3, Waiting: 7, HasLoad: true, KVUsage: 0.3, HasKVUsage: true, BlockSize: 32, GPUBlocks: 200}},
		{name: "sglang", engine: vllm.SGLang, text: sglangText, want: vllm.Metrics{
			Running: 7, Waiting: 4, HasLoad: true, KVUsage: 0.5, HasKVUsage: true, KVTokens: 80000,
		}},
		{name: "vllm text read as sglang", engine: vllm.SGLang, text: vllmText,
			garbage: "sglang:num_running_reqs missing; sglang:num_queue_reqs missing"},
		{name: "not metrics", engine: vllm.VLLM, text: "<html>502 Bad Gateway</html>\n", garbage: "vllm:num_requests_running missing"},
		{name: "garbage in a family not read", engine: vllm.VLLM,
			text: "# HELP x broken\nhttp_requests_total{handler= 3\n# some comment\nvllm:num_requests_running 1\nvllm:num_requests_waiting 2",
			want: vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true}},
		{name: "garbage after the load", engine: vllm.VLLM,
			text:    "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc{ 0.5\n",
			want:    vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true},
			garbage: "text format parsing error"},
		{name: "negative count", engine: vllm.VLLM, text: "vllm:num_requests_running -1\nvllm:num_requests_waiting 2\n",
			garbage: "vllm:num_requests_running: -1 is not a count"},
		{name: "NaN count", engine: vllm.VLLM, text: "vllm:num_requests_running NaN\nvllm:num_requests_waiting 2\n",
			garbage: "vllm:num_requests_running: NaN is not a count"},
		{name: "usage above 1", engine: vllm.VLLM,
			text:    "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 25\n",
			want:    vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true},
			garbage: "vllm:kv_cache_usage_perc: 25 is not a fraction 0–1"},
		{name: "bad block size", engine: vllm.VLLM,
			text:    "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\nvllm:cache_config_info{block_size=\"x\",num_gpu_blocks=\"9\"} 1\n",
			want:    vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true},
			garbage: `block_size "x" is not a block size`},
		// vLLM sets the series of the current labels to the time: the
		// latest names the adapters with requests now.
		{name: "vllm lora", engine: vllm.VLLM, text: `vllm:num_requests_running 1
vllm:num_requests_waiting 2
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7000000e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.7000009e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7000005e+09
`, want: vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true, Adapters: []string{"chat", "math", "sql"}, MaxLoRAs: 4, HasLoRA: true}},
		{name: "vllm lora idle", engine: vllm.VLLM, text: "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n" +
			`vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09` + "\n",
			want: vllm.Metrics{HasLoad: true, MaxLoRAs: 2, HasLoRA: true}},
		{name: "bad max_lora", engine: vllm.VLLM, text: "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n" +
			`vllm:lora_requests_info{max_lora="many",running_lora_adapters="sql",waiting_lora_adapters=""} 1` + "\n",
			want: vllm.Metrics{HasLoad: true}, garbage: `max_lora "many" is not a count`},
		{name: "blocks not profiled yet", engine: vllm.VLLM,
			text: "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n",
			want: vllm.Metrics{Running: 1, Waiting: 2, HasLoad: true, BlockSize: 16}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := vllm.Parse(strings.NewReader(c.text), c.engine)
			switch {
			case c.garbage == "" && err != nil:
				t.Errorf("Parse: %v", err)
			case c.garbage != "" && (!errors.Is(err, vllm.ErrGarbage) || !strings.Contains(err.Error(), c.garbage)):
				t.Errorf("Parse error = %v, want ErrGarbage mentioning %q", err, c.garbage)
			}
			if diff := cmp.Diff(c.want, got, cmp.Comparer(func(a, b float64) bool { return a-b < 1e-9 && b-a < 1e-9 })); diff != "" {
				t.Errorf("Parse (-want +got):\n%s", diff)
			}
		})
	}
}

func TestMetricsBlocks(t *testing.T) {
	cases := []struct {
		name        string
		m           vllm.Metrics
		blockSize   int
		used, total int64
	}{
		{"vllm", vllm.Metrics{KVUsage: 0.25, HasKVUsage: true, GPUBlocks: 1000}, 16, 250, 1000},
		{"sglang tokens", vllm.Metrics{KVUsage: 0.5, HasKVUsage: true, KVTokens: 80000}, 16, 2500, 5000},
		{"no usage", vllm.Metrics{GPUBlocks: 1000}, 16, 0, 1000},
		{"no capacity", vllm.Metrics{KVUsage: 0.5, HasKVUsage: true}, 16, 0, 0},
	}
	for _, c := range cases {
		used, total := c.m.Blocks(c.blockSize)
		if used != c.used || total != c.total {
			t.Errorf("%s: Blocks(%d) = %d, %d; want %d, %d", c.name, c.blockSize, used, total, c.used, c.total)
		}
	}
}

func TestScraper(t *testing.T) {
	status := http.StatusOK
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/custom/metrics" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(status)
		fmt.Fprint(w, vllmText)
	}))
	defer srv.Close()
	s, err := vllm.NewScraper(srv.URL+"/", "/custom/metrics", vllm.VLLM)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := s.Scrape(ctx)
	if err != nil || !m.HasLoad || m.Running != 3 || m.GPUBlocks != 27189 {
		t.Errorf("Scrape = %+v, %v; want vLLM's load and capacity", m, err)
	}
	status = http.StatusServiceUnavailable
	if _, err := s.Scrape(ctx); err == nil || errors.Is(err, vllm.ErrGarbage) {
		t.Errorf("Scrape of a 503 = %v, want an error that is not ErrGarbage", err)
	}
	if _, err := vllm.NewScraper("10.0.0.1:8000", "", vllm.VLLM); err == nil {
		t.Error("NewScraper accepted an address without a scheme")
	}
}

// TestParseEngineSGLangRanks: SGLang under --dp-size labels each rank's
// scheduler metrics dp_rank; a rank reads its own series, and the
// unlabelled read sums them.
func TestParseEngineSGLangRanks(t *testing.T) {
	const text = `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 7.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.25
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 80000.0
sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 80000.0
`
	for _, tt := range []struct {
		rank string
		want vllm.Metrics
	}{
		{"0", vllm.Metrics{Running: 7, Waiting: 4, HasLoad: true, KVUsage: 0.5, HasKVUsage: true, KVTokens: 80000}},
		{"1", vllm.Metrics{Running: 2, Waiting: 1, HasLoad: true, KVUsage: 0.25, HasKVUsage: true, KVTokens: 80000}},
		{"", vllm.Metrics{Running: 9, Waiting: 5, HasLoad: true, KVUsage: 0.375, HasKVUsage: true, KVTokens: 160000}},
	} {
		got, err := vllm.ParseEngine(strings.NewReader(text), vllm.SGLang, tt.rank)
		if err != nil {
			t.Fatalf("rank %q: %v", tt.rank, err)
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("rank %q (-want +got):\n%s", tt.rank, diff)
		}
	}
}

// BenchmarkParsePage parses a whole /metrics page of the fake vLLM
// (vllmtest: vLLM's request histograms, HTTP and process metrics, about
// 47 KB), as a scraper does four times a second per engine.
func BenchmarkParsePage(b *testing.B) {
	s, err := vllmtest.New(vllmtest.Config{NoEvents: true, TimeScale: 1e6})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	resp, err := http.Get(s.URL + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		if m, err := vllm.Parse(bytes.NewReader(page), vllm.VLLM); err != nil || !m.HasLoad {
			b.Fatal(m, err)
		}
	}
}
