package watch

import (
	"math/rand/v2"
	"testing"
)

// TestDigests checks the table against a map through random sets and
// deletions, on digests that collide in their home slots (small and
// aligned integers) as well as random ones.
func TestDigests(t *testing.T) {
	for name, digest := range map[string]func(r *rand.Rand) uint64{
		"random":  func(r *rand.Rand) uint64 { return r.Uint64() },
		"small":   func(r *rand.Rand) uint64 { return r.Uint64N(300) },
		"aligned": func(r *rand.Rand) uint64 { return r.Uint64N(300) << 40 },
	} {
		t.Run(name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, 2))
			var tab digests
			want := make(map[uint64]int32)
			for i := range 20000 {
				d := digest(r)
				switch r.IntN(3) {
				case 0, 1:
					tab.set(d, int32(i))
					want[d] = int32(i)
				case 2:
					tab.del(d)
					delete(want, d)
				}
				if tab.len() != len(want) {
					t.Fatalf("step %d: %d digests, want %d", i, tab.len(), len(want))
				}
			}
			for d, el := range want {
				if got, ok := tab.get(d); !ok || got != el {
					t.Errorf("get(%d) = %d, %v; want %d", d, got, ok, el)
				}
			}
			for range 1000 {
				d := digest(r)
				_, ok := tab.get(d)
				if _, in := want[d]; ok != in {
					t.Errorf("get(%d) found %v, want %v", d, ok, in)
				}
			}
			tab.reset()
			if _, ok := tab.get(digest(r)); ok || tab.len() != 0 {
				t.Error("a reset table maps digests")
			}
		})
	}
}
