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
		xs[i] = draw(1000)
		if y := again(1000); y != xs[i] {
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
	if c := (Dispatch{Median: time.Millisecond, P90: time.Millisecond}).sampler(1); c(5000) != 0.001 {
		t.Errorf("median = p90 = 1 ms: drew %v s, want exactly 0.001", c(5000))
	}
	// PerToken adds to every draw, in proportion to the prompt.
	base := d.sampler(3)
	d.PerToken = 100 * time.Nanosecond
	long := d.sampler(3)
	for i := range 1000 {
		if got, want := long(1000), base(1000)+1e-4; math.Abs(got-want) > 1e-12 {
			t.Fatalf("draw %d with PerToken 100ns for 1,000 tokens: %v, want %v", i, got, want)
		}
	}
	if c := (Dispatch{PerToken: time.Microsecond}).sampler(1); c == nil || c(2500) != 0.0025 {
		t.Errorf("PerToken alone, 1 µs for 2,500 tokens: want exactly 2.5 ms")
	}
}

func TestDispatchInvalid(t *testing.T) {
	w := excerpt(t, 1)
	for _, d := range []Dispatch{
		{Median: -time.Millisecond, P90: time.Millisecond},
		{Median: 10 * time.Millisecond, P90: 5 * time.Millisecond},
		{P90: time.Millisecond}, // a p90 without a median is a typo, not "none"
		{Median: time.Millisecond, P90: time.Millisecond, PerToken: -time.Nanosecond},
	} {
		if _, err := Run(t.Context(), Config{Workers: 1, Dispatch: d}, w); err == nil {
			t.Errorf("Dispatch %+v: no error", d)
		}
	}
}
