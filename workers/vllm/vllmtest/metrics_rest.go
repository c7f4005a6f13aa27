package vllmtest

import (
	"fmt"
	"io"
	"strings"
)

// The rest of a vLLM (v1 engine) /metrics page, which a scraper reads
// past to the few series it uses: request histograms with vLLM's bucket
// boundaries, their _created series (Python's prometheus_client writes
// them in the text format), counters by finish reason, the HTTP server's
// instrumentator metrics and the Python process's. A real page is tens of
// kilobytes; so is this one, so that what scraping costs is measured on
// the bytes real engines serve.

// vLLM's histogram buckets.
var (
	ttftBuckets    = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	itlBuckets     = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	latencyBuckets = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
	tokenBuckets   = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000}
	iterBuckets    = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
	nBuckets       = []float64{1, 2, 5, 10, 20}
	httpBuckets    = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60}
)

// writeRestOfMetrics writes those families with labels l (engine and
// model name), requests being the requests served so far.
func writeRestOfMetrics(w io.Writer, l string, requests int64) {
	const created = 1.7645e9
	n := float64(requests)
	hist := func(name, help string, buckets []float64, mean float64) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name)
		for _, b := range buckets {
			fmt.Fprintf(w, "%s_bucket{%s,le=\"%v\"} %v\n", name, l, b, n)
		}
		fmt.Fprintf(w, "%s_bucket{%s,le=\"+Inf\"} %v\n%s_count{%s} %v\n%s_sum{%s} %v\n", name, l, n, name, l, n, name, l, n*mean)
		fmt.Fprintf(w, "# HELP %s_created %s\n# TYPE %s_created gauge\n%s_created{%s} %v\n", name, help, name, name, l, created)
	}
	counter := func(name, help string, labels []string, v float64) {
		fmt.Fprintf(w, "# HELP %s_total %s\n# TYPE %s_total counter\n", name, help, name)
		for _, ls := range labels {
			fmt.Fprintf(w, "%s_total{%s} %v\n", name, ls, v)
		}
		fmt.Fprintf(w, "# HELP %s_created %s\n# TYPE %s_created gauge\n", name, help, name)
		for _, ls := range labels {
			fmt.Fprintf(w, "%s_created{%s} %v\n", name, ls, created)
		}
	}
	counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", []string{l}, 0)
	counter("vllm:generation_tokens", "Number of generation tokens processed.", []string{l}, n*64)
	var reasons []string
	for _, reason := range []string{"abort", "length", "stop"} {
		reasons = append(reasons, l+`,finished_reason="`+reason+`"`)
	}
	counter("vllm:request_success_by_reason", "Count of successfully processed requests.", reasons, n/3)
	hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokenBuckets, 2000)
	hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokenBuckets, 64)
	hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", iterBuckets, 256)
	hist("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", tokenBuckets, 256)
	hist("vllm:request_params_n", "Histogram of the n request parameter.", nBuckets, 1)
	hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokenBuckets, 256)
	hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets, 0.2)
	hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", itlBuckets, 0.02)
	hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itlBuckets, 0.02)
	for _, name := range []string{"e2e_request_latency", "request_queue_time", "request_inference_time", "request_prefill_time", "request_decode_time"} {
		hist("vllm:"+name+"_seconds", "Histogram of "+strings.ReplaceAll(name, "_", " ")+" in seconds.", latencyBuckets, 1.5)
	}
	handlers := []string{"/v1/chat/completions", "/v1/completions", "/metrics", "/health", "/tokenize"}
	hl := func(h string) string {
		m := "POST"
		if h == "/metrics" || h == "/health" {
			m = "GET"
		}
		return fmt.Sprintf(`handler=%q,method="%s"`, h, m)
	}
	fmt.Fprint(w, "# HELP http_requests_total Total number of requests by method, status and handler.\n# TYPE http_requests_total counter\n")
	for _, h := range handlers {
		fmt.Fprintf(w, "http_requests_total{%s,status=\"2xx\"} %v\n", hl(h), n)
	}
	fmt.Fprint(w, "# HELP http_request_duration_highr_seconds Latency with many buckets but no API specific labels.\n# TYPE http_request_duration_highr_seconds histogram\n")
	for _, h := range handlers {
		for _, b := range httpBuckets {
			fmt.Fprintf(w, "http_request_duration_highr_seconds_bucket{%s,le=\"%v\"} %v\n", hl(h), b, n)
		}
		fmt.Fprintf(w, "http_request_duration_highr_seconds_bucket{%s,le=\"+Inf\"} %v\nhttp_request_duration_highr_seconds_count{%s} %v\nhttp_request_duration_highr_seconds_sum{%s} %v\n", hl(h), n, hl(h), n, hl(h), n*0.1)
	}
	fmt.Fprint(w, "# HELP http_request_size_bytes Content length of incoming requests by handler.\n# TYPE http_request_size_bytes summary\n")
	for _, h := range handlers {
		fmt.Fprintf(w, "http_request_size_bytes_count{handler=%q} %v\nhttp_request_size_bytes_sum{handler=%q} %v\n", h, n, h, n*8000)
	}
	fmt.Fprint(w, "# HELP python_gc_objects_collected_total Objects collected during gc\n# TYPE python_gc_objects_collected_total counter\n")
	for g := range 3 {
		fmt.Fprintf(w, "python_gc_objects_collected_total{generation=\"%d\"} %d\n", g, 12000+g)
	}
	fmt.Fprint(w, `# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"} 1.0
# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes 1.0871930880e+11
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 5.136195584e+09
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76450112e+09
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 812.5
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 97.0
# HELP process_max_fds Maximum number of open file descriptors.
# TYPE process_max_fds gauge
process_max_fds 1.048576e+06
`)
}
