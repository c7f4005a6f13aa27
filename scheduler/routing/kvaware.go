package routing

import (
	"errors"
	"math"
	"strconv"
	"sync/atomic"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine/cost"
)

// KVAware is the name of the kv_aware strategy.
const KVAware = "kv_aware"

// errNoIndex: a strategy or scorer that reads the KV index was built
// without one (Deps.Index).
var errNoIndex = errors.New("needs the scheduler's KV index (Deps.Index)")

// tieTolerance is the relative difference under which two workers' scores
// tie (see NewKVAware for what breaks the tie): estimates built from load
// reports up to a report interval old, and corrected by a noisy factor,
// are not finer than that.
const tieTolerance = 0.03

// homeTolerance is how much slower than the best a prompt's home on the
// ring may be estimated and still take a prompt no worker holds. Load
// the engines report (queues, long decodes) moves estimates by more, and
// every replica reads it alike; what one replica routed since the last
// report moves them by less, and must not split a prefix between
// replicas.
const homeTolerance = 0.10

// Replication of a hot prefix onto an idle worker (docs/strategies.md,
// "Replication", says why these values): the chosen worker is hot when
// routed hotRouted times the candidates' mean of recent requests (above
// the mean when another candidate holds as much of the prompt) and at
// least hotMinRouted requests; a worker is idle when it has nothing in
// flight, queued or pending and was routed at most idleRouted times the
// mean; and the idle worker's estimate may exceed the holder's by at most
// replicateHorizon times the holder's estimate times its routed requests
// over the mean, less 1.
const (
	hotRouted        = 2.0
	idleRouted       = 0.25
	hotMinRouted     = 8
	replicateHorizon = 8
)

// NewKVAware returns the kv_aware profile over d.Index, which the watch
// streams of every worker feed (scheduler/watch): the kv scorer, alone,
// and the kv_aware picker. The scorer estimates each available worker's
// time to first token for the request (req.Keys, req.Tokens) from what
// the index knows of the worker and its cost figures, corrected by what
// the worker achieved; the picker takes the lowest estimate plus the
// compute the request costs there; ties go by the prompt's home on the
// ring, never by what one replica counts alone. A worker at the
// concurrency threshold is passed over (Spill, Home the best) unless
// every one is (ReasonAllFull); a hot prefix may be copied onto an idle
// worker (ReasonReplicate). The model, the tie rule and the replication
// policy are in docs/strategies.md.
//
// Commit records the request's blocks on the worker that serves it as
// predicted (kvindex.Index.Predict), so that siblings arriving before the
// worker's events see them, and counts the request in its Routed; on a
// worker that publishes no events (kvindex.Index.Learn) they stay, as the
// index's only knowledge of it, and Finish corrects them with the cached
// tokens the response reported. Done feeds the worker's correction factor
// with the achieved time to first token and takes the request's tokens off
// its pending prefill. Decision.PredictedCached is the prompt tokens the
// worker is expected to find in some tier, Decision.Estimate its estimated
// time to first token.
func NewKVAware(p Params, d Deps) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	p, d = p.withDefaults(), d.withDefaults()
	kv, err := newKVScorer(NoOptions{}, p, d)
	if err != nil {
		return nil, err
	}
	return (&Profile{
		name:      KVAware,
		filters:   kvAwareFilters,
		scorers:   []weighted{{Scorer: kv, weight: 1}},
		picker:    kvAwarePicker{threshold: p.ConcurrencyThreshold, replicate: true},
		rand:      d.Rand,
		threshold: p.ConcurrencyThreshold,
		base:      ReasonKVAware,
	}).wire(d.PartTimer), nil
}

// kvAwareFilters are kv_aware's: a worker that would load the request's
// adapter first stays a candidate (Request.LoadAdapter), since its
// estimate counts the load.
var kvAwareFilters = []Filter{availableFilter{}, modelFilter{}, adapterFilter{load: true}}

