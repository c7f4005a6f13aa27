package kvindex

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
)

const (
	gpu   = TierGPU
	cpu   = TierCPU
	redis = TierRedis
)

func keys(from, to uint64) []uint64 {
	var ks []uint64
	for k := from; k < to; k++ {
		ks = append(ks, 1000+k)
	}
	return ks
}

func cache(kind CacheKind, tier Tier, ks []uint64) CacheEvent {
	return CacheEvent{Kind: kind, Tier: tier, Keys: ks}
}

func stored(tier Tier, ks []uint64) CacheEvent {
	return cache(Stored, tier, ks)
}

func moved(from, to Tier, ks []uint64) CacheEvent {
	return CacheEvent{Kind: Moved, Tier: to, From: from, HasFrom: true, Keys: ks}
}

func snapshot(load *Load, blocks ...CacheEvent) Event {
	s := &Snapshot{Blocks: blocks}
	if load != nil {
		s.Load = *load
	}
	return Event{Seq: 1, Snapshot: s}
}

func event(seq uint64, ce CacheEvent) Event {
	return Event{Seq: seq, Cache: &ce}
}

func loadEvent(seq uint64, l Load) Event {
	return Event{Seq: seq, Load: &l}
}

// soon reports whether cond holds within 10 s, checking it every
// millisecond: the tests wait so for a goroutine to reach a state they
// can read.
func soon(cond func() bool) bool {
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout:
			return false
		}
	}
	return true
}

// waitingForLock reports whether a goroutine is blocked in a call to fn
// with the wait reason reason (a lock's, as the runtime names it).
func waitingForLock(reason, fn string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(header, "["+reason) && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

func mustApply(t testing.TB, x *Index, name string, ev Event) {
	t.Helper()
	if err := x.Apply(name, ev); err != nil {
		t.Fatalf("Apply(%s, seq %d): %v", name, ev.Seq, err)
	}
}

type hit struct{ GPU, CPU, Redis int }

func lookup(x *Index, ks []uint64, names ...string) map[string]hit {
	out := make([]Match, len(names))
	x.Lookup(ks, names, out)
	got := make(map[string]hit)
	for i, n := range names {
		got[n] = hit{out[i].GPU, out[i].CPU, out[i].Redis}
	}
	return got
}

func TestLookupByTier(t *testing.T) {
	x := New(Config{})
	// a: blocks 0–3 in GPU, 4–5 in CPU; b: 0–1 in GPU and 2–9 in CPU;
	// Redis (written by c): 0–7. a and c use the Redis tier, b does not.
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, 4)), stored(cpu, keys(4, 6))))
	mustApply(t, x, "b", snapshot(nil, stored(gpu, keys(0, 2)), stored(cpu, keys(2, 10))))
	mustApply(t, x, "c", snapshot(nil))
	mustApply(t, x, "c", event(2, stored(redis, keys(0, 8))))
	for _, n := range []string{"a", "c"} {
		if err := x.SetInfo(n, Info{RedisTier: true}); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name string
		keys []uint64
		want map[string]hit
	}{
		{"whole prompt", keys(0, 12), map[string]hit{
			"a": {4, 2, 2}, "b": {2, 8, 0}, "c": {0, 0, 8}, "unknown": {}}},
		{"first block only", keys(0, 1), map[string]hit{
			"a": {1, 0, 0}, "b": {1, 0, 0}, "c": {0, 0, 1}, "unknown": {}}},
		{"other prefix", keys(50, 60), map[string]hit{
			"a": {}, "b": {}, "c": {}, "unknown": {}}},
		{"no keys", nil, map[string]hit{"a": {}, "b": {}, "c": {}, "unknown": {}}},
		// A block missing from a worker's tiers and from Redis ends its
		// run even if later blocks are held.
		{"hole", append(keys(0, 2), append([]uint64{7}, keys(2, 4)...)...), map[string]hit{
			"a": {2, 0, 0}, "b": {2, 0, 0}, "c": {0, 0, 2}, "unknown": {}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := lookup(x, tt.keys, "a", "b", "c", "unknown")
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("Lookup (-want +got):\n%s", d)
			}
		})
	}
}

func TestLookupReportsWorkerState(t *testing.T) {
	x := New(Config{})
	load := &Load{Running: 3, Waiting: 2, WaitingPrefillTokens: 900, GPUBlocksUsed: 10, GPUBlocksTotal: 100}
	mustApply(t, x, "a", snapshot(load))
	c := DefaultCost
	c.Layers, c.Hidden, c.FLOPS, c.KVBytesPerBlock = 80, 8192, 1e15, 5<<20
	c.HBMBytesPerSecond, c.MaxBatchedTokens = 4e12, 2048
	if err := x.SetInfo("a", Info{BlockTokens: 32, Cost: c, HasCost: true}); err != nil {
		t.Fatal(err)
	}
	out := make([]Match, 2)
	x.Lookup(nil, []string{"a", "b"}, out)
	wantCost := DefaultCost
	wantCost.Layers, wantCost.Hidden, wantCost.FLOPS, wantCost.KVBytesPerBlock = 80, 8192, 1e15, 5<<20
	wantCost.HBMBytesPerSecond, wantCost.MaxBatchedTokens = 4e12, 2048
	want := []Match{
		{Known: true, Load: Load{Running: 3, Waiting: 2, WaitingPrefillTokens: 900, GPUBlocksUsed: 10, GPUBlocksTotal: 100},
			Cost: wantCost, HasCost: true, BlockTokens: 32, Correction: 1},
		{Cost: DefaultCost, BlockTokens: 16, Correction: 1},
	}
	if d := cmp.Diff(want, out); d != "" {
		t.Errorf("Lookup (-want +got):\n%s", d)
	}
}

