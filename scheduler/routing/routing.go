// Package routing chooses the worker that serves a request. Strategies are
// built by name from a Registry, each from its own validated Params (its
// configuration) and the Deps its builder gives it at run time; every
// strategy reads the pool's immutable Snapshot and sees only the workers
// that are available for the request.
package routing

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
)

// ErrNoWorker is returned by Strategy.Pick when no worker is available for
// the request: none is healthy with its breaker closed or half-open and
// serving the model. The front end answers 503.
var ErrNoWorker = errors.New("no worker available")

// Request is what a strategy knows of a request.
type Request struct {
	// Model is the model the client asked for: for a LoRA adapter, its
	// base model.
	Model string
	// Adapter is the LoRA adapter the client asked for, empty for a base
	// model: only workers that hold it are eligible.
	Adapter string
	// LoadAdapter lets profiles that count adapter loads (kv_aware) also
	// pick a worker that would have to load Adapter first (it has slots,
	// a free one or an idle adapter to evict), with the load in its
	// estimate; the front end then loads it there. AdapterBytes is the
	// adapter's size, 0 when unknown.
	LoadAdapter  bool
	AdapterBytes int64
	// Tenant is the request's tenant id (prompt_cache_key or
	// X-Prefix-Aware-Id), empty if none.
	Tenant string
	// PrefixKey is blockkey.Prefix (or PrefixBytes) of the routing text,
	// seeded with blockkey.Seed of the model asked for (an adapter's own
	// name, so that its keys are never its base model's) and Tenant,
	// computed by the front end.
	PrefixKey uint64
	// Keys are the chained keys of the routing text's full blocks
	// (blockkey.Append), computed by the front end only for strategies
	// that implement KeyUser; Tokens is the prompt's length in tokens.
	Keys   []uint64
	Tokens int
	// Tried are workers the request already failed on: no profile picks
	// them again.
	Tried []*pool.Worker
	// MaxInFlight, when positive, is a worker's capacity: workers with
	// that many requests in flight are not picked, and when they are all
	// that could serve, Pick returns ErrFull.
	MaxInFlight int
}

// KeyUser is implemented by strategies that route on block keys (kv_aware):
// the front end computes Request.Keys for them.
type KeyUser interface {
	UsesKeys() bool
}

// UsesKeys reports whether s routes on block keys (and the KV index).
func UsesKeys(s Strategy) bool {
	k, ok := s.(KeyUser)
	return ok && k.UsesKeys()
}

// Decision is a strategy's choice. It is read-only until the caller
// commits it (Commit), once the worker is final: a retry or a full worker
// may replace Worker first.
type Decision struct {
	// Worker serves the request.
	Worker *pool.Worker
	// Home is the worker the request's prefix maps to, for strategies that
	// map prefixes (nil otherwise). Worker differs from Home when the
	// request spilled.
	Home *pool.Worker
	// Spill reports that the request left the worker its prefix maps to
	// because that worker was at the concurrency threshold.
	Spill bool
	// PredictedCached is the number of prompt tokens the strategy expects
	// the worker to find cached in some tier (kv_aware), 0 when it makes
	// no prediction.
	PredictedCached int
	// Estimate is the strategy's estimated time to first token on Worker
	// (kv_aware), 0 when it makes no estimate.
	Estimate time.Duration
	// Reason says why Worker was chosen.
	Reason Reason
}

// Reason says why a Decision chose its worker.
type Reason uint8

// Reasons for a Decision.
const (
	ReasonRandom Reason = iota
	ReasonRoundRobin
	ReasonLeastOutstanding
	// ReasonHome: the worker the prefix maps to, under the threshold.
	ReasonHome
	// ReasonSpill: the home was at the threshold; the least-loaded worker
	// was under it.
	ReasonSpill
	// ReasonAllFull: every available worker was at the threshold; the
	// least loaded was chosen anyway and the front end may queue.
	ReasonAllFull
	// ReasonKVAware: kv_aware chose the worker with the lowest estimated
	// time to first token among those under the threshold.
	ReasonKVAware
	// ReasonRetry: the caller replaced the strategy's choice, a worker
	// the request had already tried, with the least-loaded untried one.
	ReasonRetry
	// ReasonFull: the caller replaced the strategy's choice, a worker at
	// capacity (max_in_flight), with the least-loaded one with room.
	ReasonFull
	// ReasonScored: a custom profile chose the highest total score.
	ReasonScored
	// ReasonReplicate: kv_aware copied a hot prefix onto an idle worker.
	ReasonReplicate
)