// kvScorer is kv_aware's scorer: it estimates each candidate's time to
// first token (Cycle.Estimates) and scores it by the lowest estimate
// plus compute over its own, 1 for the lowest; and it leaves its
// estimates in the cycle for the kv_aware picker.
type kvScorer struct {
	idx *kvindex.Index
	// roster is the latest snapshot's workers in the index, which
	// finds their places once per snapshot rather than per decision.
	roster atomic.Pointer[snapRoster]
}

// snapRoster is a snapshot's workers' roster in the index.
type snapRoster struct {
	snap *pool.Snapshot
	r    *kvindex.Roster
}

// rosterOf returns snap's workers' roster, made on its first decision.
func (s *kvScorer) rosterOf(snap *pool.Snapshot) *kvindex.Roster {
	if sr := s.roster.Load(); sr != nil && sr.snap == snap {
		return sr.r
	}
	names := make([]string, len(snap.Workers))
	for i := range names {
		names[i] = snap.Name(i)
	}
	sr := &snapRoster{snap: snap, r: s.idx.Roster(names)}
	s.roster.Store(sr)
	return sr.r
}

func newKVScorer(_ NoOptions, _ Params, d Deps) (Scorer, error) {
	if d.Index == nil {
		return nil, errNoIndex
	}
	return &kvScorer{idx: d.Index}, nil
}

func (*kvScorer) Name() string { return "kv" }

func (*kvScorer) UsesKeys() bool { return true }

// candidate is a worker's estimate.
type candidate struct {
	i       int     // the worker's position among the candidates; -1: none
	seconds float64 // estimated TTFT
	raw     float64 // seconds before the worker's correction factor
	score   float64 // seconds plus the compute the request costs the fleet
	load    int     // in flight
	routed  float64 // recently routed requests
	cached  int     // tokens expected cached
	idle    bool    // nothing in flight, queued or pending
}

// kvNotes are what the kv scorer leaves in a cycle for the kv_aware
// picker, beside each candidate's estimate (scratch.kvCands).
type kvNotes struct {
	ok          bool    // the kv scorer ran
	key         uint64  // where on the ring ties are broken
	routed      float64 // recently routed requests, over the candidates
	top, second int     // the most cached tokens of one candidate, of another
}

// choice is the best of the candidates one rule admits, as choose
// finds it: best indexes es (-1: none admitted), limit is the score
// within which others tie with it, tied how many of those hold as much
// of the prompt as best.
type choice struct {
	best  int
	limit float64
	tied  int
}

// choose returns the best candidate of es (all) and the best of those
// under threshold requests in flight (under), each with i < 0 for none:
// the lowest score, then, among those within tieTolerance of it, the
// most of the prompt cached, then the earliest on the ring walked from
// key. Nothing a replica counts alone (the requests it routed, those it
// has in flight) breaks a tie, so that replicas that see the same fleet
// choose alike. Both choices are made in the same two passes over es;
// the ring is walked only when candidates tie, and only as far as the
// first of them.
func choose(c *Cycle, es []candidate, key uint64, threshold int) (all, under candidate) {
	a, u := choice{best: -1}, choice{best: -1}
	for i := range es {
		e := &es[i]
		if a.best < 0 || e.score < es[a.best].score {
			a.best = i
		}
		if e.load < threshold && (u.best < 0 || e.score < es[u.best].score) {
			u.best = i
		}
	}
	if a.best < 0 {
		return candidate{i: -1}, candidate{i: -1}
	}
	a.limit = es[a.best].score * (1 + tieTolerance)
	if u.best >= 0 {
		u.limit = es[u.best].score * (1 + tieTolerance)
	}
	for i := range es {
		e := &es[i]
		if e.score <= a.limit {
			a.tie(es, i)
		}
		if u.best >= 0 && e.load < threshold && e.score <= u.limit {
			u.tie(es, i)
		}
	}
	all = a.resolve(c, es, key, func(*candidate) bool { return true })
	under = candidate{i: -1}
	if u.best >= 0 {
		under = u.resolve(c, es, key, func(e *candidate) bool { return e.load < threshold })
	}
	return all, under
}