func TestEvents(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, 4))))
	mustApply(t, x, "a", event(2, stored(gpu, keys(4, 6))))
	if got, want := lookup(x, keys(0, 8), "a")["a"], (hit{6, 0, 0}); got != want {
		t.Fatalf("after stored: %+v, want %+v", got, want)
	}
	// Blocks 2–3 demoted to CPU, then 4–5 removed from the GPU.
	mustApply(t, x, "a", event(3, moved(gpu, cpu, keys(2, 4))))
	mustApply(t, x, "a", event(4, cache(Removed, gpu, keys(4, 6))))
	if got, want := lookup(x, keys(0, 8), "a")["a"], (hit{2, 2, 0}); got != want {
		t.Fatalf("after tier change and removal: %+v, want %+v", got, want)
	}
	// Block 3 promoted back; block 2 dropped from CPU (a hole).
	mustApply(t, x, "a", event(5, moved(cpu, gpu, keys(3, 4))))
	mustApply(t, x, "a", event(6, cache(Removed, cpu, keys(2, 3))))
	if got, want := lookup(x, keys(0, 8), "a")["a"], (hit{2, 0, 0}); got != want {
		t.Fatalf("after promotion and hole: %+v, want %+v", got, want)
	}
	if got, want := x.Len(), 3; got != want {
		t.Errorf("Len = %d, want %d (removed blocks dropped)", got, want)
	}
	// Redis: stored by one worker, removed by another.
	mustApply(t, x, "b", snapshot(nil))
	_ = x.SetInfo("b", Info{RedisTier: true})
	mustApply(t, x, "a", event(7, stored(redis, keys(0, 5))))
	if got, want := lookup(x, keys(0, 8), "b")["b"], (hit{0, 0, 5}); got != want {
		t.Fatalf("redis: %+v, want %+v", got, want)
	}
	mustApply(t, x, "b", event(2, cache(Removed, redis, keys(1, 2))))
	if got, want := lookup(x, keys(0, 8), "b")["b"], (hit{0, 0, 1}); got != want {
		t.Fatalf("redis after removal: %+v, want %+v", got, want)
	}
}

func TestSequence(t *testing.T) {
	x := New(Config{})
	if err := x.Apply("a", event(2, stored(gpu, keys(0, 1)))); !errors.Is(err, ErrNoSnapshot) {
		t.Fatalf("event before snapshot: %v, want ErrNoSnapshot", err)
	}
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, 2))))
	mustApply(t, x, "a", event(2, stored(gpu, keys(2, 3))))
	// A replayed event is ignored: Apply is idempotent.
	mustApply(t, x, "a", event(2, cache(Removed, gpu, keys(0, 3))))
	if got, want := lookup(x, keys(0, 5), "a")["a"], (hit{3, 0, 0}); got != want {
		t.Fatalf("after replay: %+v, want %+v", got, want)
	}
	if err := x.Apply("a", event(4, stored(gpu, keys(3, 4)))); !errors.Is(err, ErrGap) {
		t.Fatalf("gap: %v, want ErrGap", err)
	}
	// After a gap, events are refused until a snapshot.
	if err := x.Apply("a", event(5, stored(gpu, keys(3, 4)))); !errors.Is(err, ErrNoSnapshot) {
		t.Fatalf("after gap: %v, want ErrNoSnapshot", err)
	}
	// The snapshot replaces the worker's blocks, and not other workers'.
	mustApply(t, x, "b", snapshot(nil, stored(gpu, keys(0, 2))))
	mustApply(t, x, "a", snapshot(nil, stored(cpu, keys(0, 1)), stored(gpu, keys(10, 12))))
	mustApply(t, x, "a", event(2, stored(gpu, keys(1, 2))))
	got := lookup(x, keys(0, 5), "a", "b")
	if d := cmp.Diff(map[string]hit{"a": {1, 1, 0}, "b": {2, 0, 0}}, got); d != "" {
		t.Errorf("after resync (-want +got):\n%s", d)
	}
	if got, want := x.Len(), 4; got != want {
		t.Errorf("Len = %d, want %d", got, want)
	}
}

func TestRemoveWorker(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, 100)), stored(cpu, keys(100, 200))))
	mustApply(t, x, "b", snapshot(nil, stored(gpu, keys(0, 10))))
	x.Predict("a", keys(200, 210))
	x.RemoveWorker("a")
	if got, want := x.Len(), 10; got != want {
		t.Errorf("Len = %d, want %d (only b's blocks)", got, want)
	}
	got := lookup(x, keys(0, 10), "a", "b")
	if d := cmp.Diff(map[string]hit{"a": {}, "b": {10, 0, 0}}, got); d != "" {
		t.Errorf("after RemoveWorker (-want +got):\n%s", d)
	}
	// The slot is free for another worker, with no stale bits.
	mustApply(t, x, "c", snapshot(nil))
	if got := lookup(x, keys(0, 210), "c")["c"]; got != (hit{}) {
		t.Errorf("new worker in the freed slot holds %+v", got)
	}
	x.RemoveWorker("nobody")
}

