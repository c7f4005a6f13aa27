package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
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

// lookupAll looks keys up over every worker in one call, as the router
// does, and returns the match of the last.
func (f *scaleFleet) lookupAll(keys []uint64, out []Match) Match {
	f.x.Lookup(keys, f.names, out)
	return out[len(f.names)-1]
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
			// Once round first, so that the loop finds the table grown.
			for w := range workers {
				if f.seq[w] == 0 {
					continue
				}
				for _, kind := range []CacheKind{Stored, Removed} {
					ce.Kind, ce.Keys = kind, ks[w]
					f.seq[w]++
					if err := f.x.Apply(f.names[w], Event{Seq: f.seq[w], Cache: &ce}); err != nil {
						b.Fatal(err)
					}
				}
			}
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

// newMatchFleet is a fleet of workers over 1 Mi blocks and the prompt of
// the match benchmarks: 500 blocks, the first 300 held by the last worker,
// the rest by none.
func newMatchFleet(b *testing.B, workers int) (*scaleFleet, []uint64) {
	f := newScaleFleet(b, workers, 1<<20)
	held := keys(1<<30, 1<<30+300)
	if f.x.Apply(f.names[workers-1], event(f.seq[workers-1]+1, stored(gpu, held))) == nil {
		f.seq[workers-1]++
	}
	return f, append(append([]uint64(nil), held...), keys(0, 200)...)
}

// BenchmarkMatchQuery measures the match query of a request of 500 blocks
// over every worker of the fleet, in one Lookup: the first 300 held by
// the last worker, the rest by none.
func BenchmarkMatchQuery(b *testing.B) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", workers), func(b *testing.B) {
			f, ks := newMatchFleet(b, workers)
			out := make([]Match, workers)
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

// A fleet of a thousand workers is indexed whole: each worker's blocks,
// in every tier, count for it alone, whichever group it sits in, looked up
// in one call or in the router's batches.
func TestThousandWorkers(t *testing.T) {
	const n = 1000
	x := New(Config{})
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("w%04d", i)
		// Worker i holds blocks 0..i%50 in GPU, then two more in CPU.
		ks := keys(0, uint64(i%50+3))
		mustApply(t, x, names[i], snapshot(nil, stored(gpu, ks[:i%50+1]), stored(cpu, ks[i%50+1:])))
	}
	prompt := keys(0, 60)
	out := make([]Match, n)
	x.Lookup(prompt, names, out)
	for i, m := range out {
		if want := (hit{i%50 + 1, 2, 0}); (hit{m.GPU, m.CPU, m.Redis}) != want || !m.Known {
			t.Fatalf("%s: %+v (known %t), want %+v", names[i], hit{m.GPU, m.CPU, m.Redis}, m.Known, want)
		}
	}
	// The router's batches: a batch spanning two groups.
	batch := names[40:104]
	x.Lookup(prompt, batch, out)
	for i, m := range out[:len(batch)] {
		if got, want := m.GPU, (40+i)%50+1; got != want {
			t.Fatalf("%s in a batch: GPU %d, want %d", batch[i], got, want)
		}
	}
	// Removal frees the slot of the last group's worker and only its.
	x.RemoveWorker(names[999])
	x.Lookup(prompt, names[990:], out)
	if out[9].Known || out[9].GPU != 0 || out[8].GPU != 998%50+1 {
		t.Errorf("after removing %s: %+v, %+v", names[999], out[9], out[8])
	}
	// Predictions on a worker of a later group.
	x.Predict(names[700], keys(100, 110))
	if got := lookup(x, keys(100, 110), names[700], names[701]); got[names[700]] != (hit{10, 0, 0}) || got[names[701]] != (hit{}) {
		t.Errorf("predicted on %s: %+v", names[700], got)
	}
}