// tie counts es[i], within ch's limit, among the candidates that tie
// with ch's best: the one holding the most of the prompt becomes the
// best.
func (ch *choice) tie(es []candidate, i int) {
	switch e, b := es[i].cached, es[ch.best].cached; {
	case e > b:
		ch.best, ch.tied = i, 1
	case e == b:
		ch.tied++
	}
}

// resolve returns ch's best, the earliest on the ring walked from key of
// the candidates ok admits that tie with it.
func (ch *choice) resolve(c *Cycle, es []candidate, key uint64, ok func(*candidate) bool) candidate {
	best := es[ch.best]
	if ch.tied <= 1 || c.Snap.Ring == nil {
		return best
	}
	limit, cached := ch.limit, best.cached
	pos := c.positions()
	c.Snap.Ring.Walk(key, func(m int) bool {
		if !c.in[m] {
			return true
		}
		e := &es[pos[m]]
		if ok(e) && e.score <= limit && e.cached == cached {
			best = *e
			return false
		}
		return true
	})
	return best
}

func (s *kvScorer) Score(c *Cycle, scores []float64) {
	cands := c.Cands
	req := c.Req
	cached, seconds := c.Estimates()
	es := c.sc.kvCands[:len(cands)]
	// One visit of every candidate: the index walks the prompt once per
	// block table, and no array of matches is written.
	p := &c.sc.kv
	*p = kvPass{req: req, snap: c.Snap, cands: cands, index: c.Index, es: es, cached: cached, seconds: seconds, least: math.Inf(1)}
	s.rosterOf(c.Snap).Visit(req.Keys, c.Index, p)
	routed, top, second, known, least := p.routed, p.top, p.second, p.known, p.least
	*p = kvPass{}
	// Ties go to the earlier candidate on the ring from the first block
	// past what any candidate holds: what every replica computes alike.
	key := req.PrefixKey
	if len(req.Keys) > 0 {
		key = req.Keys[min(known, len(req.Keys)-1)]
	}
	c.kv = kvNotes{ok: true, key: key, routed: routed, top: top, second: second}
	for i := range es {
		if v := es[i].score; v > least {
			scores[i] = least / v
		} else {
			scores[i] = 1
		}
	}
}

// kvAwarePicker is kv_aware's choice, over the estimates of the kv
// scorer of its profile (see NewKVAware): the best candidate under the
// threshold, ties by the prompt cached and the ring; a prompt no worker
// holds goes to its home on the ring unless the home is at the threshold
// or estimated well slower; a hot prefix may be copied onto an idle
// worker. With the kv scorer alone the candidates rank by its estimates;
// beside other scorers, by the profile's weighted totals. Without a kv
// scorer in the profile every prompt is one no worker holds.
type kvAwarePicker struct {
	threshold int
	replicate bool
}

// kvAwareOptions are the kv_aware picker's options in a profile.
type kvAwareOptions struct {
	// ConcurrencyThreshold is the requests in flight at which a worker is
	// passed over: 1–1,024; 0 means the strategy's concurrency_threshold.
	ConcurrencyThreshold int `yaml:"concurrency_threshold"`
	// Replicate lets a hot prefix be copied onto an idle worker. Default
	// true.
	Replicate *bool `yaml:"replicate"`
}

func (o *kvAwareOptions) Validate() error { return validThreshold(o.ConcurrencyThreshold, true) }

func newKVAwarePicker(o kvAwareOptions, p Params, _ Deps) (Picker, error) {
	k := kvAwarePicker{threshold: o.ConcurrencyThreshold, replicate: o.Replicate == nil || *o.Replicate}
	if k.threshold == 0 {
		k.threshold = p.ConcurrencyThreshold
	}
	return k, nil
}

