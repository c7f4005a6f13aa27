package routing

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
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
	if err := reg.RegisterProfile(ProfileConfig{Name: "bare", Filters: []string{"available"}, Scorers: []ScorerConfig{{Name: "load"}}}); err != nil {
		t.Fatal(err)
	}
	strategies := builtins(t, Params{Rand: SeededRand(1)})
	bare, err := reg.New("bare", Params{Rand: SeededRand(1)})
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
	for _, s := range builtins(t, Params{}) {
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
