package kvindex

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkApplyChurn measures the cache events of a busy fleet on an
// index of about a million blocks, its table half full as it is before it
// grows: in turn, each worker removes its oldest chain of 32 blocks and
// stores a fresh one, as its engine's cache churns. ns/block is the cost
// of one block event, stored or removed.
func BenchmarkApplyChurn(b *testing.B) {
	for _, workers := range []int{8, 1000} {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M", workers), func(b *testing.B) {
			f := newScaleFleet(b, workers, 900_000)
			rng := rand.New(rand.NewPCG(15, 16))
			// Each worker's chains, oldest first: its snapshot's are
			// unknown here, so it churns chains of its own on top.
			held := make([][][]uint64, workers)
			fresh := func() []uint64 {
				ks := make([]uint64, 32)
				for i := range ks {
					ks[i] = rng.Uint64()
				}
				return ks
			}
			apply := func(w int, kind CacheKind, keys []uint64) {
				f.seq[w]++
				ce := CacheEvent{Kind: kind, Keys: keys}
				if err := f.x.Apply(f.names[w], Event{Seq: f.seq[w], Cache: &ce}); err != nil {
					b.Fatal(err)
				}
			}
			var ws []int
			for w := range workers {
				if f.seq[w] > 0 {
					ws = append(ws, w)
					for range 4 {
						held[w] = append(held[w], fresh())
						apply(w, Stored, held[w][len(held[w])-1])
					}
				}
			}
			// Fresh chains made ahead, so that the loop measures the index.
			pool := make([][]uint64, 4*len(ws))
			for i := range pool {
				pool[i] = fresh()
			}
			b.ReportAllocs()
			blocks := 0
			for i := 0; b.Loop(); i++ {
				w := ws[i%len(ws)]
				old := held[w][0]
				apply(w, Removed, old)
				ks := pool[i%len(pool)]
				pool[i%len(pool)] = old // stored again later, elsewhere
				held[w] = append(held[w][1:], ks)
				apply(w, Stored, ks)
				blocks += 2 * len(ks)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(blocks), "ns/block")
		})
	}
}

// BenchmarkApplyAtCap measures stored events of fresh blocks on an index
// at its cap, as a busy fleet's whose caches hold more than MaxBlocks: each
// block stored forgets the least recently touched one. ns/block is the
// cost of one stored block, its eviction included.
func BenchmarkApplyAtCap(b *testing.B) {
	for _, workers := range []int{8, 1000} {
		b.Run(fmt.Sprintf("workers=%d/blocks=4M", workers), func(b *testing.B) {
			const capBlocks = 4 << 20
			x := New(Config{MaxBlocks: capBlocks})
			names := make([]string, workers)
			seq := make([]uint64, workers)
			for w := range names {
				names[w] = fmt.Sprintf("w%04d", w)
				if err := x.Apply(names[w], snapshot(nil)); err != nil {
					b.Fatal(err)
				}
				seq[w] = 1
			}
			rng := rand.New(rand.NewPCG(17, 18))
			keys := make([]uint64, 32)
			store := func(w int) {
				for i := range keys {
					keys[i] = rng.Uint64()
				}
				seq[w]++
				ce := CacheEvent{Kind: Stored, Keys: keys}
				if err := x.Apply(names[w], Event{Seq: seq[w], Cache: &ce}); err != nil {
					b.Fatal(err)
				}
			}
			for i := 0; x.Len() < capBlocks; i++ {
				store(i % workers)
			}
			for range capBlocks / 32 / 4 { // a quarter of the cap turned over: the LRU list shuffled
				store(rng.IntN(workers))
			}
			b.ReportAllocs()
			blocks := 0
			for b.Loop() {
				store(rng.IntN(workers))
				blocks += len(keys)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(blocks), "ns/block")
		})
	}
}
