package routing

import (
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/batonllm/baton/scheduler/pool"
)

// ErrFull is returned by a profile's Pick when workers could serve the
// request but every one of them is at the request's capacity
// (Request.MaxInFlight): the caller waits for one to free up and picks
// again.
var ErrFull = errors.New("every worker at capacity")

// A Filter drops the workers a request may not go to. Keep is called on
// the hot path for each worker of the snapshot, from request goroutines
// at once: it must not block or allocate.
type Filter interface {
	Name() string
	Keep(req *Request, w *pool.Worker) bool
}

// filterAt is a Filter that reads the workers' state from the snapshot,
// by their positions (pool.Snapshot's Available, Serves…), rather than
// from the Workers, as the built-in filters do: a pick reads the statuses
// the snapshot holds side by side, not a Worker each, and calls the
// filter once for them all.
type filterAt interface {
	// keepAt clears keep[i] for each worker i of s that keep[i] holds and
	// the filter drops.
	keepAt(req *Request, s *pool.Snapshot, keep []bool)
}

// A Scorer rates the candidates that passed a profile's filters:
// scores[i], for c.Cands[i], in [0, 1], higher is better; scores arrives
// zeroed. A profile sums its scorers' scores, each times its weight. Score
// is called on the hot path from request goroutines at once: it must not
// block or allocate, and must change nothing but c and scores (what a
// strategy records of its choices, it records when the caller commits:
// see Committer). It may note in c what the decision reports: the
// request's home worker, expected cache hits and time to first token.
type Scorer interface {
	Name() string
	Score(c *Cycle, scores []float64)
}

// A Picker chooses a candidate, c.Cands[i], by the candidates' total
// scores. Its contract is Scorer's.
type Picker interface {
	Name() string
	Pick(c *Cycle, totals []float64) int
}

// Cycle is one request's pass through a profile: what its scorers and
// picker read, and what the scorers note for the decision. It lives for
// one Pick; do not keep it.
type Cycle struct {
	Req  *Request
	Snap *pool.Snapshot
	// Cands are the workers that passed the filters, in snapshot order;
	// Index[i] is Cands[i]'s position in Snap.Workers.
	Cands []*pool.Worker
	Index []int

	// Home is the worker the request's prefix belongs to, when a scorer
	// knows one (nil otherwise); Home need not be a candidate.
	Home *pool.Worker
	// Cached and Seconds are, per candidate, the prompt tokens it is
	// expected to find cached and its estimated time to first token;
	// nil until a scorer calls Estimates.
	Cached  []int
	Seconds []float64
	// Replicate: a part chose to copy a hot prefix onto an idle worker
	// (ReasonReplicate), as the kv_aware picker does.
	Replicate bool

	// scorers is the number of the profile's scorers; kv what the kv
	// scorer noted for the kv_aware picker.
	scorers int
	kv      kvNotes

	rand func(uint64) uint64
	// in and passed are by snapshot position: a candidate, and a worker
	// that passed the filters (a candidate, or at capacity).
	in, passed []bool
	sc         *scratch
}

// Candidate reports whether the snapshot's i-th worker is a candidate.
func (c *Cycle) Candidate(i int) bool { return c.in[i] }

// Passed reports whether the snapshot's i-th worker passed the filters:
// a candidate, or a worker left out only for being at capacity. A
// request's home is the first such worker on the ring, so that a full
// home sends its requests elsewhere as a spill.
func (c *Cycle) Passed(i int) bool { return c.passed[i] }

// Rand returns a uniformly random number in [0, n), n > 0, from the
// profile's source.
func (c *Cycle) Rand(n uint64) uint64 { return c.rand(n) }

// RingRanks returns, by candidate, its rank on the snapshot's ring walked
// from key: 0 for the first candidate met, 1 for the next… It is the
// same on every scheduler replica that sees the same candidates, however
// each has routed so far, which makes it the tie-break replicas agree on.
func (c *Cycle) RingRanks(key uint64) []int {
	n := len(c.Cands)
	ranks, pos := c.sc.ranks[:n], c.positions()
	for i := range ranks {
		ranks[i] = n // a candidate the ring lacks ranks last
	}
	if c.Snap.Ring == nil {
		return ranks
	}
	r := 0
	c.Snap.Ring.Walk(key, func(m int) bool {
		if c.in[m] {
			ranks[pos[m]] = r
			r++
		}
		return r < n
	})
	return ranks
}

// positions returns, by snapshot position, the candidate's index in
// Cands (only candidates' positions are set).
func (c *Cycle) positions() []int {
	pos := c.sc.pos[:len(c.in)]
	for i, j := range c.Index {
		pos[j] = i
	}
	return pos
}

