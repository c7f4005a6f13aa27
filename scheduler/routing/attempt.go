package routing

import (
	"time"

	"github.com/batonllm/baton/scheduler/pool"
)

// Attempt is one committed decision: a request served by a worker a
// strategy chose. It owns what the commit took, the worker's in-flight
// slot (and its breaker's call), the pin of the request's LoRA adapter on
// the worker, and what the strategy learns of the decision, and gives
// each back exactly once, whatever path the request takes: the first
// token (or the error that came instead) to Doner, the end to Finisher,
// then the pin and the slot.
//
// An Attempt is used from the request's goroutine (or, in the virtual
// clock, its event loop); its methods must not be called concurrently.
type Attempt struct {
	strategy Strategy
	req      *Request
	d        Decision
	release  func(error)
	hooks    Hooks
	fin      FinishInfo
	reported bool
	ended    bool
}

// Hooks are what an Attempt calls besides its strategy; nil fields are
// skipped.
type Hooks struct {
	// Unpin ends the pin of the request's adapter on the worker. It runs
	// when the attempt ends, before the slot is released.
	Unpin func()
	// Released runs after the worker's slot was released: the front end
	// wakes the requests queued for a free worker.
	Released func()
}

// Start acquires d.Worker's slot, through its breaker, and commits d to s
// (see Committer). If the breaker refuses, it returns Acquire's error,
// commits nothing and runs hooks.Unpin: the caller picks again or fails.
func Start(s Strategy, req *Request, d Decision, hooks Hooks) (*Attempt, error) {
	release, err := d.Worker.Acquire()
	if err != nil {
		if hooks.Unpin != nil {
			hooks.Unpin()
		}
		return nil, err
	}
	Commit(s, req, d)
	return &Attempt{strategy: s, req: req, d: d, release: release, hooks: hooks}, nil
}

// Decision is the committed decision.
func (a *Attempt) Decision() Decision { return a.d }

// Worker is the worker that serves the attempt.
func (a *Attempt) Worker() *pool.Worker { return a.d.Worker }

// Unestimated records that the request was not prefilled as the strategy
// estimated (on the worker, from what it held): its prompt came by
// transfer from another worker, so its first token says nothing of the
// estimate, which is dropped.
func (a *Attempt) Unestimated() { a.d.Estimate = 0 }

// FirstToken reports the time from the request's arrival to its first
// token (for a prefill worker, to the end of its prefill) to the strategy
// (see Doner). Only the first report of an attempt counts; a non-positive
// time reports that the worker answered without prefilling.
func (a *Attempt) FirstToken(t time.Duration) {
	if a.reported {
		return
	}
	a.reported = true
	Done(a.strategy, a.req, a.d, DoneInfo{FirstToken: t})
}

// Usage records what the worker reported of the request, which End hands
// to the strategy (see Finisher).
func (a *Attempt) Usage(promptTokens, cachedTokens int) {
	a.fin = FinishInfo{Usage: true, PromptTokens: promptTokens, CachedTokens: cachedTokens}
}

// End ends the attempt with err, nil when it succeeded: a strategy that
// heard no first token hears err (Doner), then the end (Finisher); the
// adapter pin ends; the slot is released, and its breaker hears
// breakerErr, the error as the worker's fault or not (pool.ClientError).
// Later calls do nothing.
func (a *Attempt) End(err, breakerErr error) {
	if a.ended {
		return
	}
	a.ended = true
	if !a.reported {
		a.reported = true
		Done(a.strategy, a.req, a.d, DoneInfo{Err: err})
	}
	Finish(a.strategy, a.req, a.d, a.fin)
	if a.hooks.Unpin != nil {
		a.hooks.Unpin()
	}
	a.release(breakerErr)
	if a.hooks.Released != nil {
		a.hooks.Released()
	}
}
