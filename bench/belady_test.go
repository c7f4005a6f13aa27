package bench

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/transfer/blockkey"
)

func countHits(hit []bool) int {
	n := 0
	for _, h := range hit {
		if h {
			n++
		}
	}
	return n
}

func refsOf(pages ...int) []uint64 {
	r := make([]uint64, len(pages))
	for i, p := range pages {
		r[i] = uint64(p)
	}
	return r
}

// Textbook page sequences with known optimal fault counts.
func TestBeladyTextbook(t *testing.T) {
	silberschatz := refsOf(7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1)
	anomaly := refsOf(1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)
	for _, tc := range []struct {
		name     string
		refs     []uint64
		capacity int64
		faults   int // demand paging: every missed page is loaded
		bypass   int // a missed page may be left out
	}{
		// Silberschatz, Operating System Concepts: OPT has 9 faults with 3
		// frames (LRU 12, FIFO 15). With bypass, 8: at the 4 (position 8)
		// keep 2, 0 and 3, all used again before 4 is (never).
		{"silberschatz 3 frames", silberschatz, 3, 9, 8},
		// Belady's anomaly string: OPT 7 faults with 3 frames, 6 with 4.
		// With 3 frames and bypass, 4 and 5 are never loaded (each is next
		// used after 1, 2 and 3): 1, 2, 3 miss once, 4 and 5 twice: 7.
		{"anomaly 3 frames", anomaly, 3, 7, 7},
		{"anomaly 4 frames", anomaly, 4, 6, 6},
		// One frame: demand paging loads 2 and loses 1 (faults on 1, 2,
		// 1); bypass keeps 1 (faults on 1, 2). No frame hits nothing;
		// enough frames miss only first uses.
		{"one frame", refsOf(1, 1, 2, 1, 1), 1, 3, 2},
		{"no frame", refsOf(1, 1, 1), 0, 3, 3},
		{"ample", silberschatz, 6, 6, 6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := len(tc.refs) - countHits(beladyHits(tc.refs, tc.capacity, false)); got != tc.faults {
				t.Errorf("demand paging: %d faults, want %d", got, tc.faults)
			}
			if got := len(tc.refs) - countHits(beladyHits(tc.refs, tc.capacity, true)); got != tc.bypass {
				t.Errorf("with bypass: %d faults, want %d", got, tc.bypass)
			}
		})
	}
}

// refLRU is a plain per-reference LRU: the policy MIN must never lose to.
func refLRU(refs []uint64, capacity int) int {
	var cache []uint64 // most recent last
	hits := 0
	for _, k := range refs {
		at := -1
		for i, c := range cache {
			if c == k {
				at = i
			}
		}
		if at >= 0 {
			hits++
			cache = append(cache[:at], cache[at+1:]...)
		} else if len(cache) == capacity {
			cache = cache[1:]
		}
		if capacity > 0 {
			cache = append(cache, k)
		}
	}
	return hits
}

// optimal is the best hit count of any cache of capacity pages on refs, by
// exhaustive search over which page to drop on each miss (with bypass:
// possibly the missed page itself).
func optimal(refs []uint64, capacity int, bypass bool, cache map[uint64]bool) int {
	if len(refs) == 0 {
		return 0
	}
	k, rest := refs[0], refs[1:]
	if cache[k] {
		return 1 + optimal(rest, capacity, bypass, cache)
	}
	if capacity == 0 {
		return optimal(rest, capacity, bypass, cache)
	}
	best := -1
	if bypass {
		best = optimal(rest, capacity, bypass, cache)
	}
	if len(cache) < capacity {
		cache[k] = true
		best = max(best, optimal(rest, capacity, bypass, cache))
		delete(cache, k)
		return best
	}
	var held []uint64
	for v := range cache {
		held = append(held, v)
	}
	for _, v := range held {
		delete(cache, v)
		cache[k] = true
		best = max(best, optimal(rest, capacity, bypass, cache))
		delete(cache, k)
		cache[v] = true
	}
	return best
}

// On random sequences MIN hits as often as exhaustive search, and never
// less often than LRU.
func TestBeladyOptimalOnRandomSequences(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 300; trial++ {
		n, pages, capacity := 1+rng.IntN(11), 1+rng.IntN(5), rng.IntN(4)
		refs := make([]uint64, n)
		for i := range refs {
			refs[i] = uint64(rng.IntN(pages))
		}
		for _, bypass := range []bool{false, true} {
			got := countHits(beladyHits(refs, int64(capacity), bypass))
			if want := optimal(refs, capacity, bypass, map[uint64]bool{}); got != want {
				t.Fatalf("%v with %d frames (bypass %v): MIN %d hits, exhaustive search %d", refs, capacity, bypass, got, want)
			}
		}
	}
	for trial := 0; trial < 200; trial++ {
		n, pages, capacity := 1+rng.IntN(2000), 1+rng.IntN(200), rng.IntN(100)
		refs := make([]uint64, n)
		for i := range refs {
			// Skewed popularity, so caches of every size matter.
			refs[i] = uint64(rng.IntN(1 + rng.IntN(pages)))
		}
		if got, lru := countHits(beladyHits(refs, int64(capacity), true)), refLRU(refs, capacity); got < lru {
			t.Fatalf("trial %d: MIN %d hits below LRU's %d (capacity %d)", trial, got, lru, capacity)
		}
	}
}

