package sim

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
)

// testNS is the namespace of promptKeys("", …) blocks.
var testNS = transfer.Namespace{Model: "m", Salt: blockkey.Seed("m", "")}

// recorder collects cache events.
type recorder struct{ events []CacheEvent }

func (r *recorder) emit(ev CacheEvent) { r.events = append(r.events, ev) }

func promptKeys(tenant, prompt string) []uint64 {
	return blockkey.Append(nil, blockkey.Seed("m", tenant), prompt, blockkey.DefaultBlockChars)
}

// admit acquires and commits all of keys, as a sequence whose prompt was
// fully computed, and returns the hits.
func admit(t *testing.T, c *Cache, keys []uint64) int {
	t.Helper()
	hits, ok := c.Acquire(testNS, keys, 0)
	if !ok {
		t.Fatalf("Acquire(%d keys) did not fit", len(keys))
	}
	c.Commit(testNS, keys[hits.N:])
	return hits.N
}

func TestCacheHitsRepeatedPrefix(t *testing.T) {
	var rec recorder
	c := NewCache(100, rec.emit)
	sys := strings.Repeat("s", 64*4)
	a := promptKeys("", sys+strings.Repeat("a", 64*2))
	b := promptKeys("", sys+strings.Repeat("b", 64*3))

	if got := admit(t, c, a); got != 0 {
		t.Errorf("first prompt hits = %d, want 0", got)
	}
	c.Release(a, 0)
	if got := c.Lookup(b); got != 4 {
		t.Errorf("Lookup(shared prefix) = %d, want 4", got)
	}
	if got := admit(t, c, b); got != 4 {
		t.Errorf("second prompt hits = %d, want 4", got)
	}
	if got, want := c.Used(), int64(7); got != want {
		t.Errorf("Used() = %d, want %d", got, want)
	}
	c.Release(b, 0)
	if got := c.Used(); got != 0 {
		t.Errorf("Used() after release = %d, want 0", got)
	}
	if got, want := c.Cached(), 9; got != want {
		t.Errorf("Cached() = %d, want %d", got, want)
	}
	want := []CacheEvent{
		{Kind: BlockStored, Tier: TierGPU, Keys: a},
		{Kind: BlockStored, Tier: TierGPU, Keys: b[4:]},
	}
	if diff := cmp.Diff(want, rec.events); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
}

func TestCacheLRUEviction(t *testing.T) {
	var rec recorder
	c := NewCache(4, rec.emit)
	k := func(s string) []uint64 { return promptKeys("", strings.Repeat(s, 64)) }
	x, y, z := k("x"), k("y"), k("z")
	for _, keys := range [][]uint64{x, y, z} {
		admit(t, c, keys)
		c.Release(keys, 0)
	}
	// Touch x: y is now the least recently used.
	admit(t, c, x)
	c.Release(x, 0)
	// Two more blocks: one free slot, then y is evicted.
	w := promptKeys("", strings.Repeat("w", 128))
	admit(t, c, w)
	want := CacheEvent{Kind: BlockRemoved, Tier: TierGPU, Keys: y}
	if diff := cmp.Diff(want, rec.events[len(rec.events)-2]); diff != "" {
		t.Errorf("eviction (-want +got):\n%s", diff)
	}
	for name, keys := range map[string][]uint64{"x": x, "z": z, "w": w} {
		if c.Lookup(keys) != len(keys) {
			t.Errorf("%s evicted, want cached", name)
		}
	}
	if c.Lookup(y) != 0 {
		t.Errorf("y cached, want evicted")
	}
}

func TestCacheReleaseEvictsTailFirst(t *testing.T) {
	c := NewCache(3, nil)
	keys := promptKeys("", strings.Repeat("p", 64*3))
	admit(t, c, keys)
	c.Release(keys, 0)
	admit(t, c, promptKeys("", strings.Repeat("q", 64)))
	if got := c.Lookup(keys); got != 2 {
		t.Errorf("Lookup after one eviction = %d, want 2 (tail evicted first)", got)
	}
}