// A worker removed while others are added and looked up: the table is
// cleared of its bits a chunk at a time, the locks free between two, and
// meanwhile its slot is taken by no other worker, so that no worker added
// then sees its blocks.
func TestRemoveWorkerWhileAdding(t *testing.T) {
	x := New(Config{})
	const n = 3 * scanChunk // blocks: the clearing takes the lock several times
	mustApply(t, x, "old", snapshot(nil, stored(gpu, keys(0, n))))
	mustApply(t, x, "other", snapshot(nil, stored(gpu, keys(0, 10))))
	chunks := 0
	x.blocks.betweenChunks = func() {
		chunks++
		name := fmt.Sprint("new", chunks)
		mustApply(t, x, name, snapshot(nil))
		// The blocks stored last are in the chunks cleared last.
		if got := lookup(x, keys(n-100, n), name)[name]; got != (hit{}) {
			t.Errorf("%s, added while old is removed, holds %+v of old's blocks", name, got)
		}
		if got := lookup(x, keys(0, 10), "other")["other"]; got != (hit{10, 0, 0}) {
			t.Errorf("other worker while old is removed: %+v", got)
		}
	}
	x.RemoveWorker("old")
	x.blocks.betweenChunks = nil
	if chunks == 0 {
		t.Fatal("the clearing took the lock once")
	}
	mustApply(t, x, "last", snapshot(nil)) // in old's slot, free now
	for i := range chunks + 2 {
		name := fmt.Sprint("new", i)
		switch i {
		case 0:
			name = "old"
		case chunks + 1:
			name = "last"
		}
		if got := lookup(x, keys(n-100, n), name)[name]; got != (hit{}) {
			t.Errorf("%s holds %+v of the removed worker's blocks", name, got)
		}
	}
	if got, want := x.Len(), 10; got != want {
		t.Errorf("Len = %d, want %d (only other's blocks)", got, want)
	}
}

func TestTooManyWorkers(t *testing.T) {
	x := New(Config{})
	for i := range MaxTracked {
		mustApply(t, x, fmt.Sprint("w", i), snapshot(nil))
	}
	if err := x.Apply("extra", snapshot(nil)); !errors.Is(err, ErrTooManyWorkers) {
		t.Fatalf("Apply beyond MaxTracked: %v, want ErrTooManyWorkers", err)
	}
	x.Predict("extra", keys(0, 3)) // ignored
	if err := x.AddWorker("extra"); !errors.Is(err, ErrTooManyWorkers) {
		t.Fatalf("AddWorker beyond MaxTracked: %v, want ErrTooManyWorkers", err)
	}
	x.RemoveWorker("w0")
	mustApply(t, x, "extra", snapshot(nil))
}

func TestPredictOnlyTrackedWorkers(t *testing.T) {
	x := New(Config{})
	x.Predict("gone", keys(0, 5))
	if got := x.Len(); got != 0 {
		t.Fatalf("Predict on an untracked worker indexed %d blocks", got)
	}
	if err := x.AddWorker("http"); err != nil {
		t.Fatal(err)
	}
	x.Predict("http", keys(0, 5))
	if got, want := lookup(x, keys(0, 8), "http")["http"], (hit{5, 0, 0}); got != want {
		t.Errorf("predicted on an added worker: %+v, want %+v", got, want)
	}
}

func TestCapEvictsLeastRecentlyTouched(t *testing.T) {
	x := New(Config{MaxBlocks: 100})
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, 100))))
	// Touch block 0 (stored again), then add 50 more.
	mustApply(t, x, "a", event(2, stored(gpu, keys(0, 1))))
	mustApply(t, x, "a", event(3, stored(gpu, keys(100, 150))))
	if got, want := x.Len(), 100; got != want {
		t.Fatalf("Len = %d, want %d", got, want)
	}
	if got, want := x.Evicted(), uint64(50); got != want {
		t.Errorf("Evicted = %d, want %d", got, want)
	}
	for _, tt := range []struct {
		key  uint64
		want int
	}{{0, 1}, {1, 0}, {50, 0}, {51, 1}, {99, 1}, {149, 1}} {
		if got := lookup(x, keys(tt.key, tt.key+1), "a")["a"].GPU; got != tt.want {
			t.Errorf("block %d: GPU %d, want %d", tt.key, got, tt.want)
		}
	}
}

