package bench

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/bench/workload"
)

// A short bench run: 2 workers, 20 requests over 3 documents at a high
// speedup. The latency figures are not checked (the CPU is shared); the
// bookkeeping is.
func TestBenchEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	w, err := workload.LongContext(workload.DefaultLongContext(3), 20, 42)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Strategies: []string{"random", "prefix_aware"}, Workers: 2, Speedup: 20, Rate: 2, Seed: 42}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, o, w)
	if err != nil {
		t.Fatal(err)
	}
	lim := ComputeLimits(w, "llama-3.1-8b", 2*29000)
	rep.Limits = &lim
	if len(rep.Strategies) != 2 {
		t.Fatalf("%d strategy reports", len(rep.Strategies))
	}
	for _, s := range rep.Strategies {
		if s.Requests != 20 || s.OK+s.Errors != 20 {
			t.Errorf("%s: %d sent, %d ok, %d errors; want 20 sent", s.Strategy, s.Requests, s.OK, s.Errors)
		}
		if s.Errors != 0 {
			t.Errorf("%s: errors: %s", s.Strategy, s.ErrorSample)
		}
		sum := 0.0
		for _, v := range s.Shares {
			sum += v
		}
		if math.Abs(sum-1) > 1e-9 {
			t.Errorf("%s: shares sum to %v", s.Strategy, sum)
		}
		if len(s.Shares) > 2 || s.MinShare > s.MaxShare || s.Ideal != 0.5 {
			t.Errorf("%s: shares %v min %v max %v ideal %v", s.Strategy, s.Shares, s.MinShare, s.MaxShare, s.Ideal)
		}
		if s.HitRate < 0 || s.HitRate > 1 || s.PromptTokens <= 0 {
			t.Errorf("%s: hit rate %v over %d prompt tokens", s.Strategy, s.HitRate, s.PromptTokens)
		}
		if s.HitRate > lim.Infinite+1e-9 || s.HitRate > lim.Belady+1e-9 {
			t.Errorf("%s: hit rate %v above a bound: infinite cache %v, MIN %v", s.Strategy, s.HitRate, lim.Infinite, lim.Belady)
		}
		if !(s.TTFT.P50 > 0 && s.TTFT.P50 <= s.TTFT.P90 && s.TTFT.P90 <= s.TTFT.P99 && s.E2E.P50 >= s.TTFT.P50) {
			t.Errorf("%s: latencies out of order: ttft %+v e2e %+v", s.Strategy, s.TTFT, s.E2E)
		}
		if s.RequestsPerSec <= 0 || s.OutputTokPerSec <= 0 {
			t.Errorf("%s: throughput %v req/s %v tok/s", s.Strategy, s.RequestsPerSec, s.OutputTokPerSec)
		}
	}
	random, prefix := rep.Strategies[0], rep.Strategies[1]
	// At this load no worker nears the threshold, unless the machine could
	// not keep the simulated engines' pace: then requests pile up in wall
	// time, and a spill says nothing of the router. Without a spill every
	// request of a document goes where it is cached, so prefix_aware's
	// hit rate is at least random's; a spill sends a document to the
	// worker without it, and with three documents on two workers random's
	// luck may then beat it by a request.
	switch {
	case prefix.Spills == 0:
		if prefix.HitRate < random.HitRate {
			t.Errorf("prefix_aware hit rate %v below random's %v", prefix.HitRate, random.HitRate)
		}
	case prefix.CPUStretch > 1.15:
		t.Logf("prefix_aware spilled %d times, the engines CPU-bound (stretch %.2f); hit rate %v, random's %v",
			prefix.Spills, prefix.CPUStretch, prefix.HitRate, random.HitRate)
	default:
		t.Errorf("prefix_aware spilled %d times at this load (stretch %.2f)", prefix.Spills, prefix.CPUStretch)
	}
	dir := t.TempDir()
	rep.PerRequest = true
	files, err := rep.WriteFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 7 {
		t.Errorf("wrote %v", files)
	}
	// requests.jsonl: every request of each column, with its worker and
	// the route the scheduler gave.
	b, err := os.ReadFile(filepath.Join(dir, "requests.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 40 {
		t.Fatalf("requests.jsonl: %d lines, want 40", len(lines))
	}
	for i, l := range lines {
		var r struct {
			Column string `json:"column"`
			Result
		}
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Fatalf("line %d: %v", i+1, err)
		}
		col := o.Strategies[i/20]
		if r.Column != col || r.Index != i%20 || r.Worker == "" || !strings.HasPrefix(r.Route, col) || r.TTFT <= 0 {
			t.Errorf("line %d: %s; want column %s, request %d, a worker, a route and a TTFT", i+1, l, col, i%20)
		}
	}
	md, _ := os.ReadFile(filepath.Join(dir, "report.md"))
	for _, want := range []string{"| TTFT p50 (ms) |", "vs random", "KV hit rate", "infinite cache"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}
