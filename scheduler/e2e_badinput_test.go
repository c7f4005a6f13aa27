package scheduler_test

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
)

// TestBadInput: every malformed request gets its status and an OpenAI
// error naming the offending parameter, and the server keeps serving.
func TestBadInput(t *testing.T) {
	_, workers := startWorkers(t, 2, fastScale)
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "prefix_aware",
		Config:   frontend.Config{MaxBodyBytes: 4096},
		Workers:  workers,
		Pool:     fastPool(),
	})
	hc := httpClient(t)
	base := "http://" + addr
	const chatPath = "/v1/chat/completions"
	msgs := `"messages":[{"role":"user","content":"hi"}]`

	tests := []struct {
		name   string
		path   string
		body   string
		header map[string]string
		status int
		typ    string
		param  string
		code   string
	}{
		{"malformed JSON", chatPath, `{"model":`, nil, 400, "invalid_request_error", "", "invalid_json"},
		{"body not an object", chatPath, `[1,2]`, nil, 400, "invalid_request_error", "", "invalid_json"},
		{"missing model", chatPath, `{` + msgs + `}`, nil, 400, "invalid_request_error", "model", "missing_required_parameter"},
		{"unknown model", chatPath, `{"model":"gpt-17",` + msgs + `}`, nil, 404, "invalid_request_error", "model", "model_not_found"},
		{"missing messages", chatPath, `{"model":"` + model + `"}`, nil, 400, "invalid_request_error", "messages", "missing_required_parameter"},
		{"empty messages", chatPath, `{"model":"` + model + `","messages":[]}`, nil, 400, "invalid_request_error", "messages", "empty_array"},
		{"messages wrong type", chatPath, `{"model":"` + model + `","messages":"hi"}`, nil, 400, "invalid_request_error", "messages", "invalid_type"},
		{"invalid role", chatPath, `{"model":"` + model + `","messages":[{"role":"wizard","content":"hi"}]}`, nil, 400, "invalid_request_error", "messages[0].role", "invalid_value"},
		{"max_tokens 0", chatPath, `{"model":"` + model + `",` + msgs + `,"max_tokens":0}`, nil, 400, "invalid_request_error", "max_tokens", "invalid_value"},
		{"max_tokens string", chatPath, `{"model":"` + model + `",` + msgs + `,"max_tokens":"5"}`, nil, 400, "invalid_request_error", "max_tokens", "invalid_type"},
		{"n 2", chatPath, `{"model":"` + model + `",` + msgs + `,"n":2}`, nil, 400, "invalid_request_error", "n", "unsupported_value"},
		{"too many stops", chatPath, `{"model":"` + model + `",` + msgs + `,"stop":["a","b","c","d","e"]}`, nil, 400, "invalid_request_error", "stop", "invalid_value"},
		{"stream_options without stream", chatPath, `{"model":"` + model + `",` + msgs + `,"stream_options":{"include_usage":true}}`, nil, 400, "invalid_request_error", "stream_options", "invalid_value"},
		{"tenant header too long", chatPath, `{"model":"` + model + `",` + msgs + `}`, map[string]string{"X-Prefix-Aware-Id": strings.Repeat("t", 65)}, 400, "invalid_request_error", "X-Prefix-Aware-Id", "invalid_value"},
		{"tenant header non-ASCII", chatPath, `{"model":"` + model + `",` + msgs + `}`, map[string]string{"X-Prefix-Aware-Id": "tenänt"}, 400, "invalid_request_error", "X-Prefix-Aware-Id", "invalid_value"},
		{"tenant header control character", chatPath, `{"model":"` + model + `",` + msgs + `}`, map[string]string{"X-Prefix-Aware-Id": "ten\tant"}, 400, "invalid_request_error", "X-Prefix-Aware-Id", "invalid_value"},
		{"tenant header empty", chatPath, `{"model":"` + model + `",` + msgs + `}`, map[string]string{"X-Prefix-Aware-Id": ""}, 400, "invalid_request_error", "X-Prefix-Aware-Id", "invalid_value"},
		{"prompt_cache_key leading space", chatPath, `{"model":"` + model + `",` + msgs + `,"prompt_cache_key":" t"}`, nil, 400, "invalid_request_error", "prompt_cache_key", "invalid_value"},
		{"prompt_cache_key too long", chatPath, `{"model":"` + model + `",` + msgs + `,"prompt_cache_key":"` + strings.Repeat("k", 65) + `"}`, nil, 400, "invalid_request_error", "prompt_cache_key", "invalid_value"},
		{"body over the limit", chatPath, `{"model":"` + model + `","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, nil, 413, "invalid_request_error", "", "request_too_large"},
		{"completion without prompt", "/v1/completions", `{"model":"` + model + `"}`, nil, 400, "invalid_request_error", "prompt", "missing_required_parameter"},
		{"completion token prompt", "/v1/completions", `{"model":"` + model + `","prompt":[1,2,3]}`, nil, 400, "invalid_request_error", "prompt", "invalid_type"},
		{"invocations without messages or prompt", "/invocations", `{"model":"` + model + `"}`, nil, 400, "invalid_request_error", "messages", "missing_required_parameter"},
		{"unknown route", "/v2/chat", `{}`, nil, 404, "not_found_error", "", "unknown_route"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := do(t, hc, http.MethodPost, base+tt.path, tt.body, tt.header)
			if got.status != tt.status {
				t.Errorf("status = %d, want %d (body %s)", got.status, tt.status, got.body)
			}
			if ct := got.header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type = %q, want application/json", ct)
			}
			typ, param, code, msg := decodeError(t, got.body)
			if typ != tt.typ || param != tt.param || code != tt.code {
				t.Errorf("error (type, param, code) = (%q, %q, %q), want (%q, %q, %q)", typ, param, code, tt.typ, tt.param, tt.code)
			}
			if msg == "" {
				t.Error("error message is empty")
			}
			if got.header.Get("X-Baton-Worker") != "" {
				t.Errorf("X-Baton-Worker = %q on a rejected request, want none", got.header.Get("X-Baton-Worker"))
			}
		})
	}

	t.Run("still serving", func(t *testing.T) {
		for _, path := range []string{"/invocations", chatPath} {
			got := do(t, hc, http.MethodPost, base+path, `{"model":"`+model+`",`+msgs+`,"max_tokens":4}`, nil)
			if got.status != http.StatusOK || !strings.Contains(string(got.body), `"choices"`) {
				t.Errorf("POST %s with a valid chat body = %d %s, want 200 with choices", path, got.status, got.body)
			}
		}
		if got := do(t, hc, http.MethodGet, base+"/healthz", "", nil).status; got != http.StatusOK {
			t.Errorf("GET /healthz = %d, want 200", got)
		}
		m := scrapeSettled(t, hc, addr)
		if v, _ := metric(m, "baton_requests_total", `outcome="invalid"`); v < float64(len(tests)-1) {
			t.Errorf(`baton_requests_total{outcome="invalid"} = %v, want >= %d`, v, len(tests)-1)
		}
	})
}

// TestNoWorkerAvailable: when the only worker is unreachable, generation
// requests get a 503 no_worker_available with Retry-After, and /readyz
// turns 503 once health checks mark the worker down.
func TestNoWorkerAvailable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close() // nothing listens there any more
	s, addr := startScheduler(t, scheduler.Config{
		Strategy: "round_robin",
		Workers:  []scheduler.WorkerConfig{{Name: "dead", Address: dead, Models: []string{model}, Role: "both"}},
		Pool:     fastPool(),
	})
	hc := httpClient(t)
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`

	check503 := func(t *testing.T) {
		t.Helper()
		got := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil)
		if got.status != http.StatusServiceUnavailable {
			t.Fatalf("status = %d, want 503 (body %s)", got.status, got.body)
		}
		typ, _, code, msg := decodeError(t, got.body)
		if typ != "server_error" || code != "no_worker_available" || msg == "" {
			t.Errorf("error type %q code %q message %q, want server_error, no_worker_available and a message", typ, code, msg)
		}
		if ra := got.header.Get("Retry-After"); ra == "" {
			t.Error("no Retry-After header on a 503")
		}
		if w := got.header.Get("X-Baton-Worker"); w != "" {
			t.Errorf("X-Baton-Worker = %q on a 503, want none", w)
		}
	}
	t.Run("worker unreachable, still marked healthy", check503)

	eventually(t, 5*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker("dead"); w.Healthy() {
			return fmt.Errorf("worker at %s still healthy", dead)
		}
		return nil
	})
	t.Run("worker marked down", check503)
	if got := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil); got.status != http.StatusServiceUnavailable {
		t.Errorf("GET /readyz = %d, want 503 with no worker available", got.status)
	}
	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_requests_failed_total", `outcome="no_worker"`); v != 2 {
		t.Errorf(`baton_requests_failed_total{outcome="no_worker"} = %v, want 2`, v)
	}
}

