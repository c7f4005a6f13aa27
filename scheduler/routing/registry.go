package routing

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
)

// Names of the built-in strategies.
const (
	Random           = "random"
	RoundRobin       = "round_robin"
	LeastOutstanding = "least_outstanding"
	PrefixAware      = "prefix_aware"
	// Default is the strategy used when none is configured, as in
	// SageMaker.
	Default = Random
)

// Factory builds a strategy from its configuration, which Registry.New has
// validated and given its defaults, and its run-time dependencies.
type Factory func(params Params, deps Deps) (Strategy, error)

// Registry maps strategy names to factories. The zero value is an empty
// registry ready for use; it is safe for concurrent use. cmd/ builds one
// and calls RegisterBuiltins; tests build their own.
type Registry struct {
	mu        sync.RWMutex
	factories map[string]Factory
	// The parts custom profiles are built from (RegisterProfile).
	filters map[string]part[Filter]
	scorers map[string]part[Scorer]
	pickers map[string]part[Picker]
}

// Register adds a factory under name. It panics if name is empty, f is nil
// or name is taken: registration is wiring done once at start.
func (r *Registry) Register(name string, f Factory) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case name == "":
		panic("routing: Register with empty name")
	case f == nil:
		panic(fmt.Sprintf("routing: Register %q with nil factory", name))
	}
	if _, dup := r.factories[name]; dup {
		panic(fmt.Sprintf("routing: strategy %q registered twice", name))
	}
	if r.factories == nil {
		r.factories = make(map[string]Factory)
	}
	r.factories[name] = f
}

// New validates params, fills their defaults and deps' and builds the
// strategy registered as name.
func (r *Registry) New(name string, params Params, deps Deps) (Strategy, error) {
	r.mu.RLock()
	f, ok := r.factories[name]
	r.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("strategy: unknown %q (known: %s)", name, strings.Join(r.Names(), ", "))
	}
	if err := params.Validate(); err != nil {
		return nil, fmt.Errorf("strategy %s: %w", name, err)
	}
	s, err := f(params.withDefaults(), deps.withDefaults())
	if err != nil {
		return nil, fmt.Errorf("strategy %s: %w", name, err)
	}
	return s, nil
}

// Clone returns a new registry holding r's factories, to which a caller
// can add strategies bound to its own state (kv_aware and its index)
// without touching r.
func (r *Registry) Clone() *Registry {
	r.mu.RLock()
	defer r.mu.RUnlock()
	c := &Registry{factories: maps.Clone(r.factories), filters: maps.Clone(r.filters), scorers: maps.Clone(r.scorers), pickers: maps.Clone(r.pickers)}
	if c.factories == nil {
		c.factories = make(map[string]Factory)
	}
	return c
}

// Has reports whether name is registered.
func (r *Registry) Has(name string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	_, ok := r.factories[name]
	return ok
}

// Names returns the registered names, sorted.
func (r *Registry) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	names := make([]string, 0, len(r.factories))
	for n := range r.factories {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// RegisterBuiltins registers random, round_robin, least_outstanding,
// prefix_aware and kv_aware in r, and the parts custom profiles are built
// from: the filters available, model and adapter, the scorers load,
// prefix, kv and kv_usage, and the picker kv_aware. (The pickers max,
// random and round_robin every registry knows.)
func RegisterBuiltins(r *Registry) {
	r.Register(Random, NewRandom)
	r.Register(RoundRobin, NewRoundRobin)
	r.Register(LeastOutstanding, NewLeastOutstanding)
	r.Register(PrefixAware, NewPrefixAware)
	r.Register(KVAware, NewKVAware)
	RegisterScorerWith(r, "kv", newKVScorer)
	RegisterPickerWith(r, KVAware, newKVAwarePicker)
	r.RegisterScorer("kv_usage", func(_ Params, d Deps) (Scorer, error) {
		if d.Index == nil {
			return nil, errNoIndex
		}
		return kvUsageScorer{d.Index}, nil
	})
	r.RegisterFilter(availableFilter{})
	r.RegisterFilter(modelFilter{})
	RegisterFilterWith(r, "adapter", newAdapterFilter)
	r.RegisterScorer("load", func(Params, Deps) (Scorer, error) { return loadScorer{}, nil })
	RegisterScorerWith(r, "prefix", newPrefixScorer)
}
