package routing

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// BenchmarkKVAwareWhileCommitting measures kv_aware's decision while
// another goroutine commits other decisions, each predicting a prompt of
// 720 blocks (an agentic session's ~11,500 tokens) on a worker, as the
// front end does between picks. It reports the decision's p50 and p99:
// a commit holding the block table's lock delays the lookups behind it.
func BenchmarkKVAwareWhileCommitting(b *testing.B) {
	for _, pause := range []time.Duration{0, 200 * time.Microsecond} {
		name := "committing=none"
		if pause > 0 {
			name = fmt.Sprintf("committing=every_%v", pause)
		}
		b.Run(name, func(b *testing.B) {
			const n = 8
			rng := rand.New(rand.NewPCG(7, 8))
			f, held := newHeldFleet(b, n, 1<<20, rng)
			per := len(held[0])
			const prompts = 64
			reqs := make([]*Request, prompts)
			for p := range reqs {
				ks := append(append([]uint64(nil), held[p%n][p*300%(per-720):][:600]...), prompt(uint64(p))[:120]...)
				reqs[p] = kvRequest(ks)
			}
			chains := make([][]uint64, 256)
			for i := range chains {
				chains[i] = make([]uint64, 720)
				for j := range chains[i] {
					chains[i][j] = rng.Uint64()
				}
			}
			s := f.strategy(Params{ConcurrencyThreshold: 1024}, Deps{})
			snap := f.snap()
			names := make([]string, n)
			for i, w := range snap.Workers {
				names[i] = w.Name
			}
			stop := make(chan struct{})
			var wg sync.WaitGroup
			if pause > 0 {
				wg.Go(func() {
					for i := 0; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						f.idx.Predict(names[i%n], chains[i%len(chains)])
						for t0 := time.Now(); time.Since(t0) < pause; {
							runtime.Gosched()
						}
					}
				})
			}
			lat := make([]time.Duration, 0, 1<<16)
			runtime.GC()
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				t0 := time.Now()
				if _, err := s.Pick(reqs[i%prompts], snap); err != nil {
					b.Fatal(err)
				}
				if len(lat) < cap(lat) {
					lat = append(lat, time.Since(t0))
				}
			}
			close(stop)
			wg.Wait()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}