// Estimates returns zeroed per-candidate Cached and Seconds slices, kept
// in c for the decision.
func (c *Cycle) Estimates() (cached []int, seconds []float64) {
	n := len(c.Cands)
	c.Cached, c.Seconds = c.sc.cached[:n], c.sc.seconds[:n]
	clear(c.Cached)
	clear(c.Seconds)
	return c.Cached, c.Seconds
}

// scratch is a pick's working memory, pooled so that picks do not
// allocate once the pool has warmed.
type scratch struct {
	c       Cycle
	cands   []*pool.Worker
	index   []int
	in      []bool
	passed  []bool
	totals  []float64
	scores  []float64
	cached  []int
	seconds []float64
	// kv_aware's visit of the index.
	kv kvPass
	// kv_aware's estimates by candidate, and the candidates' ranks on the
	// ring (RingRanks) with the snapshot-to-candidate positions they are
	// computed through.
	kvCands []candidate
	ranks   []int
	pos     []int
}

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

func getScratch(n int) *scratch {
	s := scratchPool.Get().(*scratch)
	if cap(s.in) < n {
		s.cands = make([]*pool.Worker, 0, n)
		s.index = make([]int, 0, n)
		s.in = make([]bool, n)
		s.passed = make([]bool, n)
		s.totals = make([]float64, n)
		s.scores = make([]float64, n)
		s.cached = make([]int, n)
		s.seconds = make([]float64, n)
		s.kvCands = make([]candidate, n)
		s.ranks = make([]int, n)
		s.pos = make([]int, n)
	}
	return s
}

func putScratch(s *scratch) {
	clear(s.cands[:cap(s.cands)]) // drop worker references
	s.c = Cycle{}
	scratchPool.Put(s)
}

// weighted is a scorer, its weight and its name in a profile (the
// scorer's Name when empty).
type weighted struct {
	Scorer
	weight float64
	name   string
}

// A Reasoner is a Scorer or Picker that names the decisions of the
// profiles it is part of (Decision.Reason, the reason label of the
// routing metrics). Reason is called once per Pick, after the picker
// chose w, with the cycle as the parts left it; like Score it must not
// block or allocate. It returns ok false to leave the naming to the
// profile's next reasoner. A decision that replicates (Cycle.Replicate)
// is ReasonReplicate; others, the profile asks its scorers in order, then
// its picker; when none names the decision, it is ReasonAllFull if w is
// at the profile's concurrency threshold, else the profile's own reason
// (ReasonScored for a custom profile).
type Reasoner interface {
	Reason(c *Cycle, w *pool.Worker) (r Reason, ok bool)
}

// Profile is a named routing strategy built from the pipeline's parts:
// filters, then weighted scorers, then a picker. Besides its filters,
// every profile drops the workers the request already tried
// (Request.Tried) and, with Request.MaxInFlight set, those at capacity.
// A Profile is safe for concurrent use.
type Profile struct {
	name    string
	filters []Filter
	at      []filterAt // by filter, nil for those that are not filterAts
	scorers []weighted
	picker  Picker
	rand    func(uint64) uint64
	// threshold: a decision for a worker with that many requests in
	// flight is ReasonAllFull, unless a Reasoner names it; 0 for none.
	threshold int
	base      Reason
	usesKeys  bool
	reasoners []Reasoner  // scorers, then the picker, that name decisions
	committer []Committer // scorers that record their choices
	doner     []Doner     // scorers that learn from the outcomes
	finisher  []Finisher  // scorers that learn from what workers reported
	// timers hear each part's time (Deps.PartTimer): the filters, each
	// scorer in order, the picker; nil when not timed.
	timers []func(time.Duration)
}

// wire finds which of p's scorers and picker implement the optional
// interfaces (Reasoner, Committer, Doner, Finisher, KeyUser), sets up its
// part timers from pt (nil: not timed) and returns p.
func (p *Profile) wire(pt func(profile, part string) func(time.Duration)) *Profile {
	p.at = make([]filterAt, len(p.filters))
	for i, f := range p.filters {
		p.at[i], _ = f.(filterAt)
	}
	for i := range p.scorers {
		s := &p.scorers[i]
		if s.name == "" {
			s.name = s.Name()
		}
		if r, ok := s.Scorer.(Reasoner); ok {
			p.reasoners = append(p.reasoners, r)
		}
		if c, ok := s.Scorer.(Committer); ok {
			p.committer = append(p.committer, c)
		}
		if d, ok := s.Scorer.(Doner); ok {
			p.doner = append(p.doner, d)
		}
		if f, ok := s.Scorer.(Finisher); ok {
			p.finisher = append(p.finisher, f)
		}
		if k, ok := s.Scorer.(KeyUser); ok && k.UsesKeys() {
			p.usesKeys = true
		}
	}
	if r, ok := p.picker.(Reasoner); ok {
		p.reasoners = append(p.reasoners, r)
	}
	if pt == nil {
		return p
	}
	p.timers = append(p.timers, pt(p.name, "filters"))
	for _, s := range p.scorers {
		p.timers = append(p.timers, pt(p.name, s.name))
	}
	p.timers = append(p.timers, pt(p.name, "picker"))
	return p
}

