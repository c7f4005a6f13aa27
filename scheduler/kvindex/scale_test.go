package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
)

// scaleFleet is an index of about blocks blocks spread over workers
// workers' GPU tiers as chains of 32, as the fleet's engines would hold
// them; names are the workers', indexed how many the index took.
type scaleFleet struct {
	x       *Index
	names   []string
	seq     []uint64
	chains  [][]uint64
	indexed int
}

func newScaleFleet(tb testing.TB, workers, blocks int) *scaleFleet {
	f := &scaleFleet{x: New(Config{MaxBlocks: 2 * blocks}), seq: make([]uint64, workers)}
	rng := rand.New(rand.NewPCG(11, 12))
	per := max(blocks/workers, 32)
	for w := range workers {
		name := fmt.Sprintf("w%04d", w)
		f.names = append(f.names, name)
		var evs []CacheEvent
		for c := 0; c < per; c += 32 {
			ks := make([]uint64, 32)
			for i := range ks {
				ks[i] = rng.Uint64()
			}
			evs = append(evs, stored(gpu, ks))
			if c == 0 {
				f.chains = append(f.chains, ks)
			}
		}
		switch err := f.x.Apply(name, snapshot(nil, evs...)); {
		case err == nil:
			f.indexed++
			f.seq[w] = 1
		case errors.Is(err, ErrTooManyWorkers):
		default:
			tb.Fatal(err)
		}
	}
	return f
}

// lookupAll looks keys up over every worker in batches of MaxWorkers, as
// the router does, and returns the match of the last.
func (f *scaleFleet) lookupAll(keys []uint64, out []Match) Match {
	var last Match
	for lo := 0; lo < len(f.names); lo += MaxWorkers {
		hi := min(lo+MaxWorkers, len(f.names))
		f.x.Lookup(keys, f.names[lo:hi], out)
		last = out[hi-lo-1]
	}
	return last
}

var scaleWorkers = []int{8, 64, 256, 1000}

// BenchmarkApplyEvent measures one cache event of 16 blocks on an index
// of a million blocks: events store a chain on a worker, then remove it,
// the workers taking turns.
func BenchmarkApplyEvent(b *testing.B) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M", workers), func(b *testing.B) {
			f := newScaleFleet(b, workers, 1<<20)
			rng := rand.New(rand.NewPCG(13, 14))
			ks := make([][]uint64, workers)
			for w := range ks {
				ks[w] = make([]uint64, 16)
				for i := range ks[w] {
					ks[w][i] = rng.Uint64()
				}
			}
			var ce CacheEvent
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				w := (i / 2) % workers
				if f.seq[w] == 0 {
					w %= MaxWorkers // a worker the index took
				}
				ce.Kind, ce.Keys = Stored, ks[w]
				if i%2 == 1 {
					ce.Kind = Removed
				}
				f.seq[w]++
				if err := f.x.Apply(f.names[w], Event{Seq: f.seq[w], Cache: &ce}); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(float64(f.indexed), "indexed")
		})
	}
}

// BenchmarkMatchQuery measures the match query of a request of 500 blocks
// over every worker of the fleet: the first 300 held by the last worker,
// the rest by none.
func BenchmarkMatchQuery(b *testing.B) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", workers), func(b *testing.B) {
			f := newScaleFleet(b, workers, 1<<20)
			last := f.names[workers-1]
			held := keys(1<<30, 1<<30+300)
			if f.x.Apply(last, event(f.seq[workers-1]+1, stored(gpu, held))) == nil {
				f.seq[workers-1]++
			}
			ks := append(append([]uint64(nil), held...), keys(0, 200)...)
			out := make([]Match, MaxWorkers)
			b.ReportAllocs()
			var m Match
			for b.Loop() {
				m = f.lookupAll(ks, out)
			}
			b.ReportMetric(float64(m.GPU), "hit")
			b.ReportMetric(float64(f.indexed), "indexed")
		})
	}
}