func (kvAwarePicker) Name() string { return KVAware }

// Reason names a decision for a worker at the picker's threshold
// ReasonAllFull, and leaves the others to the profile.
func (k kvAwarePicker) Reason(_ *Cycle, w *pool.Worker) (Reason, bool) {
	return ReasonAllFull, w.InFlight() >= k.threshold
}

func (k kvAwarePicker) Pick(c *Cycle, totals []float64) int {
	cands := c.Cands
	es := c.sc.kvCands[:len(cands)]
	notes := c.kv
	switch {
	case !notes.ok:
		// No estimates: rank by the totals alone, a prompt nobody holds.
		for i, w := range cands {
			es[i] = candidate{i: i, score: 1 / totals[i], load: w.InFlight()}
		}
		notes.key = c.Req.PrefixKey
	case c.scorers > 1:
		// The totals rank; with the kv scorer alone they are its
		// estimates' order, which rank as they are.
		for i := range es {
			es[i].score = 1 / totals[i]
		}
	}
	key, threshold := notes.key, k.threshold
	bestAny, best := choose(c, es, key, threshold)
	idle := candidate{i: -1}
	minRaw := math.Inf(1) // the least uncorrected estimate under the threshold
	for i := range es {
		e := es[i]
		if e.idle && (idle.i < 0 || e.routed < idle.routed) {
			idle = e
		}
		if e.load < threshold {
			minRaw = min(minRaw, e.raw)
		}
	}
	c.Home = cands[bestAny.i]
	if best.i < 0 {
		best = bestAny
	}
	if notes.top == 0 {
		// No candidate holds any of the prompt: its home on the ring,
		// unless the home is at the threshold or estimated well slower
		// than the fastest (the load its engine reports); then the next
		// worker on the ring from the home that is neither, as
		// consistent hashing with bounded loads spills. Spilling along
		// the prompt's own walk, not to the fastest, keeps replicas that
		// have not yet heard of one another's latest requests from
		// sending a burst of new prompts all to the worker each sees as
		// least loaded. The estimates are compared before correction:
		// each replica learns its own factors, from the requests it
		// happened to serve.
		if c.Snap.Ring != nil {
			c.Home = nil
			pos := c.positions()
			c.Snap.Ring.Walk(key, func(m int) bool {
				if !c.passed[m] {
					return true
				}
				if c.Home == nil {
					c.Home = c.Snap.Workers[m]
				}
				if !c.in[m] {
					return true // full: its successor takes it
				}
				if h := es[pos[m]]; h.load < threshold && h.raw <= minRaw*(1+homeTolerance) {
					best = h
					return false
				}
				return true
			})
		}
		return best.i
	}
	if !k.replicate {
		return best.i
	}
	// A prefix another candidate holds as well (second ≥ best.cached)
	// binds no request to one worker: above the mean is hot enough.
	mean := notes.routed / float64(len(cands))
	hot := best.routed >= max(hotRouted*mean, hotMinRouted) ||
		notes.second >= best.cached && best.routed > mean && best.routed >= hotMinRouted
	if idle.i >= 0 && best.cached > idle.cached && best.load < threshold && hot && idle.routed <= idleRouted*mean &&
		idle.seconds-best.seconds <= replicateHorizon*best.seconds*(best.routed/mean-1) {
		best = idle
		c.Replicate = true
	}
	return best.i
}

// kvPass is one Score's visit of the index (kvindex.MatchVisitor): each
// candidate's estimate, and what the choice needs of them all.
type kvPass struct {
	req     *Request
	snap    *pool.Snapshot
	cands   []*pool.Worker
	index   []int // the candidates' positions in snap
	es      []candidate
	cached  []int
	seconds []float64
	least   float64 // the lowest score

	routed      float64 // sum over the candidates
	top, second int     // the most cached tokens of one candidate, of another
	known       int     // the most leading blocks one candidate would find
}

