package ring

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// handRing is a ring whose points are set by hand: a at 10 and 40, b at 20,
// c at 30.
func handRing() *Ring {
	return &Ring{
		members: []string{"a", "b", "c"},
		points:  []uint64{10, 20, 30, 40},
		owners:  []int32{0, 1, 2, 0},
	}
}

func TestLookupHandComputed(t *testing.T) {
	tests := []struct {
		key  uint64
		want int
	}{
		{0, 0},  // before the first point: a at 10
		{10, 0}, // on a point: its owner
		{11, 1}, // b at 20
		{20, 1},
		{25, 2}, // c at 30
		{31, 0}, // a's second point at 40
		{41, 0}, // past the last point: wraps to a at 10
		{^uint64(0), 0},
	}
	r := handRing()
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.key), func(t *testing.T) {
			if got := r.Lookup(tt.key); got != tt.want {
				t.Errorf("Lookup(%d) = %d, want %d", tt.key, got, tt.want)
			}
		})
	}
}

func TestWalkHandComputed(t *testing.T) {
	tests := []struct {
		key  uint64
		want []int
	}{
		{5, []int{0, 1, 2}},
		{15, []int{1, 2, 0}},
		{35, []int{0, 1, 2}}, // a at 40, then wrap: a at 10 is skipped, b, c
		{25, []int{2, 0, 1}},
	}
	r := handRing()
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.key), func(t *testing.T) {
			var got []int
			r.Walk(tt.key, func(m int) bool { got = append(got, m); return true })
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Walk(%d) members (-want +got):\n%s", tt.key, diff)
			}
		})
	}
}

func TestWalkStops(t *testing.T) {
	r := handRing()
	var got []int
	r.Walk(15, func(m int) bool { got = append(got, m); return m != 2 })
	if diff := cmp.Diff([]int{1, 2}, got); diff != "" {
		t.Errorf("Walk stopping at member 2 (-want +got):\n%s", diff)
	}
}

func TestEmpty(t *testing.T) {
	for _, r := range []*Ring{New(nil, 0), {}} {
		if got := r.Lookup(42); got != -1 {
			t.Errorf("Lookup on empty ring = %d, want -1", got)
		}
		r.Walk(42, func(int) bool { t.Error("Walk on empty ring called fn"); return true })
	}
}

func TestNew(t *testing.T) {
	tests := []struct {
		members    []string
		vnodes     int
		wantPoints int
	}{
		{[]string{"a"}, 1, 1},
		{[]string{"a", "b", "c"}, 10, 30},
		{[]string{"a", "b"}, 0, 2 * DefaultVirtualNodes},
		{[]string{"a", "b"}, -3, 2 * DefaultVirtualNodes},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v/%d", tt.members, tt.vnodes), func(t *testing.T) {
			r := New(tt.members, tt.vnodes)
			if len(r.points) != 0 {
				t.Errorf("New placed %d points before any lookup", len(r.points))
			}
			r.place()
			if got := len(r.points); got != tt.wantPoints {
				t.Errorf("points = %d, want %d", got, tt.wantPoints)
			}
			if got, want := r.Len(), len(tt.members); got != want {
				t.Errorf("Len() = %d, want %d", got, want)
			}
			for j := 1; j < len(r.points); j++ {
				if r.points[j-1] > r.points[j] {
					t.Fatalf("points not sorted at %d", j)
				}
			}
		})
	}
}

// TestOrderIndependent checks that a key's owner depends on the set of
// members, not on their order.
func TestOrderIndependent(t *testing.T) {
	a := New([]string{"w1", "w2", "w3", "w4"}, 0)
	b := New([]string{"w4", "w2", "w1", "w3"}, 0)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 10_000 {
		k := rng.Uint64()
		if got, want := b.Member(b.Lookup(k)), a.Member(a.Lookup(k)); got != want {
			t.Fatalf("key %x: owner %s in reordered ring, want %s", k, got, want)
		}
	}
}

func TestWalkVisitsEveryMemberOnce(t *testing.T) {
	for _, n := range []int{1, 2, 7, 64, 65, 1025} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			r := New(names(n), 4)
			count := make([]int, n)
			r.Walk(12345, func(m int) bool { count[m]++; return true })
			for m, c := range count {
				if c != 1 {
					t.Fatalf("member %d visited %d times, want 1", m, c)
				}
			}
		})
	}
}

// owners returns each key's owner by name.
func owners(r *Ring, keys []uint64) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = r.Member(r.Lookup(k))
	}
	return out
}

func randomKeys(n int) []uint64 {
	rng := rand.New(rand.NewPCG(7, 11))
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	return keys
}

