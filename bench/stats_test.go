package bench

import (
	"math"
	"strings"
	"testing"

	"github.com/batonllm/baton/bench/workload"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestPercentile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3} // sorted 1 2 3 4 5
	for _, tc := range []struct{ p, want float64 }{
		{0, 1}, {50, 3}, {100, 5}, {25, 2}, {90, 4.6}, {99, 4.96}, {10, 1.4},
	} {
		if got := Percentile(xs, tc.p); !near(got, tc.want) {
			t.Errorf("p%v = %v, want %v", tc.p, got, tc.want)
		}
	}
	if xs[0] != 5 {
		t.Error("Percentile sorted its input")
	}
	if !math.IsNaN(Percentile(nil, 50)) {
		t.Error("no samples should give NaN")
	}
	if got := Percentile([]float64{7}, 99); got != 7 {
		t.Errorf("one sample: %v", got)
	}
}

func TestHitRateAndChange(t *testing.T) {
	if got := HitRate(820, 1000); !near(got, 0.82) {
		t.Error(got)
	}
	if HitRate(5, 0) != 0 {
		t.Error("no prompt tokens")
	}
	if got := Change(29, 100); !near(got, -71) {
		t.Error(got)
	}
	if got := Change(115, 100); !near(got, 15) {
		t.Error(got)
	}
	if !math.IsNaN(Change(1, 0)) {
		t.Error("change against 0")
	}
}

func TestBucketQuantile(t *testing.T) {
	bounds := []float64{1, 2, 4, math.Inf(1)}
	cum := []float64{10, 30, 40, 40}                              // 10 in (0,1], 20 in (1,2], 10 in (2,4]
	if got := bucketQuantile(0.5, bounds, cum); !near(got, 1.5) { // rank 20: halfway through (1,2]
		t.Error(got)
	}
	if got := bucketQuantile(0.05, bounds, cum); !near(got, 0.2) {
		t.Error(got)
	}
	if got := bucketQuantile(0.9, bounds, cum); !near(got, 3.2) { // rank 36: 6/10 of the way through (2,4]
		t.Error(got)
	}
}

// blockText is n 64-character blocks, distinct per tag.
func blockText(tag byte, n int) string {
	b := make([]byte, 64*n)
	for i := range b {
		b[i] = 'a' + byte((i/64+int(tag))%26)
	}
	b[0] = tag
	return string(b)
}

func TestLimits(t *testing.T) {
	// Routing text "<|user|>\n" (9) + content + "\n" (1): content of
	// 64·k − 10 characters makes exactly k full blocks = 16k tokens.
	req := func(s string) workload.Request {
		return workload.Request{Messages: []workload.Message{{Role: "user", Content: s}}}
	}
	a := blockText('A', 4)[:4*64-10] // 4 blocks, 64 tokens
	b := blockText('B', 4)[:4*64-10]
	w := &workload.Workload{Requests: []workload.Request{req(a), req(a), req(b), req(a)}}
	// Infinite: misses on first a and first b; the repeats of a hit all
	// but the last token: 63 of 64. Hit = 2·63 / (4·64).
	l := ComputeLimits(w, "m", 4)
	if want := 126.0 / 256; !near(l.Infinite, want) {
		t.Errorf("infinite %v, want %v", l.Infinite, want)
	}
	// A 4-block LRU holds a, then b evicts it: only the second request
	// hits. Hit = 63 / 256.
	if want := 63.0 / 256; !near(l.Pooled, want) {
		t.Errorf("pooled %v, want %v", l.Pooled, want)
	}
	// 8 blocks hold both: pooled equals infinite.
	if l := ComputeLimits(w, "m", 8); !near(l.Pooled, l.Infinite) {
		t.Errorf("pooled %v, infinite %v", l.Pooled, l.Infinite)
	}
}

func TestCalibrate(t *testing.T) {
	w, _ := workload.LongContext(workload.DefaultLongContext(3), 50, 1)
	c, err := Calibrate(w, "llama-3.1-8b", "h100", 7, 0.7, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if c.Prefill < 0.2 || c.Prefill > 0.35 || c.MaxBatch < 30 || c.MaxBatch > 80 {
		t.Errorf("implausible calibration: %s", c)
	}
	if !near(c.Rate, 0.7*7/c.Service) {
		t.Errorf("rate %v", c.Rate)
	}
	if got := expectedOutput(1000); !near(got, (32+255)/2.0) {
		t.Errorf("expected output uncapped %v", got)
	}
	if got := expectedOutput(32); got != 32 {
		t.Errorf("expected output capped %v", got)
	}
}

// The short-prompt hit rate counts only prompts of at most ShortPrompt
// tokens, and is absent (NaN in the table) when there are none.
func TestShortPromptHitRate(t *testing.T) {
	rs := []Result{
		{PromptTokens: 1000, CachedTokens: 500, CompletionTokens: 1, Worker: "a", E2E: 1, Done: 1},
		{PromptTokens: 8000, CachedTokens: 8000, CompletionTokens: 1, Worker: "a", E2E: 1, Done: 2},
	}
	o := &Options{Speedup: 1, Workers: 1}
	r := summarize("x", rs, o, 1, 2)
	if r.ShortPrompts != 1 || r.ShortHitRate != 0.5 || r.HitRate != 8500.0/9000 {
		t.Errorf("short %d at %v, overall %v", r.ShortPrompts, r.ShortHitRate, r.HitRate)
	}
	r = summarize("x", rs[1:], o, 1, 2)
	if r.ShortPrompts != 0 {
		t.Errorf("%d short prompts", r.ShortPrompts)
	}
	var md strings.Builder
	(&Report{Strategies: []StrategyReport{*r}}).Markdown(&md)
	if !strings.Contains(md.String(), "| KV hit rate, prompts ≤ 1,024 tok (%) | – |") {
		t.Errorf("no dash for an absent short-prompt hit rate:\n%s", md.String())
	}
}