// TestRequestTimeout: a request that outlives request_timeout gets a 504
// deadline_exceeded, and the worker's sequence is released.
func TestRequestTimeout(t *testing.T) {
	w := startWorker(t, "slow", 0.05, "127.0.0.1:0", false)
	s, addr := startScheduler(t, scheduler.Config{
		Strategy: "round_robin",
		Config:   frontend.Config{RequestTimeout: 300 * time.Millisecond},
		Workers:  []scheduler.WorkerConfig{{Name: "slow", Address: w.GRPCAddr}},
		Pool:     fastPool(),
	})
	hc := httpClient(t)
	got := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions",
		`{"model":"`+model+`","max_tokens":4000,"messages":[{"role":"user","content":"Tell me a very long story."}]}`, nil)
	if got.status != http.StatusGatewayTimeout {
		t.Fatalf("status = %d, want 504 (body %s)", got.status, got.body)
	}
	if typ, _, code, msg := decodeError(t, got.body); typ != "timeout_error" || code != "deadline_exceeded" || msg == "" {
		t.Errorf("error type %q code %q message %q, want timeout_error, deadline_exceeded and a message", typ, code, msg)
	}
	eventually(t, 2*time.Second, func() error {
		if l := w.Engine.Load(); l.Running != 0 || l.Waiting != 0 {
			return fmt.Errorf("worker still runs the timed-out request: load %+v", l)
		}
		if n := s.Pool.Snapshot().Worker("slow").InFlight(); n != 0 {
			return fmt.Errorf("%d still in flight", n)
		}
		return nil
	})
	if v, _ := metric(scrapeSettled(t, hc, addr), "baton_requests_failed_total", `outcome="timeout"`); v != 1 {
		t.Errorf(`baton_requests_failed_total{outcome="timeout"} = %v, want 1`, v)
	}
}