// traceWorkloads are the committed trace excerpts as workloads.
func traceWorkloads(t testing.TB) map[string]*workload.Workload {
	t.Helper()
	dir := filepath.Join("workload", "testdata")
	mc, err := workload.LoadTrace(filepath.Join(dir, "mooncake_conversation_head.jsonl"), 0, workload.ParseMooncake)
	if err != nil {
		t.Fatal(err)
	}
	az, err := workload.LoadTrace(filepath.Join(dir, "azure2023_conv_head.csv"), 0, workload.ParseAzure)
	if err != nil {
		t.Fatal(err)
	}
	lc, err := workload.LongContext(workload.DefaultLongContext(20), 200, 1)
	if err != nil {
		t.Fatal(err)
	}
	sg, err := workload.ShareGPT(workload.ShareGPTConfig{Active: 8}, 300, 1)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]*workload.Workload{"mooncake": workload.Mooncake(mc, 1), "azure": workload.Azure(az, 1),
		"long-context": lc, "sharegpt": sg}
}

// MIN's hits on each request form a leading run, as an engine's do: the
// chained keys make it so (belady.go). And the bound sits between the
// pooled LRU and the infinite cache (up to the last token per request the
// engine never reports).
func TestBeladyOnWorkloads(t *testing.T) {
	for name, w := range traceWorkloads(t) {
		var refs []uint64
		var ends []int
		prompt := 0
		seed := blockkey.Seed("m", "")
		for i := range w.Requests {
			text := w.Requests[i].RoutingText()
			refs = blockkey.Append(refs, seed, text, blockkey.DefaultBlockChars)
			ends = append(ends, len(refs))
			prompt += blockkey.Tokens(blockkey.Chars(text))
		}
		distinct := map[uint64]bool{}
		for _, k := range refs {
			distinct[k] = true
		}
		for _, frac := range []float64{0.05, 0.2, 0.5, 1.1} {
			capacity := int64(float64(len(distinct)) * frac)
			hit := beladyHits(refs, capacity, true)
			start := 0
			for r, end := range ends {
				for i := start + 1; i < end; i++ {
					if hit[i] && !hit[i-1] {
						t.Fatalf("%s, %d blocks: request %d hits block %d but not the one before", name, capacity, r, i-start)
					}
				}
				start = end
			}
			l := ComputeLimits(w, "m", capacity)
			slack := float64(len(w.Requests)) / float64(prompt) // one token per request
			if l.Belady+1e-12 < l.Pooled || l.Belady > l.Infinite+slack+1e-12 {
				t.Errorf("%s, %d blocks: MIN %.4f outside [pooled LRU %.4f, infinite %.4f]", name, capacity, l.Belady, l.Pooled, l.Infinite)
			}
		}
	}
}

// The real Mooncake trace: millions of block references in well under a
// second or two.
func BenchmarkBeladyMooncake(b *testing.B) {
	path := filepath.Join(os.Getenv("BATON_TRACES"), "mooncake_conversation_trace.jsonl")
	if os.Getenv("BATON_TRACES") == "" {
		path = filepath.Join("..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl")
	}
	recs, err := workload.LoadTrace(path, 0, workload.ParseMooncake)
	if err != nil {
		b.Skip(err)
	}
	var refs []uint64
	seed := blockkey.Seed("m", "")
	w := workload.Mooncake(recs, 1)
	for i := range w.Requests {
		refs = blockkey.Append(refs, seed, w.Requests[i].RoutingText(), blockkey.DefaultBlockChars)
	}
	for b.Loop() {
		beladyHits(refs, 203301, true)
	}
	b.ReportMetric(float64(len(refs)), "refs")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(refs)), "ns/ref")
}

func TestFleetBlocks(t *testing.T) {
	for _, tc := range []struct {
		name   string
		o      Options
		fleets []Fleet
		want   int64
	}{
		{"default fleet", Options{Workers: 7}, nil, 7 * 29043},
		{"kv-blocks", Options{Workers: 7, KVBlocks: 8000}, nil, 56000},
		{"cpu tier", Options{Workers: 2, KVBlocks: 100, CPUBlocks: 50}, nil, 300},
		{"largest fleet", Options{Workers: 2, KVBlocks: 100}, []Fleet{{Workers: 2}, {Prefill: 2, Decode: 3}}, 500},
		// 4 GiB of 32 KiB payloads (Llama-3.1-8B's 2 MiB blocks scaled by 64).
		{"shared tier", Options{Workers: 1, KVBlocks: 100, SharedTier: true, SharedTierBytes: 4 << 30}, nil, 100 + 131072},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FleetBlocks(tc.o, tc.fleets)
			if err != nil || got != tc.want {
				t.Errorf("FleetBlocks = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}
