package routing

import "sync/atomic"

// The content-blind baselines have no concurrency threshold: they choose
// among all available workers, and a worker being full is the caller's
// queue's concern.

// NewRandom returns the random profile: a uniformly random available
// worker.
func NewRandom(p Params, d Deps) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p, d = p.withDefaults(), d.withDefaults()
	return (&Profile{name: Random, filters: defaultFilters, picker: randomPicker{}, rand: d.Rand, base: ReasonRandom}).wire(d.PartTimer), nil
}

// NewRoundRobin returns the round_robin profile: the available workers in
// turn, in name order.
func NewRoundRobin(p Params, d Deps) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p, d = p.withDefaults(), d.withDefaults()
	return (&Profile{name: RoundRobin, filters: defaultFilters, picker: roundRobinPicker{next: new(atomic.Uint64)}, rand: d.Rand, base: ReasonRoundRobin}).wire(d.PartTimer), nil
}

// NewLeastOutstanding returns the least_outstanding profile: the available
// worker with the fewest requests in flight (the load scorer); ties go to
// the first met from a random worker.
func NewLeastOutstanding(p Params, d Deps) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p, d = p.withDefaults(), d.withDefaults()
	return (&Profile{name: LeastOutstanding, filters: defaultFilters, scorers: []weighted{{Scorer: loadScorer{}, weight: 1}},
		picker: maxPicker{}, rand: d.Rand, base: ReasonLeastOutstanding}).wire(d.PartTimer), nil
}
