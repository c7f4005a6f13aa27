package routing

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkPick measures one decision per iteration over a pool of healthy
// workers with a few requests in flight, the prefix key changing every
// iteration.
func BenchmarkPick(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, 1024)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	for _, name := range []string{Random, RoundRobin, LeastOutstanding, PrefixAware} {
		for _, n := range []int{8, 64, 256} {
			b.Run(fmt.Sprintf("%s/workers=%d", name, n), func(b *testing.B) {
				f := newFleet(b, n)
				for i, w := range f.snap().Workers {
					f.load(w.Name, i%4)
				}
				var r Registry
				RegisterBuiltins(&r)
				s, err := r.New(name, Params{}, Deps{})
				if err != nil {
					b.Fatal(err)
				}
				snap := f.snap()
				req := &Request{Model: "llama"}
				b.ReportAllocs()
				for i := 0; b.Loop(); i++ {
					req.PrefixKey = keys[i&1023]
					if _, err := s.Pick(req, snap); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkPickSpill measures prefix_aware when every home is at the
// threshold, so each decision also scans for the least-loaded worker.
func BenchmarkPickSpill(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, 1024)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	for _, n := range []int{8, 64, 256} {
		b.Run(fmt.Sprintf("workers=%d", n), func(b *testing.B) {
			f := newFleet(b, n)
			for i, w := range f.snap().Workers {
				f.load(w.Name, 1+i%4)
			}
			s, err := NewPrefixAware(Params{ConcurrencyThreshold: 1}, Deps{})
			if err != nil {
				b.Fatal(err)
			}
			snap := f.snap()
			req := &Request{Model: "llama"}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				req.PrefixKey = keys[i&1023]
				if _, err := s.Pick(req, snap); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