// lap reports the time since *t to the i-th part timer and moves *t on,
// past the report, so that no part is charged for the one before's.
func (p *Profile) lap(i int, t *time.Time) {
	p.timers[i](time.Since(*t))
	*t = time.Now()
}

// Name is the profile's name, as rendered in X-Baton-Route.
func (p *Profile) Name() string { return p.name }

// UsesKeys reports whether a scorer routes on block keys.
func (p *Profile) UsesKeys() bool { return p.usesKeys }

// Commit commits d to the scorers that record their choices.
func (p *Profile) Commit(req *Request, d Decision) {
	for _, c := range p.committer {
		c.Commit(req, d)
	}
}

// Done reports the outcome of d to the scorers that learn from it.
func (p *Profile) Done(req *Request, d Decision, info DoneInfo) {
	for _, x := range p.doner {
		x.Done(req, d, info)
	}
}

// Finish reports the end of d to the scorers that learn from it.
func (p *Profile) Finish(req *Request, d Decision, info FinishInfo) {
	for _, x := range p.finisher {
		x.Finish(req, d, info)
	}
}

// Pick runs the pipeline. It returns ErrNoWorker when no worker passes
// the filters, ErrFull when some would but are at capacity.
func (p *Profile) Pick(req *Request, snap *pool.Snapshot) (Decision, error) {
	ws := snap.Workers
	sc := getScratch(len(ws))
	defer putScratch(sc)
	c := &sc.c
	timed := p.timers != nil
	var t time.Time
	if timed {
		t = time.Now()
	}
	*c = Cycle{Req: req, Snap: snap, rand: p.rand, in: sc.in[:len(ws)], passed: sc.passed[:len(ws)], sc: sc, scorers: len(p.scorers)}
	clear(c.in)
	p.filter(req, snap, c.passed)
	cands, index := sc.cands[:0], sc.index[:0]
	full := false
	for i, w := range ws {
		if !c.passed[i] {
			continue
		}
		if req.MaxInFlight > 0 && snap.InFlight(i) >= req.MaxInFlight {
			full = true
			continue
		}
		cands, index = append(cands, w), append(index, i)
		c.in[i] = true
	}
	if len(cands) == 0 {
		if full {
			return Decision{}, ErrFull
		}
		return Decision{}, ErrNoWorker
	}
	if timed {
		p.lap(0, &t)
	}
	c.Cands, c.Index = cands, index
	totals := sc.totals[:len(cands)]
	clear(totals)
	for j, s := range p.scorers {
		scores := sc.scores[:len(cands)]
		clear(scores)
		s.Score(c, scores)
		for i, v := range scores {
			totals[i] += s.weight * v
		}
		if timed {
			p.lap(1+j, &t)
		}
	}
	k := p.picker.Pick(c, totals)
	if timed {
		p.lap(len(p.timers)-1, &t)
	}
	w := cands[k]
	d := Decision{Worker: w, Home: c.Home, Spill: c.Home != nil && w != c.Home && !c.Replicate, Reason: p.reason(c, w)}
	if c.Cached != nil {
		d.PredictedCached = c.Cached[k]
		d.Estimate = time.Duration(c.Seconds[k] * float64(time.Second))
	}
	return d, nil
}

// filter sets keep[i] for each worker i of s that passes the filters
// and is not one of Request.Tried. Each filter hears only the workers
// the filters before it kept.
func (p *Profile) filter(req *Request, s *pool.Snapshot, keep []bool) {
	for i := range keep {
		keep[i] = true
	}
	for j, f := range p.filters {
		if a := p.at[j]; a != nil {
			a.keepAt(req, s, keep)
			continue
		}
		for i, ok := range keep {
			if ok && !f.Keep(req, s.Workers[i]) {
				keep[i] = false
			}
		}
	}
	if len(req.Tried) == 0 {
		return
	}
	for i, ok := range keep {
		if ok && slices.Contains(req.Tried, s.Workers[i]) {
			keep[i] = false
		}
	}
}

func (p *Profile) reason(c *Cycle, w *pool.Worker) Reason {
	if c.Replicate {
		return ReasonReplicate
	}
	for _, x := range p.reasoners {
		if r, ok := x.Reason(c, w); ok {
			return r
		}
	}
	if p.threshold > 0 && w.InFlight() >= p.threshold {
		return ReasonAllFull
	}
	return p.base
}

var (
	_ Strategy  = (*Profile)(nil)
	_ KeyUser   = (*Profile)(nil)
	_ Committer = (*Profile)(nil)
	_ Doner     = (*Profile)(nil)
)