// The shared Redis tier holds blocks for the fleet: a block one worker
// reports stored there counts for the Redis-tier workers of every group.
func TestRedisAcrossGroups(t *testing.T) {
	x := New(Config{})
	names := make([]string, 2*MaxWorkers)
	for i := range names {
		names[i] = fmt.Sprintf("w%03d", i)
		mustApply(t, x, names[i], snapshot(nil))
		if err := x.SetInfo(names[i], Info{RedisTier: true}); err != nil {
			t.Fatal(err)
		}
	}
	ks := keys(0, 8)
	mustApply(t, x, names[0], event(2, stored(redis, ks)))
	if got := lookup(x, ks, names[0], names[MaxWorkers+1]); got[names[MaxWorkers+1]] != (hit{0, 0, 8}) {
		t.Errorf("Redis blocks seen from another group: %+v, want 8", got)
	}
	mustApply(t, x, names[0], event(3, cache(Removed, redis, ks)))
	if got := lookup(x, ks, names[MaxWorkers+1])[names[MaxWorkers+1]]; got != (hit{}) {
		t.Errorf("after Redis dropped them: %+v", got)
	}
}

// The cap bounds the blocks of the whole fleet, whatever the groups: two
// full groups hold at most MaxBlocks between them, the least recently
// touched forgotten first.
func TestCapSharedAmongGroups(t *testing.T) {
	const capBlocks = 4096
	x := New(Config{MaxBlocks: capBlocks})
	for i := range 2 * MaxWorkers {
		name := fmt.Sprintf("w%03d", i)
		mustApply(t, x, name, snapshot(nil, stored(gpu, keys(uint64(i)*1000, uint64(i)*1000+100))))
	}
	if got := x.Len(); got > capBlocks {
		t.Errorf("Len = %d, want at most %d", got, capBlocks)
	}
	// The last worker's blocks, the most recent, are kept.
	last := fmt.Sprintf("w%03d", 2*MaxWorkers-1)
	k := uint64(2*MaxWorkers-1) * 1000
	if got := lookup(x, keys(k, k+100), last)[last]; got.GPU != 100 {
		t.Errorf("%s holds %d of its 100 blocks", last, got.GPU)
	}
	if x.Evicted() == 0 {
		t.Error("nothing evicted")
	}
}

// visits collects a Visit's matches.
type visits []Match

func (v *visits) VisitMatch(i int, m *Match) {
	if i != len(*v) {
		panic(fmt.Sprintf("visited %d after %d matches", i, len(*v)))
	}
	*v = append(*v, *m)
}

// Visit hands the visitor, worker by worker, what Lookup writes: over
// several groups, with unknown workers, in the order of the names.
func TestVisitIsLookup(t *testing.T) {
	now := time.Unix(1000, 0)
	x := New(Config{Now: func() time.Time { return now }})
	names := make([]string, 3*MaxWorkers)
	for i := range names {
		names[i] = fmt.Sprintf("w%03d", i)
		if i%7 == 3 {
			continue // never indexed
		}
		ks := keys(0, uint64(i%40+3))
		mustApply(t, x, names[i], snapshot(&Load{Running: i}, stored(gpu, ks[:i%40+1]), stored(cpu, ks[i%40+1:])))
		if err := x.SetInfo(names[i], Info{BlockTokens: 16 + i%3, RedisTier: i%2 == 0}); err != nil {
			t.Fatal(err)
		}
	}
	mustApply(t, x, names[0], event(2, stored(redis, keys(0, 50))))
	x.Predict(names[100], keys(0, 45))
	for _, prompt := range [][]uint64{nil, keys(0, 50), keys(1000, 1010)} {
		order := slices.Clone(names)
		rand.New(rand.NewPCG(1, 2)).Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		want := make([]Match, len(order))
		x.Lookup(prompt, order, want)
		var got visits
		x.Visit(prompt, order, &got)
		if d := cmp.Diff([]Match(want), []Match(got)); d != "" {
			t.Errorf("prompt of %d keys: Visit differs from Lookup (-Lookup +Visit):\n%s", len(prompt), d)
		}
	}
}

