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
// types, each with its own options.
type ProfileConfig struct {
	// Name is the profile's strategy name, used like a built-in's.
	Name string `yaml:"name"`
	// Filters drop workers, in order: each a registered filter's name, or
	// {type, options}. Default [available, model, adapter]; adapter is
	// added to any list without it.
	Filters []PartConfig `yaml:"filters"`
	// Scorers rate the workers left, each score in [0, 1] times its
	// weight, summed. None: every worker scores 0 and the picker decides.
	Scorers []ScorerConfig `yaml:"scorers"`
	// Picker chooses by the total, a registered picker's name or {type,
	// options}: max (default; ties from a random worker, or from the one
	// after the request's home), random, round_robin or kv_aware.
	Picker PartConfig `yaml:"picker"`
}

// ScorerConfig is one scorer of a profile. A profile may hold several
// scorers of one type under different names, each with its options.
type ScorerConfig struct {
	// Name names this scorer in its profile: unique there, and the part
	// label of its time in baton_routing_part_seconds.
	Name string `yaml:"name"`
	// Type is the scorer's registered name. Default: Name, so that
	// {name: prefix} is the prefix scorer.
	Type string `yaml:"type"`
	// Weight multiplies the scorer's scores: 0–1,000; default 1.
	Weight float64 `yaml:"weight"`
	// Options are the scorer's own, as its type documents them; a field
	// the type does not know is an error. Default: none.
	Options Options `yaml:"options"`
}

// ScorerFactory builds a scorer for a profile from the strategy's
// configuration (its concurrency threshold, say), which the registry has
// validated, and its run-time dependencies (the KV index, say).
type ScorerFactory func(p Params, d Deps) (Scorer, error)

// PickerFactory builds a picker for a profile, as ScorerFactory does a
// scorer: each profile gets its own, so that a picker that keeps state
// (round_robin's turn) is never shared.
type PickerFactory func(p Params, d Deps) (Picker, error)

// NoOptions are the options of a part that takes none: any field given
// is an error.
type NoOptions struct{}

// part is a registered part type: how to check an instance's options,
// and how to build the instance from the checked options.
type part[T any] struct {
	check func(Options) (any, error)
	build func(o any, p Params, d Deps) (T, error)
}

// newPart returns the part whose options decode into an O, validated by
// (*O).Validate when it has one, and whose instances build builds.
func newPart[O, T any](build func(o O, p Params, d Deps) (T, error)) part[T] {
	return part[T]{
		check: func(opts Options) (any, error) {
			var o O
			if err := opts.Decode(&o); err != nil {
				return nil, err
			}
			if v, ok := any(&o).(interface{ Validate() error }); ok {
				if err := v.Validate(); err != nil {
					return nil, err
				}
			}
			return o, nil
		},
		build: func(o any, p Params, d Deps) (T, error) { return build(o.(O), p, d) },
	}
}

// RegisterFilter adds a filter that takes no options under its Name.
// Filters hold no state; one value serves every profile. It panics on a
// taken or empty name.
func (r *Registry) RegisterFilter(f Filter) {
	RegisterFilterWith(r, f.Name(), func(NoOptions, Params, Deps) (Filter, error) { return f, nil })
}

// RegisterScorer adds a scorer type that takes no options under name. It
// panics on a taken or empty name, or a nil factory.
func (r *Registry) RegisterScorer(name string, f ScorerFactory) {
	if f == nil {
		panic(fmt.Sprintf("routing: scorer %q with nil factory", name))
	}
	RegisterScorerWith(r, name, func(_ NoOptions, p Params, d Deps) (Scorer, error) { return f(p, d) })
}

// RegisterPicker adds a picker type that takes no options under name,
// for profiles to name (ProfileConfig.Picker). It panics on a taken or
// empty name, or a nil factory.
func (r *Registry) RegisterPicker(name string, f PickerFactory) {
	if f == nil {
		panic(fmt.Sprintf("routing: picker %q with nil factory", name))
	}
	RegisterPickerWith(r, name, func(_ NoOptions, p Params, d Deps) (Picker, error) { return f(p, d) })
}

