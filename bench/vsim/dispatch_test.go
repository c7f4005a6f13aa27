package vsim

import (
	"math"
	"slices"
	"testing"
	"time"
)

// A request's first call from the coordinator to an engine reaches the
// engine's queue a dispatch delay after the decision, colocated or
// disaggregated (the prefill); the decode call that follows a remote
// prefill is not delayed. Before Dispatch, the virtual clock handed a
// request to its engine the instant it was routed.
func TestDispatchDelaysTheFirstCall(t *testing.T) {
	w := excerpt(t, 1)
	const d = 40 * time.Millisecond
	for _, tc := range []struct {
		c       Config
		prefill string // the remote prefill's worker
	}{
		{Config{Workers: 1, Strategy: "kv_aware"}, ""},
		{Config{Prefill: 1, Decode: 1, Strategy: "kv_aware"}, "prefill-0"},
	} {
		t.Run(tc.c.Label(), func(t *testing.T) {
			base := run(t, tc.c, w).Requests[0]
			tc.c.dispatchOf = func(int) time.Duration { return d }
			got := run(t, tc.c, w).Requests[0]
			want := base.TTFT + d.Seconds()
			if math.Abs(got.TTFT-want) > 1e-9 {
				t.Errorf("TTFT %.6f s with a %v dispatch delay, want %.6f (%.6f without)", got.TTFT, d, want, base.TTFT)
			}
			if got.PrefillWorker != tc.prefill {
				t.Errorf("prefill worker %q, want %q", got.PrefillWorker, tc.prefill)
			}
		})
	}
}

// Requests that arrive together reach the engine in the order their calls
// arrive, not the order they were routed in: the first of two
// simultaneous requests, delayed, queues behind the second.
func TestDispatchReordersSimultaneousArrivals(t *testing.T) {
	w := excerpt(t, 2)
	if w.Requests[0].At != w.Requests[1].At {
		t.Fatalf("the excerpt's first two requests arrive at %v and %v, want together", w.Requests[0].At, w.Requests[1].At)
	}
	c := Config{Workers: 1, Strategy: "random"}
	res := run(t, c, w).Requests
	if !(res[0].TTFT < res[1].TTFT) {
		t.Fatalf("without dispatch delays: TTFTs %.3f, %.3f s; want the first routed served first", res[0].TTFT, res[1].TTFT)
	}
	c.dispatchOf = func(i int) time.Duration { return time.Duration(1-i) * 30 * time.Millisecond }
	res = run(t, c, w).Requests
	if !(res[1].TTFT < res[0].TTFT-0.03) {
		t.Errorf("first request's call 30 ms late: TTFTs %.3f, %.3f s; want the second served first", res[0].TTFT, res[1].TTFT)
	}
}

// Dispatch's draws have the median and 90th percentile asked for, and
// repeat under a seed.
func TestDispatchDistribution(t *testing.T) {
	d := Dispatch{Median: 7 * time.Millisecond, P90: 48 * time.Millisecond}
	draw, again := d.sampler(3), d.sampler(3)
	xs := make([]float64, 20000)
	for i := range xs {
		xs[i] = draw()
		if y := again(); y != xs[i] {
			t.Fatalf("draw %d: %v, then %v under the same seed", i, xs[i], y)
		}
	}
	slices.Sort(xs)
	for _, q := range []struct {
		name      string
		got, want float64
	}{
		{"median", xs[len(xs)/2], d.Median.Seconds()},
		{"p90", xs[len(xs)*9/10], d.P90.Seconds()},
	} {
		if math.Abs(q.got/q.want-1) > 0.06 {
			t.Errorf("%s %.2f ms, want %.2f ms ±6%%", q.name, q.got*1e3, q.want*1e3)
		}
	}
	if (Dispatch{}).sampler(1) != nil {
		t.Error("the zero Dispatch draws delays")
	}
	if c := (Dispatch{Median: time.Millisecond, P90: time.Millisecond}).sampler(1); c() != 0.001 {
		t.Errorf("median = p90 = 1 ms: drew %v s, want exactly 0.001", c())
	}
}

