package routing

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
)

// ProfileConfig describes a custom profile, as the configuration file's
// profiles list gives it: the parts of the pipeline by their registered
// names.
type ProfileConfig struct {
	// Name is the profile's strategy name, used like a built-in's.
	Name string `yaml:"name"`
	// Filters drop workers, in order. Default [available, model, adapter];
	// adapter is added to any list without it.
	Filters []string `yaml:"filters"`
	// Scorers rate the workers left, each score in [0, 1] times its
	// weight, summed. None: every worker scores 0 and the picker decides.
	Scorers []ScorerConfig `yaml:"scorers"`
	// Picker chooses by the total: max (default; ties from a random
	// worker, or from the one after the request's home), random or
	// round_robin.
	Picker string `yaml:"picker"`
}

// ScorerConfig is one scorer of a profile.
type ScorerConfig struct {
	Name string `yaml:"name"`
	// Weight multiplies the scorer's scores: 0–1,000; default 1.
	Weight float64 `yaml:"weight"`
}

// ScorerFactory builds a scorer from the strategy's configuration (its
// concurrency threshold, say), which the registry has validated, and its
// run-time dependencies (the KV index, say).
type ScorerFactory func(p Params, d Deps) (Scorer, error)

// RegisterFilter adds a filter under its Name. Filters hold no state; one
// value serves every profile. It panics on a taken or empty name.
func (r *Registry) RegisterFilter(f Filter) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.filters == nil {
		r.filters = make(map[string]Filter)
	}
	register(r.filters, "filter", f.Name(), f)
}

// RegisterScorer adds a scorer factory under name. It panics on a taken
// or empty name, or a nil factory.
func (r *Registry) RegisterScorer(name string, f ScorerFactory) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f == nil {
		panic(fmt.Sprintf("routing: RegisterScorer %q with nil factory", name))
	}
	if r.scorers == nil {
		r.scorers = make(map[string]ScorerFactory)
	}
	register(r.scorers, "scorer", name, f)
}

func register[T any](m map[string]T, kind, name string, v T) {
	if name == "" {
		panic("routing: " + kind + " with empty name")
	}
	if _, dup := m[name]; dup {
		panic(fmt.Sprintf("routing: %s %q registered twice", kind, name))
	}
	m[name] = v
}

// PickerFactory builds a new picker for a profile; a picker that keeps
// state (round_robin's turn) gets its own per profile.
type PickerFactory func() Picker

// RegisterPicker adds a picker factory under name, for profiles to name
// (ProfileConfig.Picker). It panics on a taken or empty name, or a nil
// factory.
func (r *Registry) RegisterPicker(name string, f PickerFactory) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f == nil {
		panic(fmt.Sprintf("routing: picker %q with nil factory", name))
	}
	if r.pickers == nil {
		r.pickers = make(map[string]PickerFactory)
	}
	register(r.pickers, "picker", name, f)
}

// builtinPickers are the pickers RegisterBuiltins registers; max is also
// a profile's picker when it names none.
var builtinPickers = map[string]PickerFactory{
	"max":         func() Picker { return maxPicker{} },
	"random":      func() Picker { return randomPicker{} },
	"round_robin": func() Picker { return roundRobinPicker{next: new(atomic.Uint64)} },
}

// MaxScorerWeight bounds a scorer's weight in a profile.
const MaxScorerWeight = 1000

// RegisterProfile validates pc against the parts registered so far and
// registers it as a strategy named pc.Name. Its errors name the field, as
// "scorers[1].name: unknown scorer ...".
func (r *Registry) RegisterProfile(pc ProfileConfig) error {
	if err := r.checkProfile(pc); err != nil {
		return err
	}
	r.Register(pc.Name, func(p Params, d Deps) (Strategy, error) { return r.buildProfile(pc, p, d) })
	return nil
}

func (r *Registry) checkProfile(pc ProfileConfig) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	switch {
	case pc.Name == "":
		return errors.New("name: required")
	case r.factories[pc.Name] != nil:
		return fmt.Errorf("name: %q is already a strategy", pc.Name)
	case pc.Picker != "" && r.pickers[pc.Picker] == nil && builtinPickers[pc.Picker] == nil:
		return fmt.Errorf("picker: unknown picker %q (known: %s)", pc.Picker, strings.Join(r.pickerNames(), ", "))
	}
	for i, f := range pc.Filters {
		if r.filters[f] == nil {
			return fmt.Errorf("filters[%d]: unknown filter %q (known: %s)", i, f, strings.Join(sortedKeys(r.filters), ", "))
		}
	}
	seen := map[string]bool{}
	for i, sc := range pc.Scorers {
		switch {
		case r.scorers[sc.Name] == nil:
			return fmt.Errorf("scorers[%d].name: unknown scorer %q (known: %s)", i, sc.Name, strings.Join(sortedKeys(r.scorers), ", "))
		case seen[sc.Name]:
			return fmt.Errorf("scorers[%d].name: scorer %q given twice", i, sc.Name)
		case sc.Weight < 0 || sc.Weight > MaxScorerWeight || math.IsNaN(sc.Weight):
			return fmt.Errorf("scorers[%d].weight: must be 0–%d, got %v", i, MaxScorerWeight, sc.Weight)
		}
		seen[sc.Name] = true
	}
	return nil
}

// buildProfile builds the profile pc describes with parameters p.
func (r *Registry) buildProfile(pc ProfileConfig, p Params, d Deps) (Strategy, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	prof := &Profile{name: pc.Name, filters: defaultFilters, picker: r.newPicker(pc.Picker), rand: d.Rand,
		threshold: p.ConcurrencyThreshold, base: ReasonScored}
	if pc.Filters != nil {
		prof.filters = make([]Filter, len(pc.Filters))
		for i, f := range pc.Filters {
			prof.filters[i] = r.filters[f]
		}
		// A request for an adapter never goes to a worker without it,
		// whatever the profile lists.
		if !slices.Contains(prof.filters, Filter(adapterFilter{})) {
			prof.filters = append(prof.filters, adapterFilter{})
		}
	}
	for _, sc := range pc.Scorers {
		s, err := r.scorers[sc.Name](p, d)
		if err != nil {
			return nil, fmt.Errorf("scorer %s: %w", sc.Name, err)
		}
		w := sc.Weight
		if w == 0 {
			w = 1
		}
		prof.scorers = append(prof.scorers, weighted{s, w})
	}
	return prof.wire(d.PartTimer), nil
}

func sortedKeys[T any](m map[string]T) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// newPicker returns a new picker registered as name; max when name is
// empty. r.mu is held.
func (r *Registry) newPicker(name string) Picker {
	if name == "" {
		name = "max"
	}
	if f := r.pickers[name]; f != nil {
		return f()
	}
	return builtinPickers[name]()
}

// pickerNames lists the pickers profiles may name. r.mu is held.
func (r *Registry) pickerNames() []string {
	names := sortedKeys(r.pickers)
	for n := range builtinPickers {
		if r.pickers[n] == nil {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names
}
