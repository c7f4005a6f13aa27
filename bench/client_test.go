package bench

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/bench/workload"
)

// send reads what the scheduler says of a request in its headers (the
// worker, the prefill worker, the route) and its stream's tokens and
// usage.
func TestSendReadsHeadersAndStream(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("X-Baton-Worker", "decode-1")
		h.Set("X-Baton-Prefill-Worker", "prefill-0")
		h.Set("X-Baton-Route", "kv_aware; predicted_hit=0.50; spill=true")
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n")
		io.WriteString(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	var res Result
	send(context.Background(), srv.Client(), srv.URL, "m", &workload.Request{Messages: []workload.Message{{Role: "user", Content: "hi"}}, MaxTokens: 2}, &res)
	if res.Err != "" {
		t.Fatal(res.Err)
	}
	if res.Worker != "decode-1" || res.PrefillWorker != "prefill-0" || !res.Spill || res.Route == "" {
		t.Errorf("worker %q, prefill worker %q, spill %t, route %q; want decode-1, prefill-0, a spill", res.Worker, res.PrefillWorker, res.Spill, res.Route)
	}
	if res.TTFT <= 0 || len(res.Gaps) != 1 || res.PromptTokens != 40 || res.CompletionTokens != 2 || res.CachedTokens != 32 {
		t.Errorf("TTFT %v, gaps %v, tokens %d/%d/%d; want a TTFT, one gap, 40 prompt (32 cached), 2 completion",
			res.TTFT, res.Gaps, res.PromptTokens, res.CachedTokens, res.CompletionTokens)
	}
}

// send leaves its connection to the next request: a stream's body read up
// to [DONE] and closed before the server's end of the response would cost
// the connection, and the server a new one (and its goroutine a new
// stack) per request. The server here ends each response a moment after
// [DONE], so that the end never comes with it.
func TestSendReusesTheConnection(t *testing.T) {
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		time.Sleep(20 * time.Millisecond)
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	hc := srv.Client()
	const requests = 5
	for range requests {
		var res Result
		send(context.Background(), hc, srv.URL, "m", &workload.Request{Messages: []workload.Message{{Role: "user", Content: "hi"}}, MaxTokens: 1}, &res)
		if res.Err != "" {
			t.Fatal(res.Err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d requests in turn opened %d connections, want 1", requests, n)
	}
}