type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestPredict(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	x := New(Config{Now: clk.Now, PredictTTL: 2 * time.Second})
	mustApply(t, x, "a", snapshot(&Load{WaitingPrefillTokens: 7}, stored(gpu, keys(0, 2))))
	mustApply(t, x, "b", snapshot(nil))

	x.Predict("a", keys(0, 10))
	out := make([]Match, 1)
	x.Lookup(keys(0, 12), []string{"a"}, out)
	if got, want := (hit{out[0].GPU, out[0].CPU, out[0].Redis}), (hit{10, 0, 0}); got != want {
		t.Errorf("predicted: %+v, want %+v", got, want)
	}
	if got, want := out[0].PendingTokens, int64(8*16); got != want {
		t.Errorf("PendingTokens = %d, want %d (8 new blocks)", got, want)
	}
	// Events confirm blocks 2–5; then the TTL passes.
	mustApply(t, x, "a", event(2, stored(gpu, keys(2, 6))))
	clk.Add(2 * time.Second)
	if got, want := lookup(x, keys(0, 12), "a")["a"], (hit{6, 0, 0}); got != want {
		t.Errorf("after TTL: %+v, want %+v (confirmed blocks only)", got, want)
	}
	// A later prediction on b does not revive a's expired ones.
	x.Predict("b", keys(0, 10))
	got := lookup(x, keys(0, 12), "a", "b")
	if d := cmp.Diff(map[string]hit{"a": {6, 0, 0}, "b": {10, 0, 0}}, got); d != "" {
		t.Errorf("after b's prediction (-want +got):\n%s", d)
	}
	// A load report resets the pending tokens.
	mustApply(t, x, "a", loadEvent(3, Load{WaitingPrefillTokens: 5}))
	x.Lookup(nil, []string{"a"}, out)
	if out[0].PendingTokens != 0 || out[0].Load.WaitingPrefillTokens != 5 {
		t.Errorf("after load report: pending %d, waiting prefill %d; want 0, 5", out[0].PendingTokens, out[0].Load.WaitingPrefillTokens)
	}
}

func TestRoutedDecays(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	x := New(Config{Now: clk.Now, RoutedHalfLife: time.Minute})
	mustApply(t, x, "a", snapshot(nil))
	mustApply(t, x, "b", snapshot(nil))
	routed := func() (a, b float64) {
		out := make([]Match, 2)
		x.Lookup(nil, []string{"a", "b"}, out)
		return out[0].Routed, out[1].Routed
	}
	x.Predict("a", keys(0, 4))
	x.Predict("a", keys(4, 8))
	if a, b := routed(); a != 2 || b != 0 {
		t.Fatalf("Routed = %v, %v; want 2, 0", a, b)
	}
	// A load report clears pending tokens, not the traffic routed.
	mustApply(t, x, "a", loadEvent(2, Load{}))
	clk.Add(time.Minute)
	if a, _ := routed(); math.Abs(a-1) > 1e-9 {
		t.Errorf("after one half-life Routed = %v, want 1", a)
	}
	x.Predict("a", keys(8, 9))
	clk.Add(2 * time.Minute)
	if a, _ := routed(); math.Abs(a-0.5) > 1e-9 {
		t.Errorf("Routed = %v, want (1+1)/4 = 0.5", a)
	}
}

func TestObserveTTFT(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	x := New(Config{Now: clk.Now})
	mustApply(t, x, "a", snapshot(nil)) // DefaultCost: 5.6 ms decode steps
	correction := func() float64 {
		out := make([]Match, 1)
		x.Lookup(nil, []string{"a"}, out)
		return out[0].Correction
	}
	if got := correction(); got != 1 {
		t.Fatalf("Correction before any observation = %v, want 1", got)
	}
	x.ObserveTTFT("a", 0, time.Second)                // ignored
	x.ObserveTTFT("nobody", time.Second, time.Second) // ignored
	// Shorter than ten decode steps: ignored.
	x.ObserveTTFT("a", 20*time.Millisecond, 200*time.Millisecond)
	if got := correction(); got != 1 {
		t.Errorf("Correction after ignored observations = %v, want 1", got)
	}
	// One second predicted, two achieved, against the 1 s prior.
	x.ObserveTTFT("a", time.Second, 2*time.Second)
	if got, want := correction(), 1.5; math.Abs(got-want) > 1e-9 {
		t.Errorf("Correction = %v, want (2+1)/(1+1) = %v", got, want)
	}
	// Long prompts weigh more than short ones: 100 ms predictions taking
	// 200 ms and 900 ms ones taking 900 ms make (200+900)/(100+900).
	clk.Add(time.Hour) // forget the first
	for range 200 {
		x.ObserveTTFT("a", 100*time.Millisecond, 200*time.Millisecond)
		x.ObserveTTFT("a", 900*time.Millisecond, 900*time.Millisecond)
	}
	if got, want := correction(), 1.1; math.Abs(got-want) > 0.01 {
		t.Errorf("Correction = %v, want about %v", got, want)
	}
	// Unobserved, it drifts back to 1: after one half-life the sums
	// weigh half, after twenty next to nothing.
	clk.Add(correctionHalfLife)
	if got, want := correction(), (110+1)/(100+1.0); math.Abs(got-want) > 1e-9 {
		t.Errorf("Correction a half-life later = %v, want %v", got, want)
	}
	clk.Add(19 * correctionHalfLife)
	if got := correction(); math.Abs(got-1) > 0.001 {
		t.Errorf("Correction twenty half-lives later = %v, want about 1", got)
	}
	for range 400 {
		x.ObserveTTFT("a", time.Second, time.Hour) // counted as 4 s
	}
	if c := correction(); c > maxCorrection || c < 3.9 {
		t.Errorf("Correction = %v, want just under %v", c, maxCorrection)
	}
}

