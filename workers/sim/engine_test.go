package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
)

const testModel = "llama-3.1-8b"

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1000
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

type result struct {
	text   string
	events []engine.Event
	final  *engine.Final
}

// collect reads st to its end.
func collect(t testing.TB, st engine.Stream) (result, error) {
	t.Helper()
	defer st.Close()
	var r result
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			if r.final == nil {
				t.Errorf("io.EOF before Final")
			}
			return r, nil
		}
		if err != nil {
			return r, err
		}
		if r.final != nil {
			t.Errorf("event after Final: %+v", ev)
		}
		r.events = append(r.events, ev)
		r.text += ev.Text
		r.final = ev.Final
	}
}

func generate(t testing.TB, e *Engine, req *engine.Request) result {
	t.Helper()
	if req.Model == "" {
		req.Model = testModel
	}
	st, err := e.Generate(context.Background(), req)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	r, err := collect(t, st)
	if err != nil {
		t.Fatalf("Recv: %v", err)
	}
	return r
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero Config: %v", err)
	}
	if got := DefaultConfig(); got.Batching.MaxRunning != 256 || got.Batching.MaxBatchedTokens != 8192 || got.Models[0] != testModel {
		t.Errorf("DefaultConfig() = %+v", got)
	}
	tests := []struct {
		name  string
		cfg   Config
		field string
	}{
		{"unknown model", Config{Cost: cost.Config{Model: "gpt-9"}}, "cost.model:"},
		{"unknown gpu", Config{Cost: cost.Config{GPU: "a100"}}, "cost.gpu:"},
		{"empty served model", Config{Models: []string{""}}, "models:"},
		{"duplicate served model", Config{Models: []string{"a", "a"}}, "models:"},
		{"negative tp", Config{Cost: cost.Config{TP: -1}}, "cost.tp:"},
		{"mfu above 1", Config{Cost: cost.Config{MFU: 2}}, "cost.mfu:"},
		{"negative bandwidth efficiency", Config{Cost: cost.Config{BandwidthEfficiency: -0.5}}, "cost.bandwidth_efficiency:"},
		{"negative time scale", Config{TimeScale: -1}, "time_scale:"},
		{"negative capacity", Config{Tiers: Tiers{GPUBlocks: -1}}, "tiers.gpu_blocks:"},
		{"negative max running", Config{Batching: Batching{MaxRunning: -1}}, "batching.max_running:"},
		{"negative budget", Config{Batching: Batching{MaxBatchedTokens: -8}}, "batching.max_batched_tokens:"},
		{"negative default max tokens", Config{DefaultMaxTokens: -1}, "default_max_tokens:"},
		{"negative load interval", Config{LoadInterval: -time.Second}, "load_interval:"},
		{"tiny watch buffer", Config{WatchBuffer: 1}, "watch_buffer:"},
		{"unknown role", Config{Role: "verifier"}, "role:"},
		{"zero kv scale", Config{KVScale: -1}, "kv_scale:"},
		{"negative cpu memory", Config{Tiers: Tiers{CPUMemoryBytes: -1}}, "tiers.cpu_memory_bytes:"},
		{"negative pcie bandwidth", Config{Tiers: Tiers{PCIeBandwidth: -1}}, "tiers.pcie_bandwidth:"},
		{"unknown store policy", Config{Tiers: Tiers{StorePolicy: "never"}}, "tiers.store_policy:"},
		{"negative redis bandwidth", Config{Tiers: Tiers{RedisBandwidth: -1}}, "tiers.redis_bandwidth:"},
		{"negative redis rtt", Config{Tiers: Tiers{RedisRTT: -time.Millisecond}}, "tiers.redis_rtt:"},
		{"negative store timeout", Config{Tiers: Tiers{StoreTimeout: -time.Second}}, "tiers.store_timeout:"},
		{"negative store queue", Config{Tiers: Tiers{StoreQueue: -1}}, "tiers.store_queue:"},
		{"negative transfer timeout", Config{Disagg: Disagg{TransferTimeout: -time.Second}}, "disagg.transfer_timeout:"},
		{"link bandwidth not a number", Config{Disagg: Disagg{LinkBandwidth: math.NaN()}}, "disagg.link_bandwidth:"},
		{"negative warm-up", Config{Warmup: Warmup{TopK: -1}}, "warmup.top_k:"},
		{"no cpu tier, infinitely fast link", Config{Tiers: Tiers{CPUBlocks: -1}, Disagg: Disagg{LinkBandwidth: -1}}, ""},
		{"70b on a fraction of memory", Config{Cost: cost.Config{Model: "llama-3.1-70b", GPU: "h100", TP: 1, MFU: 0.5}}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.field == "" {
				if err != nil {
					t.Errorf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tt.field) {
				t.Errorf("Validate() = %v, want an error naming %q", err, tt.field)
			}
			if _, err := New(tt.cfg); err == nil {
				t.Errorf("New accepted an invalid config")
			}
		})
	}
}