// A worker's state is read without its lock, yet whole: each load report
// below has every field equal, and no lookup may see two reports mixed.
func TestWorkerStateReadWhole(t *testing.T) {
	x := New(Config{})
	mustApply(t, x, "w0", snapshot(nil))
	var wg sync.WaitGroup
	wg.Go(func() {
		for seq := uint64(2); seq < 50000; seq++ {
			v := int64(seq)
			l := Load{Running: int(v), Waiting: int(v), WaitingPrefillTokens: v, GPUBlocksUsed: v, GPUBlocksTotal: v,
				CPUBlocksUsed: v, CPUBlocksTotal: v, Slots: int(v)}
			if err := x.Apply("w0", loadEvent(seq, l)); err != nil {
				t.Error(err)
				return
			}
		}
	})
	for range 2 {
		wg.Go(func() {
			out := make([]Match, 1)
			for range 50000 {
				x.Lookup(nil, []string{"w0"}, out)
				l := out[0].Load
				v := int64(l.Running)
				if int64(l.Waiting) != v || l.WaitingPrefillTokens != v || l.GPUBlocksUsed != v || l.GPUBlocksTotal != v ||
					l.CPUBlocksUsed != v || l.CPUBlocksTotal != v || int64(l.Slots) != v {
					t.Errorf("torn load report: %+v", l)
					return
				}
			}
		})
	}
	wg.Wait()
}

// Overlaps lists the workers holding a prompt's first block, in GPU or
// CPU, with the counts Lookup gives them when no worker reads the Redis
// tier, whatever their group; the Redis tier changes none of them.
func TestOverlapsAreLookupsHolders(t *testing.T) {
	now := time.Unix(1000, 0)
	x := New(Config{Now: func() time.Time { return now }})
	names := make([]string, 3*MaxWorkers)
	for i := range names {
		names[i] = fmt.Sprintf("w%03d", i)
		switch {
		case i%5 == 0: // holds blocks of another prompt
			mustApply(t, x, names[i], snapshot(nil, stored(gpu, keys(500, 520))))
		case i%5 == 1: // holds the prompt from its second block only
			mustApply(t, x, names[i], snapshot(nil, stored(gpu, keys(1, 20))))
		default:
			ks := keys(0, uint64(i%30+3))
			mustApply(t, x, names[i], snapshot(nil, stored(gpu, ks[:i%30+1]), stored(cpu, ks[i%30+1:])))
		}
	}
	mustApply(t, x, names[0], event(2, stored(redis, keys(0, 40))))
	x.Predict(names[5], keys(0, 12))
	x.RemoveWorker(names[2])
	prompt := keys(0, 40)
	all := make([]Match, len(names))
	x.Lookup(prompt, names, all)
	want := map[string]Overlap{}
	for i, m := range all {
		if m.GPU+m.CPU > 0 {
			want[names[i]] = Overlap{Worker: names[i], GPU: m.GPU, CPU: m.CPU}
		}
	}
	overlaps := func() map[string]Overlap {
		got := map[string]Overlap{}
		for _, o := range x.Overlaps(prompt, nil) {
			if _, dup := got[o.Worker]; dup {
				t.Errorf("%s listed twice", o.Worker)
			}
			got[o.Worker] = o
		}
		return got
	}
	if d := cmp.Diff(want, overlaps()); d != "" {
		t.Errorf("Overlaps (-Lookup's holders +Overlaps):\n%s", d)
	}
	if got := want[names[5]].GPU; got != 12 {
		t.Errorf("predicted %s: %d GPU blocks, want 12", names[5], got)
	}
	for _, name := range names {
		if name != names[2] {
			if err := x.SetInfo(name, Info{RedisTier: true}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if d := cmp.Diff(want, overlaps()); d != "" {
		t.Errorf("Overlaps with the Redis tier (-without +with):\n%s", d)
	}
	if o := x.Overlaps(keys(900, 910), nil); len(o) != 0 {
		t.Errorf("a prompt no worker holds: %+v, want none", o)
	}
}

// sink is a visitor that keeps what a match query's caller would read.
type sink struct{ gpu int }

func (s *sink) VisitMatch(_ int, m *Match) { s.gpu = max(s.gpu, m.GPU) }

// BenchmarkVisitQuery is BenchmarkMatchQuery through Visit, as kv_aware
// reads the index: no array of matches.
func BenchmarkVisitQuery(b *testing.B) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", workers), func(b *testing.B) {
			f, ks := newMatchFleet(b, workers)
			var s sink
			b.ReportAllocs()
			for b.Loop() {
				f.x.Visit(ks, f.names, &s)
			}
			b.ReportMetric(float64(s.gpu), "hit")
		})
	}
}