var reasonNames = [...]string{"random", "round_robin", "least_outstanding", "home", "spill", "all_full", "kv_aware", "retry", "full", "scored", "replicate"}

func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "reason(" + strconv.Itoa(int(r)) + ")"
}

// Committer is implemented by strategies that keep state about their
// choices (kv_aware: the blocks a request will create on its worker, and
// the traffic each worker was given). Commit is called once per request
// and worker, after the worker was acquired and will serve the request,
// with the final decision: never for a choice the caller replaced, nor for
// a pick repeated while the request waited in the queue.
type Committer interface {
	Commit(req *Request, d Decision)
}

// Commit commits d to s if s keeps state about its choices.
func Commit(s Strategy, req *Request, d Decision) {
	if c, ok := s.(Committer); ok {
		c.Commit(req, d)
	}
}

// DoneInfo is what became of a committed decision's prefill.
type DoneInfo struct {
	// FirstToken is the time from the request's arrival to its first
	// token (for a prefill worker, to the end of its prefill); 0 when the
	// attempt ended without one, or the worker skipped the prefill.
	FirstToken time.Duration
	// Err is the error that ended the attempt without a first token.
	Err error
}

// Doner is implemented by strategies that learn from the outcome of their
// choices (kv_aware: achieved against estimated time to first token, and
// the prompt tokens no longer waiting on the worker). Done is called once
// per committed decision, from the request's goroutine, as soon as the
// prefill's outcome is known: when the first token arrives, or when the
// attempt ends without one. It must not block. A worker's breaker and
// in-flight count hear the attempt's end through pool.Worker.Acquire's
// callback, not here.
type Doner interface {
	Done(req *Request, d Decision, info DoneInfo)
}

// Done reports the outcome of the committed decision d to s if s learns
// from its choices.
func Done(s Strategy, req *Request, d Decision, info DoneInfo) {
	if x, ok := s.(Doner); ok {
		x.Done(req, d, info)
	}
}

// FinishInfo is what a worker reported of a committed request once it
// ended.
type FinishInfo struct {
	// Usage: the worker reported the request's usage; PromptTokens and
	// CachedTokens are its counts, in the engine's tokens.
	Usage                      bool
	PromptTokens, CachedTokens int
}

// Finisher is implemented by strategies that learn from what the worker
// reported of their choices (kv_aware: the cached tokens of engines that
// publish no cache events, which correct what the KV index learned of
// them). Finish is called once per committed decision, after Done, from
// the request's goroutine, when the attempt ended, whether or not it
// succeeded or reported usage. It must not block.
type Finisher interface {
	Finish(req *Request, d Decision, info FinishInfo)
}

// Finish reports the end of the committed decision d to s if s learns
// from it.
func Finish(s Strategy, req *Request, d Decision, info FinishInfo) {
	if x, ok := s.(Finisher); ok {
		x.Finish(req, d, info)
	}
}

// Route renders the X-Baton-Route header value of the decision made by the
// named strategy, such as "prefix_aware; spill=false". It allocates, so call
// it after the decision, not within Pick.
func (d Decision) Route(strategy string) string {
	return strategy + "; spill=" + strconv.FormatBool(d.Spill)
}