func (p *kvPass) VisitMatch(i int, m *kvindex.Match) {
	// The estimate is written in place: a candidate copied whole just
	// after its fields were stored stalls the copy's loads.
	e := &p.es[i]
	estimate(e, m, p.req, p.snap.InFlight(p.index[i]), adapterLoadSeconds(p.cands[i], p.req, &m.Cost))
	e.i = i
	e.idle = e.load == 0 && m.PendingTokens == 0 && m.Load.Running == 0 && m.Load.Waiting == 0
	p.cached[i], p.seconds[i] = e.cached, e.seconds
	p.least = min(p.least, e.score)
	p.routed += e.routed
	if e.cached > p.top {
		p.top, p.second = e.cached, p.top
	} else if e.cached > p.second {
		p.second = e.cached
	}
	p.known = max(p.known, m.GPU+m.CPU+m.Redis)
}

// Commit records req's blocks on the worker that serves it, as predicted.
func (s *kvScorer) Commit(req *Request, d Decision) {
	if len(req.Keys) > 0 && d.Worker != nil {
		s.idx.Predict(d.Worker.Name, req.Keys)
	}
}

// Done reports the achieved time to first token to the index, which
// corrects the worker's later estimates, and that the tokens it had to
// compute no longer wait there.
func (s *kvScorer) Done(req *Request, d Decision, info DoneInfo) {
	if d.Worker == nil || info.FirstToken <= 0 {
		return
	}
	s.idx.ObserveTTFT(d.Worker.Name, d.Estimate, info.FirstToken)
	s.idx.Prefilled(d.Worker.Name, max(req.Tokens-d.PredictedCached, 0))
}

// Finish tells the index what the worker reported of the request: on a
// worker that publishes no cache events, its cached tokens correct what
// the index learned there.
func (s *kvScorer) Finish(req *Request, d Decision, info FinishInfo) {
	if len(req.Keys) == 0 || d.Worker == nil {
		return
	}
	s.idx.Finished(d.Worker.Name, req.Keys, kvindex.Usage{
		OK: info.Usage, PromptTokens: info.PromptTokens, CachedTokens: info.CachedTokens,
		PredictedTokens: d.PredictedCached,
	})
}

// adapterLoadSeconds is the time w would take to load req's adapter
// before it prefills: none when it holds it (or req names none); else the
// load time the front end measured on w, or the adapter's size over w's
// host link (the PCIe bandwidth of its cost figures).
func adapterLoadSeconds(w *pool.Worker, req *Request, c *kvindex.Cost) float64 {
	if req.Adapter == "" || w.HoldsAdapter(req.Adapter) {
		return 0
	}
	if s := w.AdapterLoadSeconds(); s > 0 {
		return s
	}
	if req.AdapterBytes > 0 && c.PCIeBytesPerSecond > 0 {
		return float64(req.AdapterBytes) / c.PCIeBytesPerSecond
	}
	return 0
}

