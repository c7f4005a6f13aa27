package routing

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/batonllm/baton/proto/workerpb"
)

// TestCapacityAndTried: every profile leaves out the workers a request
// already tried and, with MaxInFlight, those at capacity; ErrFull tells
// "wait for room" from ErrNoWorker.
func TestCapacityAndTried(t *testing.T) {
	for _, s := range builtins(t, Params{}, Deps{Rand: SeededRand(3)}) {
		t.Run(s.Name(), func(t *testing.T) {
			f := newFleet(t, 3)
			f.load("w00", 2)
			f.load("w01", 2)
			req := &Request{Model: "llama", MaxInFlight: 2}
			for range 20 {
				d, err := s.Pick(req, f.snap())
				if err != nil || d.Worker.Name != "w02" {
					t.Fatalf("Pick with w00, w01 at capacity = %v, %v; want w02", d.Worker, err)
				}
			}
			req.Tried = append(req.Tried, f.worker("w02"))
			if _, err := s.Pick(req, f.snap()); !errors.Is(err, ErrFull) {
				t.Errorf("Pick with the rest at capacity: err %v, want ErrFull", err)
			}
			req.MaxInFlight = 0
			for range 20 {
				d, err := s.Pick(req, f.snap())
				if err != nil || d.Worker.Name == "w02" {
					t.Fatalf("Pick without capacity = %v, %v; want a worker other than the tried w02", d.Worker, err)
				}
			}
			req.Tried = append(req.Tried, f.worker("w00"), f.worker("w01"))
			if _, err := s.Pick(req, f.snap()); !errors.Is(err, ErrNoWorker) {
				t.Errorf("Pick with every worker tried: err %v, want ErrNoWorker", err)
			}
		})
	}
}

// TestPrefixHomeAtCapacitySpills: a home at capacity sends its requests to
// the least-loaded worker as a spill, not to its ring successor as if it
// were gone.
func TestPrefixHomeAtCapacitySpills(t *testing.T) {
	f := newFleet(t, 4)
	s, err := NewPrefixAware(Params{ConcurrencyThreshold: 8}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{Model: "llama", PrefixKey: 42}
	d, err := s.Pick(req, f.snap())
	if err != nil {
		t.Fatal(err)
	}
	home := d.Worker
	f.load(home.Name, 2)
	for _, w := range f.snap().Workers {
		if w != home {
			f.load(w.Name, 1)
		}
	}
	req.MaxInFlight = 2
	d, err = s.Pick(req, f.snap())
	if err != nil {
		t.Fatal(err)
	}
	if d.Home != home || !d.Spill || d.Reason != ReasonSpill || d.Worker == home {
		t.Errorf("home %s at capacity: Pick = %s (home %v, spill %t, %v); want a spill from %s", home.Name, d.Worker.Name, d.Home, d.Spill, d.Reason, home.Name)
	}
}

// TestCustomProfile: a profile built from registered parts routes as its
// weights say, and a bad one is an error naming the field.
func TestCustomProfile(t *testing.T) {
	f := newKVFleet(t, 3)
	var r Registry
	RegisterBuiltins(&r)
	// w00 uses 90% of its KV cache, w01 10%, w02 50%.
	f.report("w00", &workerpb.LoadReport{GpuBlocksUsed: 900, GpuBlocksTotal: 1000})
	f.report("w01", &workerpb.LoadReport{GpuBlocksUsed: 100, GpuBlocksTotal: 1000})
	f.report("w02", &workerpb.LoadReport{GpuBlocksUsed: 500, GpuBlocksTotal: 1000})
	f.load("w01", 3) // busiest by requests in flight

	for _, tt := range []struct {
		name    string
		scorers []ScorerConfig
		want    string // one of, space-separated
	}{
		{"kv usage alone", []ScorerConfig{{Name: "kv_usage"}}, "w01"},
		{"load alone", []ScorerConfig{{Name: "load"}}, "w00 w02"},
		// kv_usage 0.1 / 0.9 / 0.5, load 1 / 0.25 / 1: w02 wins 1.5 to 1.1 and 1.15.
		{"both", []ScorerConfig{{Name: "kv_usage", Weight: 1}, {Name: "load", Weight: 1}}, "w02"},
		// With kv_usage weighted 4: w01 has 3.85, w02 3, w00 1.4.
		{"kv usage weighted", []ScorerConfig{{Name: "kv_usage", Weight: 4}, {Name: "load", Weight: 1}}, "w01"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rr := r.Clone()
			name := "custom"
			if err := rr.RegisterProfile(ProfileConfig{Name: name, Scorers: tt.scorers}); err != nil {
				t.Fatal(err)
			}
			s, err := rr.New(name, Params{}, Deps{Rand: SeededRand(1), Index: f.idx})
			if err != nil {
				t.Fatal(err)
			}
			req := &Request{Model: "llama"}
			for range 10 {
				d, err := s.Pick(req, f.snap())
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Contains(strings.Fields(tt.want), d.Worker.Name) || d.Reason != ReasonScored {
					t.Fatalf("Pick = %s (%v), want %s (scored)", d.Worker.Name, d.Reason, tt.want)
				}
			}
			snap := f.snap()
			if n := testing.AllocsPerRun(100, func() { _, _ = s.Pick(req, snap) }); n != 0 && !raceEnabled {
				t.Errorf("Pick allocates %v times, want 0", n)
			}
		})
	}

	for _, tt := range []struct {
		pc   ProfileConfig
		want string
	}{
		{ProfileConfig{}, "name: required"},
		{ProfileConfig{Name: PrefixAware}, `name: "prefix_aware" is already a strategy`},
		{ProfileConfig{Name: "p", Filters: []PartConfig{{Type: "available"}, {Type: "healthy"}}}, `filters[1]: unknown filter "healthy" (known: adapter, available, model)`},
		{ProfileConfig{Name: "p", Scorers: []ScorerConfig{{Name: "load"}, {Name: "lod"}}}, `scorers[1].name: unknown scorer "lod" (known: kv, kv_usage, load, prefix)`},
		{ProfileConfig{Name: "p", Scorers: []ScorerConfig{{Name: "load"}, {Name: "load"}}}, `scorers[1].name: scorer "load" given twice (name each scorer of one type)`},
		{ProfileConfig{Name: "p", Scorers: []ScorerConfig{{Name: "load", Weight: -1}}}, "scorers[0].weight: must be 0–1000, got -1"},
		{ProfileConfig{Name: "p", Picker: PartConfig{Type: "best"}}, `picker: unknown picker "best" (known: kv_aware, max, random, round_robin)`},
	} {
		if err := r.Clone().RegisterProfile(tt.pc); err == nil || err.Error() != tt.want {
			t.Errorf("RegisterProfile(%+v) = %v, want %q", tt.pc, err, tt.want)
		}
	}
}
