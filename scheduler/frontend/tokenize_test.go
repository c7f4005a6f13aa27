package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/openai"
	"github.com/batonllm/baton/workers/sim"
	"github.com/batonllm/baton/workers/vllm"
)

func TestTokenCacheEvictsLeastRecent(t *testing.T) {
	c := newTokenCache(10)
	c.add(1, make([]uint32, 4))
	c.add(2, make([]uint32, 4))
	c.get(1)                    // 2 is now the least recent
	c.add(3, make([]uint32, 4)) // 12 tokens: 2 goes
	c.add(4, make([]uint32, 11))
	for key, want := range map[uint64]bool{1: true, 2: false, 3: true, 4: false} {
		if _, ok := c.get(key); ok != want {
			t.Errorf("cache has %d: %v, want %v", key, ok, want)
		}
	}
	if c.size != 8 {
		t.Errorf("cache holds %d tokens, want 8", c.size)
	}
}

// countingTokenizer wraps a Tokenizer and counts its calls.
type countingTokenizer struct {
	Tokenizer
	calls int
	err   error
}

func (c *countingTokenizer) Tokenize(ctx context.Context, req *engine.Request) ([]uint32, error) {
	c.calls++
	if c.err != nil {
		return nil, c.err
	}
	return c.Tokenizer.Tokenize(ctx, req)
}

// TestTokenKeysSalted: keys are kvevents' chained keys of the tokens,
// salted with the engine's model, the adapter asked for and cache_salt.
func TestTokenKeysSalted(t *testing.T) {
	text := strings.Repeat("abcd", 40) // 40 tokens at 4 characters
	toks, _ := sim.Tokenizer{}.Tokenize(context.Background(), &engine.Request{Prompt: text})
	for _, c := range []struct {
		name, model, body string
		salt              string
	}{
		{"base model", "m", `{}`, blockkey.Salt("m", "", "")},
		{"adapter", "lora-1", `{}`, blockkey.Salt("m", "lora-1", "")},
		{"cache salt", "m", `{"cache_salt":"t1"}`, blockkey.Salt("m", "", "t1")},
	} {
		t.Run(c.name, func(t *testing.T) {
			tk := newTokenizer(TokenKeys{
				Tokenizer: sim.Tokenizer{}, BlockSize: func() int { return 16 }, Model: func() string { return "m" },
			}, metrics.New(), slog.New(slog.DiscardHandler))
			var rreq routing.Request
			if !tk.keys(context.Background(), &engine.Request{Model: c.model, Prompt: text, Body: []byte(c.body)}, &rreq) {
				t.Fatal("no token keys")
			}
			want := blockkey.AppendTokens(nil, blockkey.TokenSeed(c.salt), toks, 16)
			if !slices.Equal(rreq.Keys, want) || len(want) != 2 || rreq.Tokens != 40 {
				t.Errorf("keys %x, tokens %d; want %x, 40", rreq.Keys, rreq.Tokens, want)
			}
		})
	}
}

// TestTokenKeysFallBack: without tokens there are no token keys, and a
// failure is not cached.
func TestTokenKeysFallBack(t *testing.T) {
	ct := &countingTokenizer{Tokenizer: sim.Tokenizer{}, err: fmt.Errorf("engine down")}
	tk := newTokenizer(TokenKeys{Tokenizer: ct, BlockSize: func() int { return 16 }, Model: func() string { return "m" }},
		metrics.New(), slog.New(slog.DiscardHandler))
	req := &engine.Request{Model: "m", Prompt: strings.Repeat("x", 200)}
	var rreq routing.Request
	for range 2 {
		if tk.keys(context.Background(), req, &rreq) {
			t.Fatal("token keys from a failing tokenizer")
		}
	}
	ct.err = nil
	for range 2 {
		if !tk.keys(context.Background(), req, &rreq) {
			t.Fatal("no token keys once the tokenizer works")
		}
	}
	if ct.calls != 3 {
		t.Errorf("tokenizer called %d times, want 3 (two failures, then one miss cached)", ct.calls)
	}
}

// benchPrompt returns a chat request of about n tokens at 4 characters a
// token.
func benchPrompt(n int) *engine.Request {
	var b strings.Builder
	for i := 0; b.Len() < 4*n; i++ {
		fmt.Fprintf(&b, "w%06d ", i)
	}
	text := b.String()[:4*n]
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": text}}})
	return &engine.Request{Model: "m", Path: openai.ChatPath, Body: body, Prompt: "user\n" + text}
}

// fakeTokenizeServer answers every /tokenize with n tokens, as vLLM would.
func fakeTokenizeServer(b *testing.B, n int) *httptest.Server {
	toks := make([]int, n)
	for i := range toks {
		toks[i] = 1000 + i*37%150000
	}
	resp, _ := json.Marshal(map[string]any{"count": n, "max_model_len": 131072, "tokens": toks})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Write(resp)
	}))
	b.Cleanup(srv.Close)
	return srv
}