// BenchmarkOverlaps is BenchmarkMatchQuery's prompt as a sparse match:
// the overlaps of the workers holding it, no worker's state.
func BenchmarkOverlaps(b *testing.B) {
	benchOverlaps(b, "keys=500", newMatchFleet, func(b *testing.B, f *scaleFleet, out []Overlap) {
		if len(out) != 1 || out[0].GPU != 300 {
			b.Fatalf("overlaps %+v, want %s's 300 blocks", out, f.names[len(f.names)-1])
		}
	})
}

// benchOverlaps runs Overlaps of each fleet's prompt (fleet builds them)
// at every scale, then hands the last answer to done.
func benchOverlaps(b *testing.B, keys string, fleet func(*testing.B, int) (*scaleFleet, []uint64), done func(*testing.B, *scaleFleet, []Overlap)) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/%s", workers, keys), func(b *testing.B) {
			f, ks := fleet(b, workers)
			out := make([]Overlap, 0, workers)
			b.ReportAllocs()
			for b.Loop() {
				out = f.x.Overlaps(ks, out[:0])
			}
			done(b, f, out)
		})
	}
}

// A fleet's blocks in several groups are walked once for all of them, yet
// each worker finds what it finds looked up alone: chains of random
// lengths in each tier, shortened by removals, with predictions and the
// Redis tier, prompts of every length. (Where a cache has a hole in
// mid-chain, a walk that leaps over it counts past it; a walk for more
// workers reads more blocks, and may not.)
func TestWalkAcrossGroupsIsEachGroupsWalk(t *testing.T) {
	now := time.Unix(1000, 0)
	x := New(Config{Now: func() time.Time { return now }})
	rng := rand.New(rand.NewPCG(21, 22))
	names := make([]string, 3*MaxWorkers+5)
	holed := map[string]bool{}
	const chain = 300
	for i := range names {
		names[i] = fmt.Sprintf("w%03d", i)
		// Worker i holds the prompt's first g blocks in GPU, the next c in
		// CPU, less a hole or two; some hold a prefix of another prompt.
		g, c := rng.IntN(chain), rng.IntN(40)
		ks := keys(0, uint64(min(g+c, chain)))
		var evs []CacheEvent
		if rng.IntN(8) == 0 {
			evs = append(evs, stored(gpu, keys(10_000, 10_000+uint64(rng.IntN(50)))))
		}
		evs = append(evs, stored(gpu, ks[:min(g, len(ks))]), stored(cpu, ks[min(g, len(ks)):]))
		mustApply(t, x, names[i], snapshot(nil, evs...))
		seq := uint64(2)
		cutGPU := false
		if len(ks) > 0 && rng.IntN(4) == 0 {
			cut := rng.IntN(len(ks))
			tier := gpu
			if cut >= g {
				tier = cpu
			}
			cutGPU = tier == gpu && cut < min(g, len(ks)) && g < len(ks)
			mustApply(t, x, names[i], event(seq, cache(Removed, tier, ks[cut:])))
			seq++
		}
		if rng.IntN(3) == 0 {
			if err := x.SetInfo(names[i], Info{RedisTier: true}); err != nil {
				t.Fatal(err)
			}
			// The Redis tier fills the hole the cut left before the CPU
			// blocks: a hole in mid-chain, which walks may see apart.
			holed[names[i]] = cutGPU
		}
		if i == 7 {
			mustApply(t, x, names[i], event(seq, stored(redis, keys(0, 260))))
		}
		if rng.IntN(10) == 0 {
			x.Predict(names[i], keys(0, uint64(rng.IntN(chain))))
		}
	}
	all := make([]Match, len(names))
	one := make([]Match, 1)
	for _, n := range []int{1, 2, 7, 8, 9, 17, 100, 299, 300, 301} {
		prompt := keys(0, uint64(n))
		x.Lookup(prompt, names, all)
		for i, name := range names {
			x.Lookup(prompt, []string{name}, one)
			if got, want := (hit{all[i].GPU, all[i].CPU, all[i].Redis}), (hit{one[0].GPU, one[0].CPU, one[0].Redis}); got != want && !holed[name] {
				t.Fatalf("prompt of %d keys, %s: %+v among all, %+v alone", n, name, got, want)
			}
		}
		holders := map[string]Overlap{}
		for _, o := range x.Overlaps(prompt, nil) {
			holders[o.Worker] = o
		}
		for i, name := range names {
			x.Lookup(prompt, []string{name}, one)
			if one[0].Redis == 0 || all[i].GPU+all[i].CPU == 0 {
				if o := holders[name]; o.GPU != all[i].GPU || o.CPU != all[i].CPU {
					t.Fatalf("prompt of %d keys, %s: overlap %+v, Lookup %+v", n, name, o, hit{all[i].GPU, all[i].CPU, all[i].Redis})
				}
			}
		}
	}
}

