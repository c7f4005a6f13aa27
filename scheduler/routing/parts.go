package routing

import (
	"sync/atomic"

	"github.com/batonllm/baton/scheduler/pool"
)

// The pipeline's built-in parts. Their registered names are their Name.

// availableFilter keeps workers that are healthy with their breaker closed
// or half-open.
type availableFilter struct{}

func (availableFilter) Name() string                         { return "available" }
func (availableFilter) Keep(_ *Request, w *pool.Worker) bool { return w.Available() }
func (availableFilter) keepAt(_ *Request, s *pool.Snapshot, keep []bool) {
	for i, ok := range keep {
		if ok && !s.Available(i) {
			keep[i] = false
		}
	}
}

// modelFilter keeps workers that serve the request's model.
type modelFilter struct{}

func (modelFilter) Name() string                           { return "model" }
func (modelFilter) Keep(req *Request, w *pool.Worker) bool { return w.Serves(req.Model) }
func (modelFilter) keepAt(req *Request, s *pool.Snapshot, keep []bool) {
	for i, ok := range keep {
		if ok && !s.Serves(i, req.Model) {
			keep[i] = false
		}
	}
}

// defaultFilters are every profile's unless it says otherwise.
var defaultFilters = []Filter{availableFilter{}, modelFilter{}, adapterFilter{}}

// loadScorer prefers workers with fewer requests in flight: 1/(1+n).
type loadScorer struct{}

func (loadScorer) Name() string { return "load" }

func (loadScorer) Score(c *Cycle, scores []float64) {
	for i, w := range c.Cands {
		scores[i] = 1 / float64(1+w.InFlight())
	}
}

// prefixScorer is SageMaker's prefix affinity: the request's PrefixKey is
// hashed onto the snapshot's ring, and walking the ring from there the
// first worker that passed the filters is the request's home (Cycle.Home).
// The home scores 1 while it is a candidate (not at capacity) with fewer
// than threshold requests in flight; every other worker 0. So requests sharing a prefix (and tenant and model) meet on
// the worker that caches it, a membership change moves about 1/N of the
// prefixes, and a home that is unavailable passes its prefixes to its
// ring successors only.
type prefixScorer struct{ threshold int }

// prefixOptions are the prefix scorer's options in a profile.
type prefixOptions struct {
	// ConcurrencyThreshold is the requests in flight at which the home
	// stops scoring 1: 1–1,024; 0 means the strategy's
	// concurrency_threshold.
	ConcurrencyThreshold int `yaml:"concurrency_threshold"`
}

func (o *prefixOptions) Validate() error { return validThreshold(o.ConcurrencyThreshold, true) }

func newPrefixScorer(o prefixOptions, p Params, _ Deps) (Scorer, error) {
	t := o.ConcurrencyThreshold
	if t == 0 {
		t = p.ConcurrencyThreshold
	}
	return prefixScorer{threshold: t}, nil
}

func (prefixScorer) Name() string { return "prefix" }

// Reason names every decision of a profile with prefix by where the
// chosen worker stands to the request's home and prefix's threshold:
// ReasonAllFull at the threshold, else ReasonHome (or no home known),
// else ReasonSpill.
func (s prefixScorer) Reason(c *Cycle, w *pool.Worker) (Reason, bool) {
	switch {
	case w.InFlight() >= s.threshold:
		return ReasonAllFull, true
	case c.Home == nil || w == c.Home:
		return ReasonHome, true
	}
	return ReasonSpill, true
}

func (s prefixScorer) Score(c *Cycle, scores []float64) {
	home := -1
	c.Snap.Ring.Walk(c.Req.PrefixKey, func(m int) bool {
		if c.passed[m] {
			home = m
			return false
		}
		return true
	})
	if home < 0 {
		return
	}
	w := c.Snap.Workers[home]
	c.Home = w
	if !c.in[home] || w.InFlight() >= s.threshold {
		return
	}
	for i, j := range c.Index {
		if j == home {
			scores[i] = 1
			return
		}
	}
}

// maxPicker picks the highest total. Ties go to the first met scanning
// from the candidate after the request's home in snapshot (name) order,
// so that different homes spill to different workers, or from a random
// candidate when there is no home.
type maxPicker struct{}

func (maxPicker) Name() string { return "max" }

func (maxPicker) Pick(c *Cycle, totals []float64) int {
	n := len(totals)
	start := 0
	if c.Home != nil {
		for i, w := range c.Cands {
			if w.Name > c.Home.Name {
				start = i
				break
			}
		}
	} else if n > 1 {
		start = int(c.Rand(uint64(n)))
	}
	best := start
	for k := 1; k < n; k++ {
		i := start + k
		if i >= n {
			i -= n
		}
		if totals[i] > totals[best] {
			best = i
		}
	}
	return best
}

// randomPicker picks a uniformly random candidate, whatever the scores.
type randomPicker struct{}

func (randomPicker) Name() string { return "random" }

func (randomPicker) Pick(c *Cycle, _ []float64) int { return int(c.Rand(uint64(len(c.Cands)))) }

// roundRobinPicker picks the candidates in turn, whatever the scores.
type roundRobinPicker struct{ next *atomic.Uint64 }

func (roundRobinPicker) Name() string { return "round_robin" }

func (p roundRobinPicker) Pick(c *Cycle, _ []float64) int {
	return int((p.next.Add(1) - 1) % uint64(len(c.Cands)))
}

var (
	_ Filter   = availableFilter{}
	_ Filter   = modelFilter{}
	_ filterAt = availableFilter{}
	_ filterAt = modelFilter{}
	_ Scorer   = loadScorer{}
	_ Scorer   = prefixScorer{}
	_ Reasoner = prefixScorer{}
	_ Picker   = maxPicker{}
	_ Picker   = randomPicker{}
	_ Picker   = roundRobinPicker{}
)
