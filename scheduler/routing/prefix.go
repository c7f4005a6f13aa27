package routing

import (
	"github.com/batonllm/baton/scheduler/pool"
)

// NewPrefixAware returns the prefix_aware strategy, SageMaker's
// prefix-aware routing. A request's PrefixKey is hashed onto the
// snapshot's ring; walking the ring from there, the first available worker
// serving the model is its home, so requests sharing a prefix (and tenant
// and model) meet on the worker that caches it, and a membership change
// moves about 1/N of the prefixes. A home that is unavailable passes its
// prefixes to its ring successors only.
//
// If the home has ConcurrencyThreshold requests in flight or more, the
// request spills to the least-loaded available worker (ties go to the
// first in name order after the home, so different homes spill to
// different workers). If every worker is at the threshold, the least
// loaded is still chosen: the front end queues or answers 429.
func NewPrefixAware(p Params) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &prefixAware{threshold: p.withDefaults().ConcurrencyThreshold}, nil
}

type prefixAware struct{ threshold int }

func (*prefixAware) Name() string { return PrefixAware }

func (s *prefixAware) Pick(req *Request, snap *pool.Snapshot) (Decision, error) {
	ws := snap.Workers
	home := -1
	snap.Ring.Walk(req.PrefixKey, func(m int) bool {
		if eligible(ws[m], req.Model) {
			home = m
			return false
		}
		return true
	})
	if home < 0 {
		return Decision{}, ErrNoWorker
	}
	w := ws[home]
	if w.InFlight() < s.threshold {
		return Decision{Worker: w, Home: w, Reason: ReasonHome}, nil
	}
	// Scan from the worker after the home, ending with the home itself, so
	// that the home wins only when it is strictly the least loaded.
	start := home + 1
	if start == len(ws) {
		start = 0
	}
	best := leastLoaded(ws, req.Model, start)
	if best == nil {
		best = w // every other worker turned unavailable meanwhile
	}
	reason := ReasonSpill
	if best == w || best.InFlight() >= s.threshold {
		reason = ReasonAllFull
	}
	return Decision{Worker: best, Home: w, Spill: best != w, Reason: reason}, nil
}

var _ Strategy = (*prefixAware)(nil)
