package llamacpp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/llamacpp"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

func TestWithCachePrompt(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{"model":"m"}`, `{"cache_prompt":true,"model":"m"}`},
		{` { "model":"m"}`, ` {"cache_prompt":true, "model":"m"}`},
		{`{}`, `{"cache_prompt":true}`},
		{`{ }`, `{"cache_prompt":true }`},
		{`{"cache_prompt":false,"model":"m"}`, `{"cache_prompt":false,"model":"m"}`},
		{`{"prompt":"say \"cache_prompt\""}`, `{"cache_prompt":true,"prompt":"say \"cache_prompt\""}`},
		{`[1]`, `[1]`},
		{``, ``},
	}
	for _, tt := range tests {
		if got := string(llamacpp.WithCachePrompt([]byte(tt.in))); got != tt.want {
			t.Errorf("WithCachePrompt(%s) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

// The client asks the server to reuse its cached prompt, which a server
// that does not by default then does, and reads the tokens it reused from
// its timings when its usage does not say.
func TestClientReusesPrompt(t *testing.T) {
	srv := llamatest.Start(t, llamatest.Config{NoUsageDetails: true})
	c, err := llamacpp.New(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	prompt := strings.Repeat("a long shared document. ", 40)
	var got []*engine.Final
	for _, stream := range []bool{false, true} {
		body := `{"model":"model","max_tokens":2,"stream":` + map[bool]string{false: "false", true: "true"}[stream] +
			`,"messages":[{"role":"user","content":"` + prompt + `"}]}`
		rec := httptest.NewRecorder()
		res, err := c.Proxy(context.Background(), &engine.Request{Path: "/v1/chat/completions", Body: []byte(body)}, rec, nil)
		if err != nil {
			t.Fatalf("proxy (stream %v): %v", stream, err)
		}
		got = append(got, res.Usage)
	}
	reqs := srv.Requests()
	if len(reqs) != 2 || !reqs[0].CachePrompt || !reqs[1].CachePrompt {
		t.Fatalf("server saw %+v, want two requests with cache_prompt", reqs)
	}
	if reqs[1].CachedTokens == 0 {
		t.Fatalf("repeated prompt: server reused 0 tokens")
	}
	for i, f := range got {
		if f == nil || f.PromptTokens != reqs[i].PromptTokens || f.CachedTokens != reqs[i].CachedTokens {
			t.Errorf("request %d: usage read %+v, want prompt %d, cached %d", i, f, reqs[i].PromptTokens, reqs[i].CachedTokens)
		}
	}
}

func TestScraper(t *testing.T) {
	for _, noMetrics := range []bool{false, true} {
		srv := llamatest.Start(t, llamatest.Config{Slots: 3, CtxPerSlot: 4096, NoMetrics: noMetrics})
		s, err := llamacpp.NewScraper(srv.URL, "")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		m, err := s.Scrape(ctx)
		cancel()
		if err != nil {
			t.Fatalf("no metrics %v: %v", noMetrics, err)
		}
		if !m.HasLoad || m.Running != 0 || m.Waiting != 0 || m.Slots != 3 || m.KVTokens != 3*4096 {
			t.Errorf("no metrics %v: scraped %+v, want an idle load, 3 slots and %d tokens", noMetrics, m, 3*4096)
		}
	}
	if _, err := llamacpp.NewScraper("10.0.0.1:8080", ""); err == nil {
		t.Error("NewScraper without a scheme: no error")
	}
}

// The scraper reads the busy slots a request holds, from /metrics or
// /slots.
func TestScraperLoad(t *testing.T) {
	for _, noMetrics := range []bool{false, true} {
		srv := llamatest.Start(t, llamatest.Config{Slots: 2, NoMetrics: noMetrics})
		s, _ := llamacpp.NewScraper(srv.URL, "")
		t.Cleanup(func() { s.Close() })
		hold := srv.Hold()
		c, _ := llamacpp.New(srv.URL)
		t.Cleanup(func() { c.Close() })
		done := make(chan struct{})
		go func() {
			defer close(done)
			body := `{"model":"model","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`
			c.Proxy(context.Background(), &engine.Request{Path: "/v1/chat/completions", Body: []byte(body)}, httptest.NewRecorder(), nil)
		}()
		hold.Wait()
		m, err := s.Scrape(context.Background())
		hold.Release()
		<-done
		if err != nil || m.Running != 1 {
			t.Errorf("no metrics %v: scraped %+v, %v during a request; want 1 running", noMetrics, m, err)
		}
	}
}