func TestGenerateDeterministic(t *testing.T) {
	e := newEngine(t, Config{})
	prompt := "Tell me a story about a lighthouse keeper."
	a := generate(t, e, &engine.Request{Prompt: prompt})
	b := generate(t, e, &engine.Request{Prompt: prompt})
	if a.text != b.text {
		t.Errorf("equal prompts gave different text:\n%q\n%q", a.text, b.text)
	}
	c := generate(t, e, &engine.Request{Prompt: prompt + "!"})
	if c.text == a.text {
		t.Errorf("different prompts gave equal text %q", a.text)
	}
	f := a.final
	if f.FinishReason != "stop" {
		t.Errorf("finish reason %q, want stop", f.FinishReason)
	}
	if want := blockkey.Tokens(len(prompt)); f.PromptTokens != want {
		t.Errorf("prompt tokens %d, want %d", f.PromptTokens, want)
	}
	if f.CompletionTokens < minNatural || f.CompletionTokens > maxNatural {
		t.Errorf("completion tokens %d outside [%d, %d]", f.CompletionTokens, minNatural, maxNatural)
	}
	if got, want := len(a.text), 4*f.CompletionTokens; got != want {
		t.Errorf("text length %d, want %d (4 characters a token)", got, want)
	}
	tokens := 0
	for _, ev := range a.events {
		tokens += ev.Tokens
	}
	if tokens != f.CompletionTokens {
		t.Errorf("events carry %d tokens, Final says %d", tokens, f.CompletionTokens)
	}
	if a.events[0].Text == "" || a.events[0].Final != nil {
		t.Errorf("first event %+v, want the first token", a.events[0])
	}
}

func TestMaxTokens(t *testing.T) {
	e := newEngine(t, Config{DefaultMaxTokens: 7})
	tests := []struct {
		max  int
		want int
	}{{1, 1}, {5, 5}, {0, 7}}
	for _, tt := range tests {
		r := generate(t, e, &engine.Request{Prompt: "count to ten", MaxTokens: tt.max})
		if r.final.CompletionTokens != tt.want || r.final.FinishReason != "length" {
			t.Errorf("max_tokens %d: %d tokens, %q; want %d, length",
				tt.max, r.final.CompletionTokens, r.final.FinishReason, tt.want)
		}
		if len(r.text) != 4*tt.want {
			t.Errorf("max_tokens %d: text %q", tt.max, r.text)
		}
	}
}

func TestStop(t *testing.T) {
	e := newEngine(t, Config{})
	prompt := "list some words"
	full := generate(t, e, &engine.Request{Prompt: prompt}).text
	// A stop sequence spanning tokens 10 and 11, minus their edges.
	stop := full[41:47]
	cut := strings.Index(full, stop)
	tests := []struct {
		name   string
		stop   []string
		want   string
		reason string
	}{
		{"spanning tokens", []string{stop}, full[:cut], "stop"},
		{"never occurs", []string{"zzzz"}, full, "stop"},
		{"earliest of several", []string{"zzzz", stop, full[cut+2:]}, full[:cut], "stop"},
		{"empty ignored", []string{""}, full, "stop"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := generate(t, e, &engine.Request{Prompt: prompt, Stop: tt.stop})
			if r.text != tt.want {
				t.Errorf("text %q, want %q", r.text, tt.want)
			}
			if r.final.FinishReason != tt.reason {
				t.Errorf("finish %q, want %q", r.final.FinishReason, tt.reason)
			}
		})
	}
	r := generate(t, e, &engine.Request{Prompt: prompt, Stop: []string{stop}, MaxTokens: 3})
	if r.text != full[:12] || r.final.FinishReason != "length" {
		t.Errorf("stop beyond max_tokens: %q, %q; want %q, length", r.text, r.final.FinishReason, full[:12])
	}
}