// TestTableChurn checks the hash table against a map under random inserts
// and removals, across growth.
func TestTableChurn(t *testing.T) {
	var tb table
	tb.init(1 << 20)
	model := map[uint64]bool{}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 200000 {
		k := rng.Uint64N(5000) // dense keys collide in probe chains
		if j := tb.find(k); (j != none) != model[k] {
			t.Fatalf("op %d: find(%d) = %d, model has %t", i, k, j, model[k])
		}
		if model[k] {
			tb.remove(tb.find(k))
			delete(model, k)
		} else {
			tb.insert(k)
			model[k] = true
		}
	}
	if tb.n != len(model) {
		t.Fatalf("n = %d, want %d", tb.n, len(model))
	}
	for k := range model {
		if tb.find(k) == none {
			t.Fatalf("key %d lost", k)
		}
	}
	// The LRU list holds every entry once.
	seen := 0
	for i := tb.head; i != none; i = tb.at(i).next {
		seen++
	}
	if seen != tb.n {
		t.Fatalf("LRU list has %d entries, want %d", seen, tb.n)
	}
}

// fill indexes n random blocks spread over workers GPU tiers, with a
// tenth of them also in Redis, and returns the keys.
func fill(tb testing.TB, x *Index, workers, n int) []uint64 {
	rng := rand.New(rand.NewPCG(7, 8))
	all := make([]uint64, n)
	for i := range all {
		all[i] = rng.Uint64()
	}
	per := n / workers
	for w := range workers {
		ks := all[w*per : (w+1)*per]
		mustApply(tb, x, fmt.Sprintf("w%02d", w), snapshot(nil, stored(gpu, ks), stored(redis, ks[:len(ks)/10])))
	}
	return all
}

// TestBytesPerBlock measures the heap an index of a million blocks takes.
func TestBytesPerBlock(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates about 100 MB")
	}
	const n = 1 << 20
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	x := New(Config{})
	fill(t, x, 64, n)
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(x.Len())
	t.Logf("%d blocks: %.1f bytes per indexed block (HeapAlloc)", x.Len(), per)
	if per > 100 {
		t.Errorf("%.1f bytes per block, want under 100", per)
	}
	runtime.KeepAlive(x)
}

func TestConcurrentApplyLookup(t *testing.T) {
	x := New(Config{MaxBlocks: 5000})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			name := fmt.Sprint("w", w)
			mustApply(t, x, name, snapshot(nil))
			for seq := uint64(2); seq < 500; seq++ {
				ks := keys(seq*10, seq*10+10)
				if err := x.Apply(name, event(seq, stored(gpu, ks))); err != nil {
					t.Error(err)
					return
				}
				x.Predict(name, ks)
			}
		})
	}
	for range 4 {
		wg.Go(func() {
			out := make([]Match, 4)
			names := []string{"w0", "w1", "w2", "w3"}
			for i := range 500 {
				x.Lookup(keys(uint64(i), uint64(i)+50), names, out)
			}
		})
	}
	wg.Wait()
}

func BenchmarkLookup(b *testing.B) {
	for _, workers := range []int{8, 64} {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", workers), func(b *testing.B) {
			x := New(Config{})
			all := fill(b, x, workers, 1<<20)
			names := make([]string, workers)
			for i := range names {
				names[i] = fmt.Sprintf("w%02d", i)
			}
			// The prompt: 300 blocks held by w00 (and Redis for 50), then
			// 200 blocks nobody holds.
			ks := append(append([]uint64(nil), all[:300]...), keys(0, 200)...)
			out := make([]Match, workers)
			b.ReportAllocs()
			for b.Loop() {
				x.Lookup(ks, names, out)
			}
			if out[0].GPU != 300 {
				b.Fatalf("w00 GPU = %d, want 300", out[0].GPU)
			}
		})
	}
}

// BenchmarkLookupParallel measures lookups from every CPU while one
// goroutine applies events (a worker storing 32 blocks per event).
func BenchmarkLookupParallel(b *testing.B) {
	x := New(Config{})
	all := fill(b, x, 64, 1<<20)
	names := make([]string, 64)
	for i := range names {
		names[i] = fmt.Sprintf("w%02d", i)
	}
	ks := append(append([]uint64(nil), all[:300]...), keys(0, 200)...)
	stop := make(chan struct{})
	done := make(chan struct{})
	applied := 0
	go func() {
		defer close(done)
		seq := uint64(1)
		rng := rand.New(rand.NewPCG(3, 4))
		for {
			select {
			case <-stop:
				return
			default:
			}
			seq++
			ev := stored(gpu, []uint64{rng.Uint64(), rng.Uint64(), rng.Uint64(), rng.Uint64()})
			if err := x.Apply("w63", event(seq, ev)); err != nil {
				panic(err)
			}
			applied++
			time.Sleep(100 * time.Microsecond)
		}
	}()
	b.ResetTimer()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		out := make([]Match, 64)
		for pb.Next() {
			x.Lookup(ks, names, out)
		}
	})
	close(stop)
	<-done
	b.ReportMetric(float64(applied), "applies")
}

func BenchmarkPredict(b *testing.B) {
	x := New(Config{})
	all := fill(b, x, 64, 1<<20)
	ks := all[:500]
	b.ReportAllocs()
	for b.Loop() {
		x.Predict("w01", ks)
	}
}

