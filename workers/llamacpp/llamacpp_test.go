package llamacpp_test

import (
	"context"
	"net/http/httptest"
	"strings"
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