// proxyChat sends a chat request for model through c and returns the
// generated text.
func proxyChat(t *testing.T, c *llamacpp.Client, model string, stream bool) (string, error) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"max_tokens":2,"stream":%v,"messages":[{"role":"user","content":"hi"}]}`, model, stream)
	rec := httptest.NewRecorder()
	_, err := c.Proxy(context.Background(), &engine.Request{Model: model, Path: "/v1/chat/completions", Body: []byte(body), Stream: stream}, rec, nil)
	if err != nil {
		return "", err
	}
	if !stream {
		var r struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &r); err != nil || len(r.Choices) != 1 {
			t.Fatalf("response %q: %v", rec.Body, err)
		}
		return r.Choices[0].Message.Content, nil
	}
	var text strings.Builder
	for _, line := range strings.Split(rec.Body.String(), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		for _, c := range ch.Choices {
			text.WriteString(c.Delta.Content)
		}
	}
	return text.String(), nil
}

// A server started with adapters gives the base model to a base-model
// request, and an adapter request that adapter alone, whether the server
// applies its adapters by default or not (--lora-init-without-apply), and
// whether the client was told of the adapters or not.
func TestLoRABaseModel(t *testing.T) {
	adapters := []engine.Adapter{{Name: "sql", Base: "model", Source: "/adapters/sql.gguf"},
		{Name: "chat", Base: "model", Source: "/adapters/chat.gguf"}}
	for _, withoutApply := range []bool{false, true} {
		for _, told := range []bool{false, true} {
			srv := llamatest.Start(t, llamatest.Config{LoRA: []string{"/adapters/math.gguf", "/adapters/sql.gguf"}, LoRAInitWithoutApply: withoutApply})
			c, err := llamacpp.New(srv.URL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if told {
				c.ServeAdapters(adapters)
			}
			name := fmt.Sprintf("without apply %v, told %v", withoutApply, told)
			for _, stream := range []bool{false, true} {
				got, err := proxyChat(t, c, "model", stream)
				if err != nil || got != "ok ok " {
					t.Errorf("%s, stream %v: base model answered %q, %v; want %q", name, stream, got, err, "ok ok ")
				}
				reqs := srv.Requests()
				if applied := reqs[len(reqs)-1].Applied; applied != nil {
					t.Errorf("%s, stream %v: base model: server applied %v", name, stream, applied)
				}
				if !told {
					continue
				}
				got, err = proxyChat(t, c, "sql", stream)
				if err != nil || got != "sql sql " {
					t.Errorf("%s, stream %v: sql answered %q, %v; want %q", name, stream, got, err, "sql sql ")
				}
				if _, err := proxyChat(t, c, "chat", stream); !errors.Is(err, engine.ErrUnknownModel) {
					t.Errorf("%s, stream %v: adapter the server does not hold: %v, want ErrUnknownModel", name, stream, err)
				}
			}
		}
	}
}

// Until the client has read which adapters the server holds, it sends it
// nothing: a request waits for the list, and is refused as the server
// being unavailable while the list cannot be read.
func TestLoRAListUnknown(t *testing.T) {
	srv := llamatest.Start(t, llamatest.Config{LoRA: []string{"/adapters/sql.gguf"}, LoRAInitWithoutApply: true})
	target, _ := url.Parse(srv.URL)
	proxy := httputil.NewSingleHostReverseProxy(target)
	var listFails atomic.Bool
	listFails.Store(true)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/lora-adapters" && listFails.Load() {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	c, err := llamacpp.New(front.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := proxyChat(t, c, "model", false); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("adapter list unreadable: %v, want ErrUnavailable", err)
	}
	if n := len(srv.Requests()); n != 0 {
		t.Errorf("adapter list unreadable: server got %d requests", n)
	}
	listFails.Store(false)
	if got, err := proxyChat(t, c, "model", false); err != nil || got != "ok ok " {
		t.Errorf("adapter list readable: base model answered %q, %v; want %q", got, err, "ok ok ")
	}
}