// Strategy chooses a worker for each request.
//
// Pick is called concurrently from request goroutines, on the hot path of
// every request: it must not block, must not allocate, and reads only snap
// (immutable), the workers' atomic state (health, breaker, in-flight) and
// what the strategy reads of the fleet (the KV index); it changes nothing:
// the caller may discard its decision, or pick again. What a strategy
// records of its choices it records in Commit (see Committer).
// It considers only workers that are Available and Serve req.Model; a
// strategy with a concurrency threshold also prefers workers under it. It
// returns ErrNoWorker when no worker is available for the request, and no
// other error. Pick does not acquire the worker: the caller calls
// Worker.Acquire, and picks again (or fails) if the breaker refuses.
type Strategy interface {
	// Name is the strategy's registered name, as rendered in
	// X-Baton-Route.
	Name() string
	Pick(req *Request, snap *pool.Snapshot) (Decision, error)
}

// Limits and default of Params.ConcurrencyThreshold.
const (
	MinConcurrencyThreshold = 1
	MaxConcurrencyThreshold = 1024
	// DefaultConcurrencyThreshold is 16 requests in flight per worker:
	// about the batch at which a single-GPU engine's decode throughput
	// stops growing for 7–8B models, so below it a request loses little by
	// sharing its cached prefix's worker, and above it the queue costs more
	// than recomputing the prefix elsewhere.
	DefaultConcurrencyThreshold = 16
)

// Params are a strategy's configuration, as the configuration file gives
// it; each strategy uses those it needs. The zero value means every
// default. What the strategy is given at run time is in Deps.
type Params struct {
	// ConcurrencyThreshold is the number of requests in flight at which
	// prefix_aware spills a request away from its home worker. 1–1,024;
	// 0 means DefaultConcurrencyThreshold.
	ConcurrencyThreshold int `yaml:"concurrency_threshold"`
}

// withDefaults returns p with its zero fields set to their defaults.
func (p Params) withDefaults() Params {
	if p.ConcurrencyThreshold == 0 {
		p.ConcurrencyThreshold = DefaultConcurrencyThreshold
	}
	return p
}

// Validate reports the first invalid field of p, after defaults are
// applied, naming the field as it is spelled in configuration.
func (p Params) Validate() error {
	return validThreshold(p.withDefaults().ConcurrencyThreshold, false)
}

// validThreshold checks a concurrency_threshold field: 0 (the default)
// when zero is true, else 1–1,024.
func validThreshold(t int, zero bool) error {
	if zero && t == 0 || t >= MinConcurrencyThreshold && t <= MaxConcurrencyThreshold {
		return nil
	}
	return fmt.Errorf("concurrency_threshold: must be %d–%d, got %d", MinConcurrencyThreshold, MaxConcurrencyThreshold, t)
}

// Deps are what whoever builds a strategy (the scheduler, a simulation,
// a test) gives it at run time, beside its configuration: nothing here
// is read from a configuration file. The zero value means every default;
// strategies that read the KV index need Index.
type Deps struct {
	// Rand returns a uniformly random number in [0, n); n > 0. It must be
	// safe for concurrent use and not allocate. nil means
	// math/rand/v2.Uint64N; tests pass SeededRand.
	Rand func(n uint64) uint64
	// Index is the scheduler's KV index, which kv_aware and the kv and
	// kv_usage scorers read; the scheduler sets it. Building them
	// without one is an error.
	Index *kvindex.Index
	// PartTimer, when set, is asked once per part of each profile built
	// (its filters as one part, "filters"; each scorer by its instance
	// name; the picker, "picker") for a function that hears the time the
	// part took in each Pick. The functions must be safe for concurrent
	// use and not allocate. The scheduler records them as
	// baton_routing_part_seconds.
	PartTimer func(profile, part string) func(time.Duration)
}

// withDefaults returns d with its nil Rand set to math/rand/v2's.
func (d Deps) withDefaults() Deps {
	if d.Rand == nil {
		d.Rand = rand.Uint64N
	}
	return d
}

// SeededRand returns a Deps.Rand drawing from a PCG source seeded with
// seed, guarded by a mutex since a rand.Rand is not safe for concurrent use.
// Use it in tests and benchmarks that must be reproducible.
func SeededRand(seed uint64) func(n uint64) uint64 {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return func(n uint64) uint64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Uint64N(n)
	}
}