func BenchmarkApplySnapshot(b *testing.B) {
	x := New(Config{})
	all := fill(b, x, 64, 1<<20)
	ev := snapshot(nil, stored(gpu, all[:1<<14]))
	b.ReportAllocs()
	for b.Loop() {
		mustApply(b, x, "w00", ev)
	}
}

func TestEntrySize(t *testing.T) {
	if got := unsafe.Sizeof(entry{}); got != entrySize {
		t.Errorf("entry is %d bytes, entrySize says %d", got, entrySize)
	}
	if got := unsafe.Sizeof(part{}); got != partSize {
		t.Errorf("part is %d bytes, partSize says %d", got, partSize)
	}
}

// Per-worker state stands apart from the block table: a load report, a
// first token's feedback and a prefilled request's bookkeeping complete
// while the table is locked (by a snapshot being applied, say).
func TestWorkerStateDoesNotWaitForBlocks(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "w0", snapshot(nil))
	x.blocks.mu.Lock()
	done := make(chan error)
	go func() {
		err := x.Apply("w0", loadEvent(2, Load{Running: 3, WaitingPrefillTokens: 500}))
		x.Prefilled("w0", 100)
		x.ObserveTTFT("w0", time.Second, 2*time.Second)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a load report waited for the block table's lock")
	}
	x.blocks.mu.Unlock()
	out := make([]Match, 1)
	x.Lookup(nil, []string{"w0"}, out)
	if got := out[0].Load; got.Running != 3 || got.WaitingPrefillTokens != 500 {
		t.Errorf("load %+v, want the report's", got)
	}
}

// A request routed while another's Predict waits for the block table (a
// burst's picks on a loaded machine) sees that one's prefill pending at
// once, all of its blocks until the write finds those the worker held; a
// load report in between resets the count, which the write then leaves.
func TestPredictCountsPendingBeforeBlocks(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "w0", snapshot(nil, stored(gpu, keys(0, 2))))
	pending := func() int64 {
		out := make([]Match, 1)
		x.Lookup(nil, []string{"w0"}, out) // no keys: the table is not read
		return out[0].PendingTokens
	}
	x.blocks.mu.RLock() // a lookup walking the table
	var wg sync.WaitGroup
	wg.Go(func() { x.Predict("w0", keys(0, 10)) })
	if !soon(func() bool { return pending() == 10*16 }) {
		x.blocks.mu.RUnlock()
		wg.Wait()
		t.Fatalf("pending %d while Predict waits for the table, want %d (all 10 blocks)", pending(), 10*16)
	}
	x.blocks.mu.RUnlock()
	wg.Wait()
	if got, want := pending(), int64(8*16); got != want {
		t.Errorf("pending %d after the write, want %d (the 8 blocks w0 did not hold)", got, want)
	}

	// A load report while the first request's blocks wait, then a second
	// request of 10 new blocks: the report counted the first, whose held
	// blocks no longer come off.
	mustApply(t, x, "w1", snapshot(nil, stored(gpu, keys(0, 2))))
	w1 := func() int64 {
		out := make([]Match, 1)
		x.Lookup(nil, []string{"w1"}, out)
		return out[0].PendingTokens
	}
	await := func(want int64, what string) {
		if !soon(func() bool { return w1() == want }) {
			x.blocks.mu.RUnlock()
			wg.Wait()
			t.Fatalf("pending %d %s, want %d", w1(), what, want)
		}
	}
	x.blocks.mu.RLock()
	wg.Go(func() { x.Predict("w1", keys(0, 10)) })
	await(10*16, "while the first request's Predict waits")
	mustApply(t, x, "w1", loadEvent(2, Load{WaitingPrefillTokens: 8 * 16}))
	wg.Go(func() { x.Predict("w1", keys(100, 110)) })
	await(10*16, "while the second request's Predict waits")
	x.blocks.mu.RUnlock()
	wg.Wait()
	out := make([]Match, 1)
	x.Lookup(nil, []string{"w1"}, out)
	if got, want := out[0].PendingTokens, int64(10*16); got != want {
		t.Errorf("pending %d after a load report and a second request, want %d (the second's 10 blocks)", got, want)
	}
}

// A Lookup waiting for the block table (a write holds it) reports the
// workers' state as of its walk's end: a request routed meanwhile counts
// in its worker's pending tokens, rather than every pick of a burst
// queued behind one write deciding on the state before it.
func TestLookupReadsWorkersAfterTheWalk(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "w0", snapshot(nil))
	x.blocks.mu.Lock() // a write, such as a cache event's
	var wg sync.WaitGroup
	out := make([]Match, 1)
	wg.Go(func() { x.Lookup(keys(100, 104), []string{"w0"}, out) })
	if !soon(func() bool { return waitingForLock("sync.RWMutex.RLock", "kvindex.(*Index).Lookup") }) {
		x.blocks.mu.Unlock()
		wg.Wait()
		t.Fatal("the Lookup never waited for the table")
	}
	wg.Go(func() { x.Predict("w0", keys(0, 10)) })
	probe := make([]Match, 1)
	if !soon(func() bool { x.Lookup(nil, []string{"w0"}, probe); return probe[0].PendingTokens != 0 }) {
		x.blocks.mu.Unlock()
		wg.Wait()
		t.Fatal("Predict's pending tokens never showed while it waited for the table")
	}
	x.blocks.mu.Unlock()
	wg.Wait()
	if got, want := out[0].PendingTokens, int64(10*16); got != want {
		t.Errorf("Lookup that waited for the table: pending %d, want %d (the request routed meanwhile)", got, want)
	}
}