func TestCacheReferencedNeverEvicted(t *testing.T) {
	var rec recorder
	c := NewCache(4, rec.emit)
	held := promptKeys("", strings.Repeat("h", 64*3))
	admit(t, c, held) // referenced: not released
	other := promptKeys("", strings.Repeat("o", 64*2))
	if _, ok := c.Acquire(testNS, other, 0); ok {
		t.Fatalf("Acquire of 2 blocks with 1 free succeeded; it must not evict referenced blocks")
	}
	if _, ok := c.Acquire(testNS, nil, 2); ok {
		t.Fatalf("reserving 2 blocks with 1 free succeeded")
	}
	if got := c.Lookup(held); got != 3 {
		t.Errorf("held blocks: Lookup = %d, want 3", got)
	}
	if _, ok := c.Acquire(testNS, nil, 1); !ok {
		t.Errorf("reserving the last free block failed")
	}
	if got := c.Used(); got != 4 {
		t.Errorf("Used() = %d, want 4", got)
	}
	for _, ev := range rec.events {
		if ev.Kind == BlockRemoved {
			t.Errorf("unexpected eviction %v", ev.Keys)
		}
	}
	// A reservation that fails changes nothing.
	c.Release(nil, 1)
	c.Release(held, 0)
	if got := c.Used(); got != 0 {
		t.Errorf("Used() after releases = %d, want 0", got)
	}
}

func TestCacheTenantsNeverShare(t *testing.T) {
	c := NewCache(100, nil)
	text := strings.Repeat("t", 64*4)
	a, b := promptKeys("alice", text), promptKeys("bob", text)
	admit(t, c, a)
	if got := c.Lookup(b); got != 0 {
		t.Errorf("bob hits %d of alice's blocks, want 0", got)
	}
	if got := admit(t, c, b); got != 0 {
		t.Errorf("bob Acquire hits = %d, want 0", got)
	}
	if got := c.Cached(); got != 8 {
		t.Errorf("Cached() = %d, want 8", got)
	}
}

func TestCacheConcurrentCommitDedupes(t *testing.T) {
	var rec recorder
	c := NewCache(10, rec.emit)
	keys := promptKeys("", strings.Repeat("d", 64*2))
	// Two sequences admitted before either computed the blocks.
	for range 2 {
		if hits, ok := c.Acquire(testNS, keys, 0); !ok || hits.N != 0 {
			t.Fatalf("Acquire = %d, %v; want 0, true", hits, ok)
		}
	}
	c.Commit(testNS, keys)
	c.Commit(testNS, keys)
	if got := c.Used(); got != 2 {
		t.Errorf("Used() = %d, want 2 (shared blocks, reservations freed)", got)
	}
	if len(rec.events) != 1 {
		t.Errorf("got %d stored events, want 1", len(rec.events))
	}
	c.Release(keys, 0)
	c.Release(keys, 0)
	if got := c.Used(); got != 0 {
		t.Errorf("Used() after releases = %d, want 0", got)
	}
}

func TestCacheSnapshot(t *testing.T) {
	c := NewCache(10, nil)
	a := promptKeys("", strings.Repeat("a", 64*2))
	admit(t, c, a)
	c.Release(a[1:], 0) // a[1] unreferenced, a[0] held (as by a second sequence)
	var got []uint64
	var used int64
	c.Snapshot(func(keys, _ []uint64, u int64) { got, used = append(got, keys...), u })
	if diff := cmp.Diff(a, got); diff != "" {
		t.Errorf("snapshot keys (-want +got):\n%s", diff)
	}
	if used != 1 {
		t.Errorf("snapshot used = %d, want 1", used)
	}
}

func BenchmarkCacheAcquireRelease(b *testing.B) {
	c := NewCache(1000, func(CacheEvent) {})
	prompts := make([][]uint64, 64)
	for i := range prompts {
		prompts[i] = promptKeys("", strings.Repeat("s", 64*8)+strings.Repeat(string(rune('a'+i%26)), 64*(1+i%8)))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		keys := prompts[i%len(prompts)]
		hits, ok := c.Acquire(testNS, keys, 2)
		if !ok {
			b.Fatal("no room")
		}
		c.Commit(testNS, keys[hits.N:])
		c.Release(keys, 2)
	}
}