func TestCachedTokens(t *testing.T) {
	e := newEngine(t, Config{})
	system := strings.Repeat("You are a helpful assistant. ", 50) // 1,450 characters
	first := generate(t, e, &engine.Request{Prompt: system + "Question one?"})
	second := generate(t, e, &engine.Request{Prompt: system + "Question two?"})
	other := generate(t, e, &engine.Request{Prompt: system + "Question two?", Tenant: "other"})
	again := generate(t, e, &engine.Request{Prompt: system + "Question two?"})
	if got := first.final.CachedTokens; got != 0 {
		t.Errorf("first request cached %d tokens, want 0", got)
	}
	shared := (len(system) / 64) * BlockTokens
	if got := second.final.CachedTokens; got != shared {
		t.Errorf("second request cached %d tokens, want %d (the shared full blocks)", got, shared)
	}
	if got := other.final.CachedTokens; got != 0 {
		t.Errorf("another tenant cached %d tokens, want 0", got)
	}
	if got, want := again.final.CachedTokens, blockkey.Tokens(len(system)+13)/BlockTokens*BlockTokens; got != want {
		t.Errorf("repeated request cached %d tokens, want %d (every full block)", got, want)
	}
	// An exact repeat of a prompt of whole blocks still computes one token.
	whole := strings.Repeat("abcd", 64)
	generate(t, e, &engine.Request{Prompt: whole})
	if got := generate(t, e, &engine.Request{Prompt: whole}).final.CachedTokens; got != 63 {
		t.Errorf("repeat of a 4-block prompt cached %d, want 63", got)
	}
}