// BenchmarkTokenKeys8000 measures what keying an 8,000-token prompt by
// tokens adds to a routing decision: tokens from the cache, from the
// engine's /tokenize (an in-process HTTP fake, no cache), and from the
// simulated engine's in-process tokenizer; then the keys. p99-ns is the
// 99th percentile of one op.
func BenchmarkTokenKeys8000(b *testing.B) {
	const n = 8000
	req := benchPrompt(n)
	httpTok, err := vllm.NewTokenizer(fakeTokenizeServer(b, n).URL, "")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { httpTok.Close() })
	for _, c := range []struct {
		name  string
		tok   Tokenizer
		cache int
	}{
		{"hit", httpTok, 0},
		{"miss-http", httpTok, -1},
		{"sim", sim.Tokenizer{}, -1},
	} {
		b.Run(c.name, func(b *testing.B) {
			tk := newTokenizer(TokenKeys{
				Tokenizer: c.tok, BlockSize: func() int { return 16 }, Model: func() string { return "m" }, CacheTokens: c.cache,
			}, metrics.New(), slog.New(slog.DiscardHandler))
			ctx := context.Background()
			var rreq routing.Request
			if !tk.keys(ctx, req, &rreq) || len(rreq.Keys) != n/16 {
				b.Fatalf("%d keys, want %d", len(rreq.Keys), n/16)
			}
			took := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				tk.keys(ctx, req, &rreq)
				took = append(took, time.Since(t0))
			}
			b.StopTimer()
			slices.Sort(took)
			b.ReportMetric(float64(took[len(took)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}

// A tenant reaches the engine as cache_salt: where the body has none, or
// over the body's own when the tenant is bound to the caller's key.
func TestWithCacheSalt(t *testing.T) {
	for _, tt := range []struct {
		body  string
		force bool
		want  string // the cache_salt sent; "" when the body is unchanged
	}{
		{`{"model":"m","messages":[]}`, false, "t"},
		{`{"model":"m","cache_salt":"own"}`, false, "own"},
		{`{"model":"m","cache_salt":"own"}`, true, "t"},
		{`["not an object"]`, true, ""},
		{`null`, true, ""},
	} {
		got := withCacheSalt([]byte(tt.body), "t", tt.force)
		if tt.want == "" {
			if string(got) != tt.body {
				t.Errorf("%s: rewritten as %s", tt.body, got)
			}
			continue
		}
		if salt := cacheSalt(got); salt != tt.want {
			t.Errorf("%s (force %t): cache_salt %q, want %q", tt.body, tt.force, salt, tt.want)
		}
		if !bytes.Contains(got, []byte(`"model":"m"`)) {
			t.Errorf("%s: the rest of the body was lost: %s", tt.body, got)
		}
	}
}

// gatedTokenizer counts its calls and answers once gate is closed.
type gatedTokenizer struct {
	Tokenizer
	gate  chan struct{}
	calls atomic.Int32
}

func (g *gatedTokenizer) Tokenize(ctx context.Context, req *engine.Request) ([]uint32, error) {
	g.calls.Add(1)
	select {
	case <-g.gate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.Tokenizer.Tokenize(ctx, req)
}

// TestTokenizeMergesConcurrentMisses: a burst of one new prompt asks the
// engine once, and every request of the burst gets its tokens, even when
// the one whose call it is goes away.
func TestTokenizeMergesConcurrentMisses(t *testing.T) {
	synctest.Test(t, testTokenizeMergesConcurrentMisses)
}

func testTokenizeMergesConcurrentMisses(t *testing.T) {
	g := &gatedTokenizer{Tokenizer: sim.Tokenizer{}, gate: make(chan struct{})}
	m := metrics.New()
	tk := newTokenizer(TokenKeys{Tokenizer: g, BlockSize: func() int { return 16 }, Model: func() string { return "m" }},
		m, slog.New(slog.DiscardHandler))
	req := &engine.Request{Model: "m", Prompt: strings.Repeat("sibling ", 100)}
	gone, cancel := context.WithCancel(context.Background())
	const n = 8
	var wg sync.WaitGroup
	got := make([]bool, n)
	for i := range n {
		ctx := context.Background()
		if i == 0 {
			ctx = gone
		}
		wg.Go(func() {
			var rreq routing.Request
			got[i] = tk.keys(ctx, req, &rreq) && rreq.Tokens == 200
		})
	}
	// Every request waits on the one call; the first caller leaves.
	synctest.Wait()
	if c := g.calls.Load(); c != 1 {
		t.Errorf("%d tokenizer calls for one prompt, want 1", c)
	}
	cancel()
	close(g.gate)
	wg.Wait()
	for i, ok := range got {
		if !ok {
			t.Errorf("request %d got no token keys", i)
		}
	}
}
