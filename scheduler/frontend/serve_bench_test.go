package frontend

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/httpengine"
)

// cannedEngine answers every request with the stream an OpenAI engine
// sends for a one-token completion, from memory.
type cannedEngine struct{ body []byte }

func (c cannedEngine) RoundTrip(r *http.Request) (*http.Response, error) {
	io.Copy(io.Discard, r.Body)
	r.Body.Close()
	h := http.Header{"Content-Type": {"text/event-stream"}}
	return &http.Response{StatusCode: 200, Header: h, Body: io.NopCloser(bytes.NewReader(c.body)), Request: r}, nil
}

const oneTokenStream = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}

data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"word"},"finish_reason":null}]}

data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}

data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}}

data: [DONE]

`

// BenchmarkServeProxied is the front end's own work for one streamed
// chat completion relayed from an HTTP engine, the engine's answer coming
// from memory: parsing, routing (random), the engine client and the relay,
// metrics. No network.
func BenchmarkServeProxied(b *testing.B) {
	p, err := pool.New(pool.Config{HealthInterval: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	c, err := httpengine.New("http://engine.invalid", httpengine.WithHTTPClient(&http.Client{Transport: cannedEngine{[]byte(oneTokenStream)}}))
	if err != nil {
		b.Fatal(err)
	}
	if err := p.Add(&pool.Worker{Name: "w", Client: c, Models: []string{"m"}}); err != nil {
		b.Fatal(err)
	}
	strategy, err := routing.NewRandom(routing.Params{}, routing.Deps{})
	if err != nil {
		b.Fatal(err)
	}
	srv, err := New(Config{}, p, strategy, metrics.New(p.Snapshot), nil)
	if err != nil {
		b.Fatal(err)
	}
	body := `{"model":"m","stream":true,"max_tokens":1,"messages":[{"role":"user","content":"Round 1: say one word about proxies."}]}`
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, r)
		if w.Code != 200 || !strings.Contains(w.Body.String(), "[DONE]") {
			b.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
}