func TestGenerateErrors(t *testing.T) {
	e := newEngine(t, Config{Models: []string{"a", "b"}, Tiers: Tiers{GPUBlocks: 10}})
	tests := []struct {
		name string
		req  engine.Request
		want error
	}{
		{"unknown model", engine.Request{Model: "c", Prompt: "hi"}, ErrUnknownModel},
		{"no model", engine.Request{Prompt: "hi"}, ErrUnknownModel},
		{"empty prompt", engine.Request{Model: "a"}, ErrInvalid},
		{"negative max tokens", engine.Request{Model: "a", Prompt: "hi", MaxTokens: -1}, ErrInvalid},
		{"larger than the cache", engine.Request{Model: "b", Prompt: strings.Repeat("x", 64*11)}, ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := e.Generate(context.Background(), &tt.req); !errors.Is(err, tt.want) {
				t.Errorf("Generate() error = %v, want %v", err, tt.want)
			}
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := e.Generate(ctx, &engine.Request{Model: "a", Prompt: "hi"}); !errors.Is(err, context.Canceled) {
		t.Errorf("Generate(cancelled ctx) error = %v, want context.Canceled", err)
	}
}

func TestContinuousBatching(t *testing.T) {
	// A small cache forces admission to wait for blocks and to evict.
	e := newEngine(t, Config{Tiers: Tiers{GPUBlocks: 400}, Batching: Batching{MaxRunning: 32}})
	const n = 100
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			prompt := fmt.Sprintf("%s request %d", strings.Repeat("shared system prompt ", 10+i%7), i)
			st, err := e.Generate(context.Background(), &engine.Request{Model: testModel, Prompt: prompt})
			if err != nil {
				errs <- err
				return
			}
			r, err := collect(t, st)
			if err != nil {
				errs <- err
				return
			}
			if r.final == nil || r.final.CompletionTokens == 0 {
				errs <- fmt.Errorf("request %d: final %+v", i, r.final)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	s := e.Stats()
	if s.MaxBatch < 2 || s.MaxBatch > 32 {
		t.Errorf("largest batch %d, want in [2, 32]", s.MaxBatch)
	}
	t.Logf("%d requests in %d steps, %.2f modelled s, largest batch %d", n, s.Steps, s.ModelledSeconds, s.MaxBatch)
	waitIdle(t, e)
}

func TestDecodeStepGrowsWithBatch(t *testing.T) {
	// Modelled seconds per decode step of one 2,000-token sequence alone,
	// then of 64 at once: each step reads every sequence's KV cache.
	perStep := func(n int) float64 {
		// A first step (a 2,000-token prefill) of about 6 ms of real
		// time, for the others to queue while it runs.
		e := newEngine(t, Config{TimeScale: 10})
		var streams []engine.Stream
		for i := range n { // queued together: admitted within a step or two
			prompt := fmt.Sprintf("%d %s", i, strings.Repeat("context ", 1000))
			st, err := e.Generate(context.Background(), &engine.Request{Model: testModel, Prompt: prompt, MaxTokens: 32})
			if err != nil {
				t.Fatal(err)
			}
			streams = append(streams, st)
		}
		for _, st := range streams {
			if _, err := collect(t, st); err != nil {
				t.Fatal(err)
			}
		}
		s := e.Stats()
		if s.DecodeSteps == 0 {
			t.Fatalf("no decode-only step: %+v", s)
		}
		return s.DecodeSeconds / float64(s.DecodeSteps)
	}
	one, many := perStep(1), perStep(64)
	t.Logf("modelled step: %.2f ms alone, %.2f ms with 64 requests", one*1e3, many*1e3)
	if !(many > 1.5*one) {
		t.Errorf("step with 64 requests %.3f ms, want longer than alone %.3f ms", many*1e3, one*1e3)
	}
}

func TestChunkedPrefill(t *testing.T) {
	e := newEngine(t, Config{Batching: Batching{MaxBatchedTokens: 64}})
	prompt := strings.Repeat("long document text ", 200) // 950 tokens
	r := generate(t, e, &engine.Request{Prompt: prompt, MaxTokens: 2})
	if r.final.CompletionTokens != 2 {
		t.Fatalf("final %+v", r.final)
	}
	if s := e.Stats(); s.Steps < 950/64 {
		t.Errorf("%d steps, want at least %d prefill chunks", s.Steps, 950/64)
	}
}

// waitIdle waits until nothing runs and no block is in use.
func waitIdle(t *testing.T, e *Engine) {
	t.Helper()
	waitFor(t, "the engine to be idle", func() bool {
		l := e.Load()
		return l.Running == 0 && l.Waiting == 0 && l.BlocksUsed == 0
	})
}

func TestCancelFreesBlocks(t *testing.T) {
	for _, how := range []string{"context", "close"} {
		t.Run(how, func(t *testing.T) {
			e := newEngine(t, Config{TimeScale: 1})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			prompt := strings.Repeat("cancel me ", 100)
			st, err := e.Generate(ctx, &engine.Request{Model: testModel, Prompt: prompt, MaxTokens: 1000})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Recv(); err != nil {
				t.Fatalf("first Recv: %v", err)
			}
			if l := e.Load(); l.Running != 1 || l.BlocksUsed == 0 {
				t.Errorf("load while running %+v, want 1 running with blocks", l)
			}
			var want error
			if how == "context" {
				cancel()
				want = context.Canceled
			} else {
				st.Close()
				want = errStreamClosed
			}
			if _, err := collect(t, st); !errors.Is(err, want) {
				t.Errorf("Recv after cancel = %v, want %v", err, want)
			}
			waitIdle(t, e)
			// The prompt's blocks stay cached for the next request.
			keys := blockkey.Append(nil, blockkey.Seed(testModel, ""), prompt, 64)
			if got := e.Cache().Lookup(keys); got != len(keys) {
				t.Errorf("%d of %d prompt blocks cached after cancel", got, len(keys))
			}
		})
	}
}

func TestCloseFailsOutstanding(t *testing.T) {
	e, err := New(Config{TimeScale: 1, Batching: Batching{MaxRunning: 2}})
	if err != nil {
		t.Fatal(err)
	}
	var streams []engine.Stream
	for i := range 4 { // two run, two wait
		st, err := e.Generate(context.Background(), &engine.Request{Model: testModel, Prompt: fmt.Sprint("p", i)})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
	}
	if _, err := streams[0].Recv(); err != nil {
		t.Fatalf("first token: %v", err)
	}
	e.Close()
	e.Close() // idempotent
	for i, st := range streams {
		if _, err := collect(t, st); !errors.Is(err, ErrClosed) || !errors.Is(err, engine.ErrUnavailable) {
			t.Errorf("stream %d: %v, want ErrClosed", i, err)
		}
	}
	if _, err := e.Generate(context.Background(), &engine.Request{Model: testModel, Prompt: "late"}); !errors.Is(err, ErrClosed) {
		t.Errorf("Generate after Close: %v, want ErrClosed", err)
	}
	if _, err := e.Subscribe(); !errors.Is(err, ErrClosed) {
		t.Errorf("Subscribe after Close: %v, want ErrClosed", err)
	}
}