// estimate sets e to the estimated TTFT of req on the worker m describes,
// with load requests in flight, after loadAdapter seconds of loading the
// request's LoRA adapter; e.i and e.idle are the caller's.
func estimate(e *candidate, m *kvindex.Match, req *Request, load int, loadAdapter float64) {
	// Naming cost.Figures (kvindex.Cost's type) imports its package, without
	// which the compiler inlines none of the calls below.
	var c *cost.Figures = &m.Cost
	bt := m.BlockTokens
	tokens := req.Tokens
	if tokens <= 0 {
		tokens = len(req.Keys) * bt
	}
	local := min(tokens, (m.GPU+m.CPU)*bt)
	withRedis := min(tokens, (m.GPU+m.CPU+m.Redis)*bt)

	ahead := m.Load.WaitingPrefillTokens + m.PendingTokens
	queue := c.QueueSeconds(ahead, tokens)
	step := c.StepSeconds(m.Load.GPUBlocksUsed)
	// work is the time to prefill what is not cached once cached tokens
	// are: the compute, plus every step it takes (with those of the
	// tokens queued ahead) paying for the weights and the running
	// sequences' KV.
	work := func(cached int) float64 {
		return c.PrefillSeconds(tokens-cached, cached) +
			float64(c.Steps(ahead+int64(tokens-cached), m.Load.Running))*step
	}
	copyCPU := c.CPUCopySeconds(m.CPU)
	// The worker fetches Redis blocks when that beats recomputing them.
	cached := local
	cost := work(local)
	if withRedis > local {
		if fetch := c.RedisFetchSeconds(m.Redis) + work(withRedis); fetch < cost {
			cost, cached = fetch, withRedis
		}
	}
	corr := deadBand(m.Correction)
	// The front end loads an adapter before it sends the request there.
	ttft := (queue+copyCPU+cost)*corr + loadAdapter
	// The score adds the compute the request costs the fleet, so that a
	// worker recomputes a prefix another holds only when that saves more
	// time to first token than the recomputation burns; for prompts no
	// worker holds it adds the same everywhere.
	compute := c.PrefillSeconds(tokens-cached, cached) * corr
	e.seconds, e.raw, e.score = ttft, queue+copyCPU+cost+loadAdapter, ttft+compute
	e.load, e.routed, e.cached = load, m.Routed, cached
}

// correctionDeadBand is how far a worker's correction factor may stray
// from 1 before kv_aware applies it. Identical workers' factors wander by
// up to a fifth with the mix and timing of the requests they happened to
// serve, and a factor below its peers' draws uncached prompts, which load
// the worker and move its factor further: within the band that is noise
// the router must not amplify. A worker whose cost figures are wrong by
// more (a slower GPU, an HTTP engine estimated with DefaultCost) is
// corrected by the excess.
const correctionDeadBand = 0.25

// deadBand returns the factor kv_aware applies for correction c: 1 within
// correctionDeadBand of 1, else c moved toward 1 by the band, so that the
// factor applied grows continuously.
func deadBand(c float64) float64 {
	switch {
	case c <= 0:
		return 1
	case c > 1+correctionDeadBand:
		return c - correctionDeadBand
	case c < 1-correctionDeadBand:
		return c + correctionDeadBand
	}
	return 1
}

// RouteHit renders the X-Baton-Route header value of a decision of the
// named strategy for a prompt of tokens tokens: for kv_aware the
// predicted hit ratio, "kv_aware; predicted_hit=0.83" (with "; spill=true"
// appended when the request left its best worker for the threshold, and
// "; replicate=true" when it copies a hot prefix onto an idle worker),
// else d.Route(strategy).
// It allocates, so call it after the decision.
func (d Decision) RouteHit(strategy string, tokens int) string {
	if strategy != KVAware {
		return d.Route(strategy)
	}
	hit := 0.0
	if tokens > 0 && d.PredictedCached > 0 {
		hit = min(float64(d.PredictedCached)/float64(tokens), 1)
	}
	r := strategy + "; predicted_hit=" + strconv.FormatFloat(hit, 'f', 2, 64)
	if d.Spill {
		r += "; spill=true"
	}
	if d.Reason == ReasonReplicate {
		r += "; replicate=true"
	}
	return r
}

var (
	_ kvindex.MatchVisitor = (*kvPass)(nil)
	_ Scorer               = (*kvScorer)(nil)
	_ KeyUser              = (*kvScorer)(nil)
	_ Picker               = kvAwarePicker{}
	_ Reasoner             = kvAwarePicker{}
	_ Committer            = (*kvScorer)(nil)
	_ Doner                = (*kvScorer)(nil)
	_ Finisher             = (*kvScorer)(nil)
)
