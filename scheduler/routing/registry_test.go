package routing

import (
	"errors"
	"fmt"
	"testing"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/google/go-cmp/cmp"
)

func TestParamsValidate(t *testing.T) {
	tests := []struct {
		threshold int
		wantErr   string
	}{
		{0, ""}, // default
		{1, ""},
		{16, ""},
		{1024, ""},
		{1025, "concurrency_threshold: must be 1–1024, got 1025"},
		{-1, "concurrency_threshold: must be 1–1024, got -1"},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.threshold), func(t *testing.T) {
			err := Params{ConcurrencyThreshold: tt.threshold}.Validate()
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("Validate() = %q, want %q", got, tt.wantErr)
			}
		})
	}
}

func TestRegistry(t *testing.T) {
	var r Registry
	RegisterBuiltins(&r)
	want := []string{KVAware, LeastOutstanding, PrefixAware, Random, RoundRobin}
	if diff := cmp.Diff(want, r.Names()); diff != "" {
		t.Errorf("Names() (-want +got):\n%s", diff)
	}
	for _, name := range want {
		t.Run(name, func(t *testing.T) {
			s, err := r.New(name, Params{}, Deps{Index: kvindex.New(kvindex.Config{})})
			if err != nil {
				t.Fatalf("New(%s): %v", name, err)
			}
			if got := s.Name(); got != name {
				t.Errorf("Name() = %q, want %q", got, name)
			}
		})
	}
	if Default != Random {
		t.Errorf("Default = %q, want %q as in SageMaker", Default, Random)
	}
}

func TestRegistryErrors(t *testing.T) {
	var r Registry
	RegisterBuiltins(&r)
	boom := errors.New("boom")
	r.Register("broken", func(Params, Deps) (Strategy, error) { return nil, boom })
	tests := []struct {
		name    string
		params  Params
		deps    Deps
		wantErr string
	}{
		{"kv_magic", Params{}, Deps{}, `strategy: unknown "kv_magic" (known: broken, kv_aware, least_outstanding, prefix_aware, random, round_robin)`},
		{PrefixAware, Params{ConcurrencyThreshold: 2000}, Deps{}, "strategy prefix_aware: concurrency_threshold: must be 1–1024, got 2000"},
		{Random, Params{ConcurrencyThreshold: -5}, Deps{}, "strategy random: concurrency_threshold: must be 1–1024, got -5"},
		{"broken", Params{}, Deps{}, "strategy broken: boom"},
		{KVAware, Params{}, Deps{}, "strategy kv_aware: needs the scheduler's KV index (Deps.Index)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := r.New(tt.name, tt.params, tt.deps)
			if err == nil || err.Error() != tt.wantErr {
				t.Fatalf("New(%s) = %v, %v; want error %q", tt.name, s, err, tt.wantErr)
			}
		})
	}
}

func TestFactoriesValidate(t *testing.T) {
	for _, f := range []Factory{NewRandom, NewRoundRobin, NewLeastOutstanding, NewPrefixAware, NewKVAware} {
		if s, err := f(Params{ConcurrencyThreshold: 4096}, Deps{}); err == nil {
			t.Errorf("%s built with concurrency_threshold 4096, want error", s.Name())
		}
	}
}

func TestRegisterPanics(t *testing.T) {
	ok := func(Params, Deps) (Strategy, error) { return NewRandom(Params{}, Deps{}) }
	tests := []struct {
		name     string
		register func(r *Registry)
	}{
		{"empty name", func(r *Registry) { r.Register("", ok) }},
		{"nil factory", func(r *Registry) { r.Register("x", nil) }},
		{"twice", func(r *Registry) { r.Register("x", ok); r.Register("x", ok) }},
		{"builtins twice", func(r *Registry) { RegisterBuiltins(r); RegisterBuiltins(r) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("Register did not panic")
				}
			}()
			var r Registry
			tt.register(&r)
		})
	}
}

// lastPicker picks the last candidate.
type lastPicker struct{}

func (lastPicker) Name() string                   { return "last" }
func (lastPicker) Pick(c *Cycle, _ []float64) int { return len(c.Cands) - 1 }

// firstHome places every request on the first candidate and scores all
// alike; it names decisions by the home (a Reasoner), or leaves them to
// the profile when quiet.
type firstHome struct{ quiet bool }

func (firstHome) Name() string { return "first_home" }
func (firstHome) Score(c *Cycle, scores []float64) {
	c.Home = c.Cands[0]
	for i := range scores {
		scores[i] = 1
	}
}

func (h firstHome) Reason(c *Cycle, w *pool.Worker) (Reason, bool) {
	switch {
	case h.quiet:
		return 0, false
	case w == c.Home:
		return ReasonHome, true
	}
	return ReasonSpill, true
}

// Pickers and scorers registered by others build profiles like the
// built-in ones: a profile names the picker, and a scorer with a reason
// rule (Reasoner) names the profile's decisions; one that declines leaves
// them to the profile.
func TestRegisteredPickerAndReasoner(t *testing.T) {
	f := newFleet(t, 0)
	for _, name := range []string{"a", "b", "c"} {
		f.add(name, "llama")
	}
	var reg Registry
	RegisterBuiltins(&reg)
	reg.RegisterPicker("last", func(Params, Deps) (Picker, error) { return lastPicker{}, nil })
	reg.RegisterScorer("first_home", func(Params, Deps) (Scorer, error) { return firstHome{}, nil })
	reg.RegisterScorer("quiet_home", func(Params, Deps) (Scorer, error) { return firstHome{quiet: true}, nil })
	if err := reg.RegisterProfile(ProfileConfig{Name: "odd", Picker: PartConfig{Type: "nope"}, Scorers: []ScorerConfig{{Name: "load"}}}); err == nil ||
		err.Error() != `picker: unknown picker "nope" (known: kv_aware, last, max, random, round_robin)` {
		t.Errorf("unknown picker: %v", err)
	}
	for _, tt := range []struct {
		scorer string
		want   Reason
	}{{"load", ReasonScored}, {"first_home", ReasonSpill}, {"quiet_home", ReasonScored}} {
		name := "last_" + tt.scorer
		if err := reg.RegisterProfile(ProfileConfig{Name: name, Picker: PartConfig{Type: "last"}, Scorers: []ScorerConfig{{Name: tt.scorer}}}); err != nil {
			t.Fatal(err)
		}
		s, err := reg.New(name, Params{}, Deps{Rand: SeededRand(1)})
		if err != nil {
			t.Fatal(err)
		}
		d := pick(t, s, &Request{Model: "llama", PrefixKey: 7}, f.snap())
		if d.Worker.Name != "c" || d.Reason != tt.want {
			t.Errorf("%s picked %s for %s, want c for %s", name, d.Worker.Name, d.Reason, tt.want)
		}
	}
}