// gzipped compresses s.
func gzipped(t *testing.T, s string) string {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	if _, err := zw.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestBodyEncodingsAndMethods: a gzip body is decoded (and held to
// max_body_bytes once decoded), other encodings are a 415, and a known
// route called with the wrong method is a 405 naming the right one.
func TestBodyEncodingsAndMethods(t *testing.T) {
	_, workers := startWorkers(t, 1, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "random", Workers: workers, Pool: fastPool(),
		Config: frontend.Config{MaxBodyBytes: 64 << 10}})
	hc := httpClient(t)
	base := "http://" + addr
	chatBody := `{"model":"` + model + `","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	bomb := `{"model":"` + model + `","messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}]}`

	for _, tt := range []struct {
		name, method, path, body string
		header                   map[string]string
		status                   int
		code, allow              string
	}{
		{"gzip body", "POST", "/v1/chat/completions", gzipped(t, chatBody), map[string]string{"Content-Encoding": "gzip"}, 200, "", ""},
		{"identity body", "POST", "/v1/chat/completions", chatBody, map[string]string{"Content-Encoding": "identity"}, 200, "", ""},
		{"gzip over the limit once decoded", "POST", "/v1/chat/completions", gzipped(t, bomb), map[string]string{"Content-Encoding": "gzip"}, 413, "request_too_large", ""},
		{"corrupt gzip", "POST", "/v1/chat/completions", "not gzip at all", map[string]string{"Content-Encoding": "gzip"}, 400, "invalid_body", ""},
		{"brotli", "POST", "/v1/chat/completions", chatBody, map[string]string{"Content-Encoding": "br"}, 415, "unsupported_encoding", ""},
		{"GET on chat", "GET", "/v1/chat/completions", "", nil, 405, "method_not_allowed", "POST"},
		{"GET on invocations", "GET", "/invocations", "", nil, 405, "method_not_allowed", "POST"},
		{"POST on models", "POST", "/v1/models", chatBody, nil, 405, "method_not_allowed", "GET, HEAD"},
		{"unknown route", "GET", "/v2/nothing", "", nil, 404, "unknown_route", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := do(t, hc, tt.method, base+tt.path, tt.body, tt.header)
			if r.status != tt.status {
				t.Fatalf("status %d, want %d: %.300s", r.status, tt.status, r.body)
			}
			if tt.code != "" {
				if _, _, code, _ := decodeError(t, r.body); code != tt.code {
					t.Errorf("code %q, want %q", code, tt.code)
				}
			}
			if got := r.header.Get("Allow"); got != tt.allow {
				t.Errorf("Allow %q, want %q", got, tt.allow)
			}
		})
	}
}

// TestHostileInputLimits: a prompt over max_prompt_tokens is refused with
// OpenAI's context_length_exceeded before any worker sees it, and header
// lines over max_header_bytes get a 431; neither counts against a worker.
func TestHostileInputLimits(t *testing.T) {
	_, workers := startWorkers(t, 1, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "random", Workers: workers, Pool: fastPool(),
		Config: frontend.Config{MaxPromptTokens: 100, MaxHeaderBytes: 8 << 10}})
	hc := httpClient(t)
	url := "http://" + addr + "/v1/chat/completions"
	chatOf := func(chars int) string {
		return `{"model":"` + model + `","max_tokens":4,"messages":[{"role":"user","content":"` + strings.Repeat("x", chars) + `"}]}`
	}
	if r := do(t, hc, "POST", url, chatOf(300), nil); r.status != 200 {
		t.Fatalf("a prompt under the limit: status %d: %.300s", r.status, r.body)
	}
	r := do(t, hc, "POST", url, chatOf(1000), nil)
	if _, _, code, _ := decodeError(t, r.body); r.status != 400 || code != "context_length_exceeded" {
		t.Errorf("a prompt of ~250 tokens over a limit of 100: status %d code %q, want 400 context_length_exceeded", r.status, code)
	}
	r = do(t, hc, "POST", url, chatOf(10), map[string]string{"X-Padding": strings.Repeat("p", 16<<10)})
	if r.status != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("16 KiB of headers over a limit of 8 KiB: status %d, want 431", r.status)
	}
	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_requests_total", `outcome="ok"`); v != 1 {
		t.Errorf("requests that reached a worker: %v, want 1", v)
	}
	if v, _ := metric(m, "baton_breaker_transitions_total"); v != 0 {
		t.Errorf("breaker transitions %v, want 0", v)
	}
}