func TestAddMovesAboutOneNth(t *testing.T) {
	keys := randomKeys(10_000)
	before := owners(New([]string{"w1", "w2", "w3"}, 0), keys)
	after := owners(New([]string{"w1", "w2", "w3", "w4"}, 0), keys)
	moved := 0
	for i := range keys {
		if before[i] == after[i] {
			continue
		}
		moved++
		if after[i] != "w4" {
			t.Fatalf("key %x moved from %s to %s, want only moves to the new member w4", keys[i], before[i], after[i])
		}
	}
	if limit := len(keys)/4 + len(keys)*5/100; moved > limit {
		t.Errorf("adding a 4th member moved %d of %d keys, want at most %d (1/4 + 5%%)", moved, len(keys), limit)
	}
	t.Logf("adding a 4th member moved %d of %d keys", moved, len(keys))
}

func TestRemoveMovesOnlyItsKeys(t *testing.T) {
	keys := randomKeys(10_000)
	before := owners(New([]string{"w1", "w2", "w3", "w4"}, 0), keys)
	after := owners(New([]string{"w1", "w2", "w4"}, 0), keys)
	for i := range keys {
		if got, want := before[i] != after[i], before[i] == "w3"; got != want {
			t.Fatalf("key %x: owner %s before removing w3, %s after; moved = %t, want %t", keys[i], before[i], after[i], got, want)
		}
	}
}

func TestZeroAllocs(t *testing.T) {
	r := New(names(64), 0)
	var sink int
	allocs := testing.AllocsPerRun(100, func() {
		sink += r.Lookup(uint64(sink) * 0x9e3779b97f4a7c15)
		r.Walk(uint64(sink), func(m int) bool { sink += m; return true })
	})
	if allocs != 0 {
		t.Errorf("Lookup and Walk allocate %v times per run, want 0", allocs)
	}
}

func names(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("worker-%03d", i)
	}
	return out
}

func benchmarkLookup(b *testing.B, n int) {
	r := New(names(n), 0)
	keys := randomKeys(1024)
	b.ReportAllocs()
	var sink int
	for i := 0; b.Loop(); i++ {
		sink += r.Lookup(keys[i&1023])
	}
	_ = sink
}

func BenchmarkLookup8(b *testing.B)   { benchmarkLookup(b, 8) }
func BenchmarkLookup64(b *testing.B)  { benchmarkLookup(b, 64) }
func BenchmarkLookup256(b *testing.B) { benchmarkLookup(b, 256) }

// movedByRemoving returns the fraction of keys whose owner changes when
// the last of n members leaves, failing if a key moves that the leaving
// member did not own.
func movedByRemoving(t testing.TB, n int, keys []uint64) float64 {
	members := names(n)
	before := owners(New(members, 0), keys)
	gone := members[n-1]
	after := owners(New(members[:n-1], 0), keys)
	moved := 0
	for i := range keys {
		if before[i] == after[i] {
			continue
		}
		if before[i] != gone {
			t.Fatalf("n=%d: key %x moved from %s to %s, but only %s left", n, keys[i], before[i], after[i], gone)
		}
		moved++
	}
	return float64(moved) / float64(len(keys))
}

// TestRemoveMovesAboutOneNth measures the share of keys a departing member
// takes with it at several ring sizes: its own share, 1/N give or take the
// spread of 160 points per member.
func TestRemoveMovesAboutOneNth(t *testing.T) {
	keys := randomKeys(100_000)
	for _, n := range []int{3, 8, 16, 64, 256} {
		f := movedByRemoving(t, n, keys)
		t.Logf("removing 1 of %d members moved %.2f%% of keys (1/N = %.2f%%, ratio %.2f)", n, 100*f, 100/float64(n), f*float64(n))
		if r := f * float64(n); r < 0.5 || r > 1.5 {
			t.Errorf("removing 1 of %d members moved %.2f%% of keys, want within half of 1/N (%.2f%%)", n, 100*f, 100/float64(n))
		}
	}
}

// benchmarkMembershipChange measures the ring rebuild a pool does when
// one of n members leaves, and reports the share of keys that moved.
func benchmarkMembershipChange(b *testing.B, n int) {
	members := names(n)
	moved := movedByRemoving(b, n, randomKeys(20_000))
	b.ReportAllocs()
	for b.Loop() {
		New(members[:n-1], 0)
	}
	b.ReportMetric(moved*float64(n), "moved×N")
}

func BenchmarkMembershipChange8(b *testing.B)   { benchmarkMembershipChange(b, 8) }
func BenchmarkMembershipChange64(b *testing.B)  { benchmarkMembershipChange(b, 64) }
func BenchmarkMembershipChange256(b *testing.B) { benchmarkMembershipChange(b, 256) }