// Lookup gallops along long prompts (walkStride) but counts exactly where
// workers hold prefixes of them, as engines do: each worker holds some
// leading blocks in GPU, the next ones in CPU, and Redis some leading
// blocks, at any lengths.
func TestLookupGallopsExactlyOverPrefixes(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	for trial := range 300 {
		x := New(Config{})
		n := 1 + rng.IntN(120)
		if trial%2 == 1 {
			n = 1 + rng.IntN(1500) // past several doublings of the gallop
		}
		ks := keys(uint64(trial)*1000, uint64(trial)*1000+uint64(n))
		names := []string{"a", "b", "c"}
		want := map[string]hit{}
		redisLen := rng.IntN(n + 1)
		for i, name := range names {
			x.SetInfo(name, Info{RedisTier: i != 2})
			mustApply(t, x, name, snapshot(nil))
			g := rng.IntN(n + 1)
			c := g + rng.IntN(n-g+1)
			seq := uint64(1)
			if g > 0 {
				seq++
				mustApply(t, x, name, event(seq, stored(gpu, ks[:g])))
			}
			if c > g {
				seq++
				mustApply(t, x, name, event(seq, stored(cpu, ks[g:c])))
			}
			h := hit{GPU: g, CPU: c - g}
			if i != 2 && redisLen > c {
				h.Redis = redisLen - c
			}
			want[name] = h
		}
		if redisLen > 0 {
			mustApply(t, x, "r", snapshot(nil, stored(redis, ks[:redisLen])))
		}
		got := lookup(x, ks, names...)
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("trial %d, %d blocks, Redis %d (-want +got):\n%s", trial, n, redisLen, diff)
		}
	}
}

// Lookup finds each worker by name whatever it remembered of earlier
// lookups: many names at once (which share the remembered slots), names
// whose worker left, and names that came back in another slot.
func TestLookupFindsWorkersByName(t *testing.T) {
	x := New(Config{})
	names := make([]string, MaxWorkers)
	for i := range names {
		names[i] = fmt.Sprintf("w%d", i)
		if err := x.Apply(names[i], Event{Seq: 1, Snapshot: &Snapshot{Load: Load{Running: i}}}); err != nil {
			t.Fatal(err)
		}
	}
	out := make([]Match, len(names))
	check := func(step string, gone map[int]bool) {
		t.Helper()
		x.Lookup(nil, names, out)
		for i, m := range out {
			if m.Known == gone[i] || m.Known && m.Load.Running != i {
				t.Errorf("%s: %s: known %v, running %d; want known %v, running %d", step, names[i], m.Known, m.Load.Running, !gone[i], i)
			}
		}
	}
	check("first", nil)
	check("again", nil)
	x.RemoveWorker(names[3])
	check("w3 removed", map[int]bool{3: true})
	// w3's slot goes to a newcomer; w3 comes back in another.
	if err := x.Apply("new", Event{Seq: 1, Snapshot: &Snapshot{Load: Load{Running: 100}}}); err != nil {
		t.Fatal(err)
	}
	check("slot reused", map[int]bool{3: true})
	x.RemoveWorker(names[5])
	if err := x.Apply(names[3], Event{Seq: 1, Snapshot: &Snapshot{Load: Load{Running: 3}}}); err != nil {
		t.Fatal(err)
	}
	check("w3 back", map[int]bool{5: true})
}

// Lookup tells apart names whose bytes start at the same address (one a
// prefix of the other), which share a remembered place, and finds the
// workers of far more names than a line of remembered places holds.
func TestLookupFindsNamesSharingAddresses(t *testing.T) {
	x := New(Config{})
	all := "workerworker"
	names := []string{all[:6], all, all[:7], all[6:]} // "worker" twice, at two addresses
	for i, name := range names[:3] {
		mustApply(t, x, name, Event{Seq: 1, Snapshot: &Snapshot{Load: Load{Running: i}}})
	}
	out := make([]Match, len(names))
	for range 3 {
		x.Lookup(nil, names, out)
		for i, want := range []int{0, 1, 2, 0} {
			if got := out[i].Load.Running; !out[i].Known || got != want {
				t.Fatalf("%q: known %v, running %d; want running %d", names[i], out[i].Known, got, want)
			}
		}
	}
	many := make([]string, MaxTracked)
	for i := range many {
		many[i] = fmt.Sprintf("m%d", i)
		if err := x.AddWorker(many[i]); err != nil {
			if errors.Is(err, ErrTooManyWorkers) {
				many = many[:i]
				break
			}
			t.Fatal(err)
		}
	}
	for i, name := range many {
		x.SetInfo(name, Info{BlockTokens: 1 + i})
	}
	out = make([]Match, len(many))
	for range 2 {
		x.Lookup(nil, many, out)
		for i, m := range out {
			if !m.Known || m.BlockTokens != 1+i {
				t.Fatalf("%s: known %v, block tokens %d; want %d", many[i], m.Known, m.BlockTokens, 1+i)
			}
		}
	}
}