// With PerToken, a request is routed once its prompt is read and hashed:
// of simultaneous arrivals the shorter prompt is routed, and served,
// first; its time to first token counts from its arrival.
func TestDispatchPerTokenRoutesShortPromptsFirst(t *testing.T) {
	w := excerpt(t, 3)
	r := w.Requests
	if r[1].At != r[2].At {
		t.Fatalf("the excerpt's requests 1 and 2 arrive at %v and %v, want together", r[1].At, r[2].At)
	}
	c := Config{Workers: 1, Strategy: "random"}
	res := run(t, c, w).Requests
	if res[1].PromptTokens <= res[2].PromptTokens || !(res[1].TTFT < res[2].TTFT) {
		t.Fatalf("without PerToken: prompts %d, %d tokens, TTFTs %.3f, %.3f s; want the longer first, served first",
			res[1].PromptTokens, res[2].PromptTokens, res[1].TTFT, res[2].TTFT)
	}
	c.Dispatch = Dispatch{PerToken: time.Millisecond}
	got := run(t, c, w).Requests
	if !(got[2].TTFT < got[1].TTFT) {
		t.Errorf("PerToken 1 ms: TTFTs %.3f, %.3f s; want the shorter prompt (request 2) served first", got[1].TTFT, got[2].TTFT)
	}
	if parse := float64(got[0].PromptTokens) * 1e-3; got[0].TTFT < res[0].TTFT+parse-1e-9 {
		t.Errorf("request 0: TTFT %.3f s with PerToken, %.3f without; want at least its %.3f s of reading", got[0].TTFT, res[0].TTFT, parse)
	}
}

func TestDispatchInvalid(t *testing.T) {
	w := excerpt(t, 1)
	for _, d := range []Dispatch{
		{Median: -time.Millisecond, P90: time.Millisecond},
		{Median: 10 * time.Millisecond, P90: 5 * time.Millisecond},
		{P90: time.Millisecond}, // a p90 without a median is a typo, not "none"
		{Median: time.Millisecond, P90: time.Millisecond, PerToken: -time.Nanosecond},
		{Spacing: -time.Millisecond},
	} {
		if _, err := Run(t.Context(), Config{Workers: 1, Dispatch: d}, w); err == nil {
			t.Errorf("Dispatch %+v: no error", d)
		}
	}
}

// With Spacing, requests that arrive together are taken up one after
// another, in an order drawn from the seed: on two workers of their own,
// one of two simultaneous requests starts Spacing after the other, its time
// to first token counted from its arrival; which one goes first changes
// with the seed and not with the trace's order alone.
func TestDispatchSpacing(t *testing.T) {
	w := excerpt(t, 2)
	c := Config{Workers: 2, Strategy: "round_robin"}
	base := run(t, c, w).Requests
	if base[0].Worker == base[1].Worker {
		t.Fatalf("round_robin sent both requests to %s", base[0].Worker)
	}
	const sp = 50 * time.Millisecond
	c.Dispatch = Dispatch{Spacing: sp}
	var delayed [2]int
	for seed := uint64(1); seed <= 16; seed++ {
		c.Seed = seed
		got := run(t, c, w).Requests
		d := []float64{got[0].TTFT - base[0].TTFT, got[1].TTFT - base[1].TTFT}
		switch {
		case math.Abs(d[0]) < 1e-9 && math.Abs(d[1]-sp.Seconds()) < 1e-9:
			delayed[1]++
		case math.Abs(d[1]) < 1e-9 && math.Abs(d[0]-sp.Seconds()) < 1e-9:
			delayed[0]++
		default:
			t.Fatalf("seed %d: TTFTs %.4f, %.4f s with a %v spacing, want one of %.4f, %.4f delayed by it",
				seed, got[0].TTFT, got[1].TTFT, sp, base[0].TTFT, base[1].TTFT)
		}
		if again := run(t, c, w).Requests; again[0].TTFT != got[0].TTFT || again[1].TTFT != got[1].TTFT {
			t.Fatalf("seed %d: two runs differ", seed)
		}
	}
	if delayed[0] == 0 || delayed[1] == 0 {
		t.Errorf("over 16 seeds the first request was taken up second %d times, the second %d times; want both orders", delayed[0], delayed[1])
	}
}