// RegisterScorerWith adds a scorer type with options of its own under
// name. Each scorer of the type a profile lists has its options decoded
// into a new O, strictly (a field O lacks is an error naming it), and
// validated by (*O).Validate if O has that method, when the profile is
// registered: at start. build makes the scorer, each time a strategy of
// the profile is built, from those options. It panics on a taken or
// empty name, or a nil build.
func RegisterScorerWith[O any](r *Registry, name string, build func(o O, p Params, d Deps) (Scorer, error)) {
	registerPart(r, &r.scorers, "scorer", name, build)
}

// RegisterFilterWith adds a filter type with options of its own under
// name, as RegisterScorerWith does a scorer type.
func RegisterFilterWith[O any](r *Registry, name string, build func(o O, p Params, d Deps) (Filter, error)) {
	registerPart(r, &r.filters, "filter", name, build)
}

// RegisterPickerWith adds a picker type with options of its own under
// name, as RegisterScorerWith does a scorer type.
func RegisterPickerWith[O any](r *Registry, name string, build func(o O, p Params, d Deps) (Picker, error)) {
	registerPart(r, &r.pickers, "picker", name, build)
}

func registerPart[O, T any](r *Registry, m *map[string]part[T], kind, name string, build func(O, Params, Deps) (T, error)) {
	if build == nil {
		panic(fmt.Sprintf("routing: %s %q with nil factory", kind, name))
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if *m == nil {
		*m = make(map[string]part[T])
	}
	register(*m, kind, name, newPart(build))
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

// builtinPickers are the pickers every registry knows; max is also a
// profile's picker when it names none.
var builtinPickers = map[string]part[Picker]{
	"max":    newPart(func(NoOptions, Params, Deps) (Picker, error) { return maxPicker{}, nil }),
	"random": newPart(func(NoOptions, Params, Deps) (Picker, error) { return randomPicker{}, nil }),
	"round_robin": newPart(func(NoOptions, Params, Deps) (Picker, error) {
		return roundRobinPicker{next: new(atomic.Uint64)}, nil
	}),
}

// MaxScorerWeight bounds a scorer's weight in a profile.
const MaxScorerWeight = 1000

// RegisterProfile validates pc against the parts registered so far, with
// each part's options, and registers it as a strategy named pc.Name. Its
// errors name the field, as "scorers[1].type: unknown scorer ..." or
// "scorers[0].options.threshold: line 9: unknown field".
func (r *Registry) RegisterProfile(pc ProfileConfig) error {
	plan, err := r.plan(pc)
	if err != nil {
		return err
	}
	r.Register(pc.Name, func(p Params, d Deps) (Strategy, error) { return plan.build(p, d) })
	return nil
}

// profilePlan is a checked ProfileConfig: its parts' types and their
// decoded options.
type profilePlan struct {
	name    string
	filters []planned[Filter] // nil: defaultFilters
	scorers []planned[Scorer]
	picker  planned[Picker]
}

// planned is one part of a profile: its type, options and, for a scorer,
// name and weight.
type planned[T any] struct {
	part   part[T]
	opts   any
	name   string
	weight float64
}

func (r *Registry) plan(pc ProfileConfig) (*profilePlan, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	switch {
	case pc.Name == "":
		return nil, errors.New("name: required")
	case r.factories[pc.Name] != nil:
		return nil, fmt.Errorf("name: %q is already a strategy", pc.Name)
	}
	plan := &profilePlan{name: pc.Name}
	picker := pc.Picker.Type
	if picker == "" {
		picker = "max"
	}
	pp, ok := r.pickers[picker]
	if !ok {
		pp, ok = builtinPickers[picker]
	}
	if !ok {
		return nil, fmt.Errorf("picker: unknown picker %q (known: %s)", picker, strings.Join(r.pickerNames(), ", "))
	}
	opts, err := pp.check(pc.Picker.Options)
	if err != nil {
		return nil, fmt.Errorf("picker.options.%w", err)
	}
	plan.picker = planned[Picker]{part: pp, opts: opts}
	if pc.Filters != nil {
		adapter := false
		for i, f := range pc.Filters {
			fp, ok := r.filters[f.Type]
			if !ok {
				return nil, fmt.Errorf("filters[%d]: unknown filter %q (known: %s)", i, f.Type, strings.Join(sortedKeys(r.filters), ", "))
			}
			opts, err := fp.check(f.Options)
			if err != nil {
				return nil, fmt.Errorf("filters[%d].options.%w", i, err)
			}
			plan.filters = append(plan.filters, planned[Filter]{part: fp, opts: opts})
			adapter = adapter || f.Type == "adapter"
		}
		// A request for an adapter never goes to a worker without it,
		// whatever the profile lists.
		if !adapter {
			plan.filters = append(plan.filters, planned[Filter]{part: adapterPart, opts: adapterOptions{}})
		}
	}
	seen := map[string]bool{}
	for i, sc := range pc.Scorers {
		typ := sc.Type
		if typ == "" {
			typ = sc.Name
		}
		sp, ok := r.scorers[typ]
		switch {
		case sc.Name == "":
			return nil, fmt.Errorf("scorers[%d].name: required", i)
		case !ok && sc.Type == "":
			return nil, fmt.Errorf("scorers[%d].name: unknown scorer %q (known: %s)", i, typ, strings.Join(sortedKeys(r.scorers), ", "))
		case !ok:
			return nil, fmt.Errorf("scorers[%d].type: unknown scorer %q (known: %s)", i, typ, strings.Join(sortedKeys(r.scorers), ", "))
		case seen[sc.Name]:
			return nil, fmt.Errorf("scorers[%d].name: scorer %q given twice (name each scorer of one type)", i, sc.Name)
		case sc.Weight < 0 || sc.Weight > MaxScorerWeight || math.IsNaN(sc.Weight):
			return nil, fmt.Errorf("scorers[%d].weight: must be 0–%d, got %v", i, MaxScorerWeight, sc.Weight)
		}
		seen[sc.Name] = true
		opts, err := sp.check(sc.Options)
		if err != nil {
			return nil, fmt.Errorf("scorers[%d].options.%w", i, err)
		}
		w := sc.Weight
		if w == 0 {
			w = 1
		}
		plan.scorers = append(plan.scorers, planned[Scorer]{part: sp, opts: opts, name: sc.Name, weight: w})
	}
	return plan, nil
}

// build builds the profile pl describes with configuration p and
// dependencies d.
func (pl *profilePlan) build(p Params, d Deps) (Strategy, error) {
	picker, err := pl.picker.part.build(pl.picker.opts, p, d)
	if err != nil {
		return nil, fmt.Errorf("picker: %w", err)
	}
	prof := &Profile{name: pl.name, filters: defaultFilters, picker: picker, rand: d.Rand,
		threshold: p.ConcurrencyThreshold, base: ReasonScored}
	if pl.filters != nil {
		prof.filters = make([]Filter, len(pl.filters))
		for i, f := range pl.filters {
			if prof.filters[i], err = f.part.build(f.opts, p, d); err != nil {
				return nil, fmt.Errorf("filters[%d]: %w", i, err)
			}
		}
	}
	for _, sc := range pl.scorers {
		s, err := sc.part.build(sc.opts, p, d)
		if err != nil {
			return nil, fmt.Errorf("scorer %s: %w", sc.name, err)
		}
		prof.scorers = append(prof.scorers, weighted{Scorer: s, weight: sc.weight, name: sc.name})
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

// pickerNames lists the pickers profiles may name. r.mu is held.
func (r *Registry) pickerNames() []string {
	names := sortedKeys(r.pickers)
	for n := range builtinPickers {
		if _, ok := r.pickers[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names
}