// A worker's Redis tier goes with it: a worker that takes the slot of
// one that read Redis does not, until it says so.
func TestRedisTierGoesWithTheWorker(t *testing.T) {
	x := New(Config{})
	ks := keys(0, 4)
	x.SetInfo("a", Info{RedisTier: true})
	mustApply(t, x, "a", snapshot(nil))
	mustApply(t, x, "r", snapshot(nil, stored(redis, ks)))
	if got := lookup(x, ks, "a")["a"]; got.Redis != 4 {
		t.Fatalf("a: %+v, want 4 Redis blocks", got)
	}
	x.RemoveWorker("a")
	mustApply(t, x, "b", snapshot(nil)) // a's slot
	if got := lookup(x, ks, "b")["b"]; got.Redis != 0 {
		t.Errorf("b in a's slot: %+v, want no Redis blocks", got)
	}
	x.SetInfo("b", Info{RedisTier: true})
	if got := lookup(x, ks, "b")["b"]; got.Redis != 4 {
		t.Errorf("b once it reads Redis: %+v, want 4 Redis blocks", got)
	}
}

// A slot's record is its worker's alone: workers removed and added again
// while they report their load, correction and Info, and while lookups
// read them, never show another worker's state, nor a state torn between
// two writes. Worker i reports i+1 in every field.
func TestRecordsFollowTheirWorkers(t *testing.T) {
	x := New(Config{})
	const n = 8
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprint("w", i)
	}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i, name := range names {
		v := int64(i + 1)
		l := Load{Running: int(v), Waiting: int(v), WaitingPrefillTokens: v, GPUBlocksUsed: v, GPUBlocksTotal: v,
			CPUBlocksUsed: v, CPUBlocksTotal: v, Slots: int(v)}
		wg.Go(func() {
			untilClosed(stop, func() {
				if x.Apply(name, snapshot(&l)) != nil {
					return // removed meanwhile
				}
				for seq := uint64(2); seq < 10; seq++ {
					if x.Apply(name, loadEvent(seq, l)) != nil {
						break // removed meanwhile
					}
				}
				x.SetInfo(name, Info{BlockTokens: i + 1})
				x.ObserveTTFT(name, time.Second, time.Duration(v)*time.Second)
				x.Prefilled(name, 1)
			})
		})
		wg.Go(func() {
			untilClosed(stop, func() {
				x.RemoveWorker(name)
				runtime.Gosched()
			})
		})
	}
	out := make([]Match, n)
	for range 10000 {
		x.Lookup(nil, names, out)
		for i, m := range out {
			v := int64(i + 1)
			l := m.Load
			switch {
			case !m.Known:
			case l != Load{} && (l.Running != int(v) || l.Waiting != int(v) || l.WaitingPrefillTokens != v ||
				l.GPUBlocksUsed != v || l.GPUBlocksTotal != v || l.CPUBlocksUsed != v || l.CPUBlocksTotal != v || l.Slots != int(v)):
				t.Fatalf("%s: load %+v, want every field %d or none", names[i], l, v)
			case m.BlockTokens != defaultBlockTokens && m.BlockTokens != i+1:
				t.Fatalf("%s: %d tokens a block, want %d or the default", names[i], m.BlockTokens, i+1)
			case m.Correction != 1 && (m.Correction <= 1 || m.Correction > float64(v)):
				t.Fatalf("%s: correction %v, want 1 or in (1, %d]", names[i], m.Correction, v)
			}
		}
	}
	close(stop)
	wg.Wait()
}

// A worker removed does not write the record of its slot once another
// worker took it, as a call that found the worker before the removal
// would.
func TestRemovedWorkerKeepsOffItsSlot(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "a", snapshot(&Load{Running: 1}))
	x.workers.mu.RLock()
	a := x.workers.get("a")
	x.workers.mu.RUnlock()
	x.RemoveWorker("a")
	mustApply(t, x, "b", snapshot(&Load{Running: 2}))
	if b := x.workers.get("b"); b.grp != a.grp || b.slot != a.slot {
		t.Fatalf("b took slot %d, not a's %d", b.slot, a.slot)
	}
	x.workers.mu.RLock()
	a.mu.Lock()
	a.setLoad(Load{Running: 1}, 0)
	a.mu.Unlock()
	x.workers.mu.RUnlock()
	out := make([]Match, 1)
	x.Lookup(nil, []string{"b"}, out)
	if got := out[0].Load.Running; got != 2 {
		t.Errorf("b after removed a reported its load: running %d, want 2", got)
	}
}

// A record takes two cache lines, and a group's records start on a line,
// so that a lookup reads two lines per worker.
func TestRecordLayout(t *testing.T) {
	if got := unsafe.Sizeof(record{}); got != recordSize {
		t.Errorf("record: %d bytes, want %d", got, recordSize)
	}
	x := New(Config{})
	for i := range 3 * MaxWorkers {
		if err := x.AddWorker(fmt.Sprint("w", i)); err != nil {
			t.Fatal(err)
		}
	}
	for _, g := range x.workers.groups {
		if a := uintptr(unsafe.Pointer(&g.recs[0])); a%recordSize != 0 {
			t.Errorf("group %d's records at %#x, not on a %d-byte boundary", g.id, a, recordSize)
		}
	}
}

// untilClosed calls fn again and again until stop is closed.
func untilClosed(stop <-chan struct{}, fn func()) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		fn()
	}
}
