package routing

import (
	"sync/atomic"

	"github.com/batonllm/baton/scheduler/pool"
)

// The content-blind baselines have no concurrency threshold: they choose
// among all available workers, and a worker being full is the front end's
// queue's concern.

// NewRandom returns the random strategy: a uniformly random available
// worker.
func NewRandom(p Params) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &random{rand: p.withDefaults().Rand}, nil
}

type random struct{ rand func(uint64) uint64 }

func (*random) Name() string { return Random }

func (s *random) Pick(req *Request, snap *pool.Snapshot) (Decision, error) {
	n := countEligible(snap.Workers, req.Model)
	if n == 0 {
		return Decision{}, ErrNoWorker
	}
	return nthEligible(snap.Workers, req.Model, int(s.rand(uint64(n))), ReasonRandom)
}

// NewRoundRobin returns the round_robin strategy: the available workers in
// turn, in name order.
func NewRoundRobin(p Params) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &roundRobin{}, nil
}

type roundRobin struct{ next atomic.Uint64 }

func (*roundRobin) Name() string { return RoundRobin }

func (s *roundRobin) Pick(req *Request, snap *pool.Snapshot) (Decision, error) {
	n := countEligible(snap.Workers, req.Model)
	if n == 0 {
		return Decision{}, ErrNoWorker
	}
	return nthEligible(snap.Workers, req.Model, int((s.next.Add(1)-1)%uint64(n)), ReasonRoundRobin)
}

// NewLeastOutstanding returns the least_outstanding strategy: the available
// worker with the fewest requests in flight. The scan starts at a random
// worker and keeps the first minimum it meets, which breaks ties randomly.
func NewLeastOutstanding(p Params) (Strategy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &leastOutstanding{rand: p.withDefaults().Rand}, nil
}

type leastOutstanding struct{ rand func(uint64) uint64 }

func (*leastOutstanding) Name() string { return LeastOutstanding }

func (s *leastOutstanding) Pick(req *Request, snap *pool.Snapshot) (Decision, error) {
	ws := snap.Workers
	if len(ws) == 0 {
		return Decision{}, ErrNoWorker
	}
	best := leastLoaded(ws, req.Model, int(s.rand(uint64(len(ws)))))
	if best == nil {
		return Decision{}, ErrNoWorker
	}
	return Decision{Worker: best, Reason: ReasonLeastOutstanding}, nil
}

// countEligible returns the number of workers eligible for model.
func countEligible(ws []*pool.Worker, model string) int {
	n := 0
	for _, w := range ws {
		if eligible(w, model) {
			n++
		}
	}
	return n
}

// nthEligible returns the k-th (from 0) worker eligible for model. Workers
// may turn unavailable after they were counted; then it settles for the
// last eligible worker it saw.
func nthEligible(ws []*pool.Worker, model string, k int, reason Reason) (Decision, error) {
	var last *pool.Worker
	for _, w := range ws {
		if !eligible(w, model) {
			continue
		}
		if k == 0 {
			return Decision{Worker: w, Reason: reason}, nil
		}
		k--
		last = w
	}
	if last == nil {
		return Decision{}, ErrNoWorker
	}
	return Decision{Worker: last, Reason: reason}, nil
}

// leastLoaded returns the eligible worker with the fewest requests in
// flight, scanning from ws[start] around; the first minimum met wins. It
// returns nil if no worker is eligible.
func leastLoaded(ws []*pool.Worker, model string, start int) *pool.Worker {
	var best *pool.Worker
	bestLoad := 0
	for i := range ws {
		j := start + i
		if j >= len(ws) {
			j -= len(ws)
		}
		w := ws[j]
		if !eligible(w, model) {
			continue
		}
		if load := w.InFlight(); best == nil || load < bestLoad {
			best, bestLoad = w, load
		}
	}
	return best
}

var (
	_ Strategy = (*random)(nil)
	_ Strategy = (*roundRobin)(nil)
	_ Strategy = (*leastOutstanding)(nil)
)
