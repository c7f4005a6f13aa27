package routing

// NewPrefixAware returns the prefix_aware profile, SageMaker's
// prefix-aware routing: the prefix scorer (weight 1) sends a request to
// its prefix's home on the ring while the home has fewer than
// ConcurrencyThreshold requests in flight; past it the load scorer
// (weight 1, at most 1) decides, and the request spills to the
// least-loaded worker, ties going to the first in name order after the
// home. If every worker is at the threshold, the least loaded is still
// chosen (ReasonAllFull): the caller queues or answers 429.
func NewPrefixAware(p Params, d Deps) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p, d = p.withDefaults(), d.withDefaults()
	return (&Profile{
		name:      PrefixAware,
		filters:   defaultFilters,
		scorers:   []weighted{{Scorer: prefixScorer{threshold: p.ConcurrencyThreshold}, weight: 1}, {Scorer: loadScorer{}, weight: 1}},
		picker:    maxPicker{},
		rand:      d.Rand,
		threshold: p.ConcurrencyThreshold,
	}).wire(d.PartTimer), nil
}
