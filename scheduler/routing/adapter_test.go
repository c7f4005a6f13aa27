package routing

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
)

// Every strategy, built-in or custom, sends a request for an adapter only
// to the workers that hold it, and fails with ErrNoWorker when none does.
func TestAdapterOnlyToHolders(t *testing.T) {
	f := newFleet(t, 0)
	for _, name := range []string{"a", "b", "c", "d"} {
		f.add(name, "llama")
	}
	f.worker("b").AddAdapter("sql")
	f.worker("d").AddAdapter("sql")
	f.worker("c").AddAdapter("chat")
	want := map[string]bool{"b": true, "d": true}

	var reg Registry
	RegisterBuiltins(&reg)
	if err := reg.RegisterProfile(ProfileConfig{Name: "bare", Filters: []PartConfig{{Type: "available"}}, Scorers: []ScorerConfig{{Name: "load"}}}); err != nil {
		t.Fatal(err)
	}
	strategies := builtins(t, Params{}, Deps{Rand: SeededRand(1)})
	bare, err := reg.New("bare", Params{}, Deps{Rand: SeededRand(1)})
	if err != nil {
		t.Fatal(err)
	}
	strategies = append(strategies, bare)
	rng := rand.New(rand.NewPCG(2, 2))
	for _, s := range strategies {
		t.Run(s.Name(), func(t *testing.T) {
			got := map[string]bool{}
			for range 200 {
				d := pick(t, s, &Request{Model: "llama", Adapter: "sql", PrefixKey: rng.Uint64(), Keys: []uint64{rng.Uint64()}, Tokens: 16}, f.snap())
				got[d.Worker.Name] = true
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("workers picked for adapter sql (-want +got):\n%s", diff)
			}
			if d, err := s.Pick(&Request{Model: "llama", Adapter: "math", PrefixKey: 1}, f.snap()); !errors.Is(err, ErrNoWorker) {
				t.Errorf("Pick(adapter nobody holds) = %v, %v; want ErrNoWorker", d.Worker, err)
			}
			base := map[string]bool{}
			for range 200 {
				d := pick(t, s, &Request{Model: "llama", PrefixKey: rng.Uint64(), Keys: []uint64{rng.Uint64()}, Tokens: 16}, f.snap())
				base[d.Worker.Name] = true
			}
			if len(base) != 4 {
				t.Errorf("base-model requests went to %v, want every worker", base)
			}
		})
	}
}

func TestAdapterPickDoesNotAllocate(t *testing.T) {
	skipUnderRace(t)
	f := newFleet(t, 16)
	for i, w := range f.snap().Workers {
		if i%3 == 0 {
			w.AddAdapter("sql")
		}
	}
	req := &Request{Model: "llama", Adapter: "sql", PrefixKey: 42}
	for _, s := range builtins(t, Params{}, Deps{}) {
		if s.Name() == KVAware {
			continue // its requests carry keys: TestKVAwareDoesNotAllocate
		}
		snap := f.snap()
		if _, err := s.Pick(req, snap); err != nil {
			t.Fatal(err)
		}
		if n := testing.AllocsPerRun(100, func() { _, _ = s.Pick(req, snap) }); n != 0 {
			t.Errorf("%s: Pick of an adapter request allocates %v times, want 0", s.Name(), n)
		}
	}
}

// kv_aware counts the load of an adapter onto a worker that lacks it: a
// holder whose queue costs less than the load beats a cold worker, one
// whose queue costs more does not; the load is the adapter's size over the
// worker's host link, or the load time measured there. Without
// Request.LoadAdapter only holders are candidates.
func TestKVAwareCountsAdapterLoad(t *testing.T) {
	f := newKVFleet(t, 2)
	holder, cold := f.worker("w00"), f.worker("w01")
	for _, w := range []string{"w00", "w01"} {
		f.info(w, false, 0)
		f.worker(w).SetAdapterSlots(2)
	}
	holder.AddAdapter("sql")
	f.report("w00", &workerpb.LoadReport{WaitingPrefillTokens: 4096})
	s := f.strategy(Params{}, Deps{})
	req := func(load bool, bytes int64) *Request {
		r := kvRequest(prompt(7)[:16])
		r.Adapter, r.LoadAdapter, r.AdapterBytes = "sql", load, bytes
		return r
	}
	// With a free load the cold worker wins by the holder's queue.
	free := pick(t, s, req(true, 0), f.snap())
	held := pick(t, s, req(false, 0), f.snap())
	if free.Worker != cold || held.Worker != holder {
		t.Fatalf("free load picks %s, holders only %s; want w01, w00", free.Worker.Name, held.Worker.Name)
	}
	gap := (held.Estimate - free.Estimate).Seconds()
	if gap <= 0.1*held.Estimate.Seconds() {
		t.Fatalf("the holder's queue adds %vs to %v: too little to test", gap, held.Estimate)
	}
	pcie := kvindex.DefaultCost.PCIeBytesPerSecond
	for _, tc := range []struct {
		name     string
		bytes    int64
		measured time.Duration
		want     *pool.Worker
	}{
		{"load shorter than the queue", int64(gap / 2 * pcie), 0, cold},
		{"load longer than the queue", int64(2 * gap * pcie), 0, holder},
		{"measured load longer than the queue", 0, time.Duration(2 * gap * float64(time.Second)), holder},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.measured > 0 {
				cold.ObserveAdapterLoad(tc.measured)
			}
			d := pick(t, s, req(true, tc.bytes), f.snap())
			if d.Worker != tc.want {
				t.Errorf("picked %s (estimate %v), want %s", d.Worker.Name, d.Estimate, tc.want.Name)
			}
			if d.Worker == cold {
				load := float64(tc.bytes) / pcie
				if got, want := d.Estimate.Seconds(), free.Estimate.Seconds()+load; math.Abs(got-want) > 1e-6+1e-3*want {
					t.Errorf("cold worker's estimate %vs, want %vs plus the load %vs", got, free.Estimate.Seconds(), load)
				}
			}
		})
	}
}