// newSharedFleet is newScaleFleet's fleet with a prefix of 64 blocks every
// worker holds besides (a system prompt), and the prompt of the shared
// benchmarks: that prefix, then 200 blocks the last worker holds after it.
func newSharedFleet(b *testing.B, workers int) (*scaleFleet, []uint64) {
	f := newScaleFleet(b, workers, 1<<20)
	shared := keys(1<<40, 1<<40+64)
	own := keys(1<<41, 1<<41+200)
	for w := range workers {
		if f.seq[w] == 0 {
			continue
		}
		ks := shared
		if w == workers-1 {
			ks = append(append([]uint64(nil), shared...), own...)
		}
		f.seq[w]++
		if err := f.x.Apply(f.names[w], event(f.seq[w], stored(gpu, ks))); err != nil {
			b.Fatal(err)
		}
	}
	return f, append(append([]uint64(nil), shared...), own...)
}

// BenchmarkSharedOverlaps is the sparse match of a prompt whose first 64
// blocks every worker holds and whose next 200 one worker holds.
func BenchmarkSharedOverlaps(b *testing.B) {
	benchOverlaps(b, "keys=264", newSharedFleet, func(b *testing.B, _ *scaleFleet, out []Overlap) {
		b.ReportMetric(float64(len(out)), "holders")
	})
}

// BenchmarkSharedEvent stores and removes 16 blocks of the shared prefix
// on the workers in turn: blocks every worker holds.
func BenchmarkSharedEvent(b *testing.B) {
	for _, workers := range scaleWorkers {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M", workers), func(b *testing.B) {
			f, ks := newSharedFleet(b, workers)
			ce := CacheEvent{Keys: ks[32:48]}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				w := (i / 2) % workers
				if f.seq[w] == 0 {
					w %= MaxWorkers // a worker the index took
				}
				ce.Kind = Removed
				if i%2 == 1 {
					ce.Kind = Stored
				}
				f.seq[w]++
				if err := f.x.Apply(f.names[w], Event{Seq: f.seq[w], Cache: &ce}); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// A snapshot replaces the worker's blocks across the whole table, which
// it scans a chunk at a time.
func TestSnapshotClearsEveryChunk(t *testing.T) {
	x := New(Config{})
	const n = scanChunk + scanChunk/2
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(0, n))))
	mustApply(t, x, "b", snapshot(nil, stored(cpu, keys(n-10, n))))
	mustApply(t, x, "a", snapshot(nil, stored(gpu, keys(2*n, 2*n+10))))
	if got, want := x.Len(), 20; got != want {
		t.Errorf("Len = %d after a's second snapshot, want %d", got, want)
	}
	got := lookup(x, keys(n-10, n), "a", "b")
	if got["a"] != (hit{}) || got["b"] != (hit{0, 10, 0}) {
		t.Errorf("a's old blocks, held by b in CPU: %+v", got)
	}
	if got := lookup(x, keys(2*n, 2*n+10), "a")["a"]; got != (hit{10, 0, 0}) {
		t.Errorf("a's new blocks: %+v", got)
	}
}
