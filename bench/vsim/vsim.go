// Package vsim replays a workload through baton's routing on a virtual
// clock: the scheduler's strategies (routing profiles over a pool
// snapshot, the KV index, thresholds, prefill/decode coordination) in
// front of simulated engines that schedule as workers/sim does
// (continuous batching, chunked prefill, the prefix cache and its CPU
// tier, the cost model, KV transfer time), with no gRPC, no goroutine per
// request and no wall clock. Hours of traffic take seconds, and a run is
// deterministic under its seed. baton tune searches fleet shapes with it.
//
// What it leaves out: failures and retries (breakers, timeouts), the
// scheduler's queue (MaxInFlight), the shared Redis tier and warm-up, and,
// unless Config.Dispatch models them, the milliseconds of network, HTTP
// and gRPC between the scheduler's decision and the engine's queue.
package vsim

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/batonllm/baton/bench"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	eng "github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"
)

// Config is one fleet and routing configuration. The zero value of a
// field means bench's and the scheduler's defaults.
type Config struct {
	// Model and GPU are the simulated workers' presets; default
	// llama-3.1-8b on h100.
	Model, GPU string
	// Workers colocated workers (role both) when Prefill is 0, else
	// Prefill prefill and Decode decode workers.
	Workers, Prefill, Decode int
	// Strategy routes requests (in a disaggregated fleet: picks the
	// prefill worker); DecodeStrategy picks the decode worker (default
	// least_outstanding, the scheduler's).
	Strategy, DecodeStrategy string
	// ConcurrencyThreshold is routing.Params' (default 16).
	ConcurrencyThreshold int
	// MinRemotePrefillTokens is the scheduler's
	// disaggregation.min_remote_prefill_tokens (default 512).
	MinRemotePrefillTokens int
	// PrefixLength is the characters prefix_aware hashes (default 4,096).
	PrefixLength int
	// KVBlocks is each worker's GPU KV capacity in blocks (default: from
	// GPU memory); CPUBlocks its CPU tier as bench's --cpu-blocks (0:
	// none, -1: the simulator's default).
	KVBlocks, CPUBlocks int64
	// Rate is the Poisson arrival rate (requests/s) of an untimed
	// workload, or replaces a timed one's timestamps; RateScale, when
	// positive, multiplies the arrival rate (divides a trace's offsets).
	Rate, RateScale float64
	// Seed seeds the arrivals, the strategies' random choices and the
	// dispatch delays.
	Seed uint64
	// Dispatch models the time from the coordinator's commit of a
	// decision to the engine's queue (zero: none).
	Dispatch Dispatch
	// Registry holds the strategies; nil: routing's built-ins.
	Registry *routing.Registry
	// Replicas is the number of scheduler replicas (default 1), each with
	// its own KV index, pool and strategies, request i decided by replica
	// i mod Replicas; every engine's cache events and load reports reach
	// every replica's index, as each replica's watch of the engines does.
	Replicas int
	// ShareLag is how long what one replica learns takes to reach the
	// others' indexes: its committed decisions (scheduler.ReplicasConfig's
	// sharing, applied as kvindex.Index.Shared) and, with
	// ShareCorrections, each request's time to first token beside its
	// estimate (kvindex.Index.SharedTTFT), which the scheduler does not
	// share: replicas that correct their estimates alike rank workers
	// alike, and place the requests of a burst they decide before hearing
	// of each other's on the same workers (bench/RESULTS.md §13).
	// Negative: replicas share nothing.
	ShareLag         time.Duration
	ShareCorrections bool
	// ShareLate, between 0 and 1, is the part of what the replicas share
	// that takes ShareLag, each drawn at random; the rest reaches the
	// others at once. 0 means 1: all of it. In real time most decisions
	// reach the others before their next pick and a few do not
	// (baton_replica_sync_unseen_seconds counts those): ShareLate is that
	// part, ShareLag their lag.
	ShareLate float64

	// dispatchOf, set by tests, replaces Dispatch's draws: request i's
	// delay.
	dispatchOf func(i int) time.Duration
}

// Dispatch is the time from a request's arrival to its first call
// reaching an engine's queue (a colocated generate, a prefill, a decode
// that prefills locally): HTTP, the front end's parsing and hashing, gRPC,
// the engine's own parsing, and the scheduling of all that on the
// machine's CPUs. Requests that arrive together are taken up Spacing
// apart, in a random order; then PerToken for each prompt token delays the
// pick: a long prompt takes longer to read and hash. Then a draw from a
// log-normal distribution of the given median and 90th percentile, per
// request, delays the call. In real time these delays reorder
// simultaneous arrivals in the engines' queues, and leave routed requests
// out of the engines' load reports while they are on their way (see
// kvindex.Index.Predict), which cost-aware routing feels and random
// routing hardly does.
//
// The decode call that follows a remote prefill is not delayed: a gRPC
// call on a held connection for a request already parsed and routed, it
// took 0.42 ms at the median and 0.87 ms at p90 where first calls took
// 2–3 ms and 6–8 ms (bench/RESULTS-archive.md, 9c).
type Dispatch struct {
	Median, P90 time.Duration
	PerToken    time.Duration
	// Spacing is how far apart the front end takes up requests that
	// arrive together. Their order is random (seeded by Config.Seed): the
	// bench's client sends a burst's requests concurrently, and the front
	// end takes them up in no order of the trace's or of their sizes
	// (bench/RESULTS-archive.md, 9d).
	Spacing time.Duration
}

// Validate names the field at fault.
func (d Dispatch) Validate() error {
	switch {
	case d.Median < 0:
		return fmt.Errorf("dispatch: median %v is negative", d.Median)
	case d.P90 < d.Median:
		return fmt.Errorf("dispatch: p90 %v is below the median %v", d.P90, d.Median)
	case d.Median == 0 && d.P90 > 0:
		return fmt.Errorf("dispatch: p90 %v without a median", d.P90)
	case d.PerToken < 0:
		return fmt.Errorf("dispatch: per-token time %v is negative", d.PerToken)
	case d.Spacing < 0:
		return fmt.Errorf("dispatch: spacing %v is negative", d.Spacing)
	}
	return nil
}

// sampler returns a function drawing the delays in seconds from the pick
// to the engine's queue, from a generator seeded with seed; nil when there
// is no such delay.
func (d Dispatch) sampler(seed uint64) func() float64 {
	if d.Median == 0 {
		return nil
	}
	const z90 = 1.2815515655446004 // the standard normal's 90th percentile
	mu, sigma := d.Median.Seconds(), math.Log(float64(d.P90)/float64(d.Median))/z90
	rng := rand.New(rand.NewPCG(seed, 0xd15a7c4))
	return func() float64 { return mu * math.Exp(sigma*rng.NormFloat64()) }
}

func (c Config) withDefaults() Config {
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.Model == "" {
		c.Model = "llama-3.1-8b"
	}
	if c.GPU == "" {
		c.GPU = "h100"
	}
	if c.Strategy == "" {
		c.Strategy = routing.Default
	}
	if c.DecodeStrategy == "" {
		c.DecodeStrategy = routing.LeastOutstanding
	}
	if c.MinRemotePrefillTokens == 0 {
		c.MinRemotePrefillTokens = 512
	}
	if c.PrefixLength == 0 {
		c.PrefixLength = frontend.DefaultPrefixLength
	}
	if c.Workers == 0 && c.Prefill == 0 {
		c.Workers = 1
	}
	return c
}

// Disaggregated reports whether c has prefill workers.
func (c Config) Disaggregated() bool { return c.Prefill > 0 }

// GPUs is the fleet's size.
func (c Config) GPUs() int { return c.Workers + c.Prefill + c.Decode }

// Label names the fleet and routing, as tune's tables show it.
func (c Config) Label() string {
	c = c.withDefaults()
	s := fmt.Sprintf("colocated:%d %s", c.Workers, c.Strategy)
	if c.Disaggregated() {
		s = fmt.Sprintf("disagg:%d:%d %s", c.Prefill, c.Decode, c.Strategy)
	}
	if c.Strategy == routing.PrefixAware || c.Strategy == routing.KVAware {
		t := c.ConcurrencyThreshold
		if t == 0 {
			t = routing.DefaultConcurrencyThreshold
		}
		s += fmt.Sprintf(" threshold=%d", t)
	}
	if c.Disaggregated() {
		s += fmt.Sprintf(" min_remote=%d", c.MinRemotePrefillTokens)
	}
	return s
}

// Result is one run: each request's outcome, as baton bench measures it
// (in modelled seconds), and the simulation's own counters.
type Result struct {
	Requests []bench.Result
	// Events is the simulated events processed (arrivals, engine steps,
	// transfers); Steps the engine steps among them.
	Events, Steps int64
	// Duration is the modelled seconds from the first arrival to the last
	// completion.
	Duration float64
}

// Run replays w on the fleet of cfg and returns every request's outcome.
// It fails only on an invalid configuration or workload; ctx stops it
// between events.
func Run(ctx context.Context, cfg Config, w *workload.Workload) (*Result, error) {
	s, err := newSim(cfg)
	if err != nil {
		return nil, err
	}
	defer s.close()
	return s.run(ctx, w)
}

// epoch is the virtual clock's origin, for the KV index's timestamps.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// view is one scheduler replica: what it knows of the fleet and how it
// routes.
type view struct {
	strategy routing.Strategy // the prefill strategy when disaggregated
	decode   routing.Strategy // generating workers' strategy when disaggregated
	index    *kvindex.Index
	pool     *pool.Pool // generating workers: both or decode
	prefill  *pool.Pool // prefill workers (empty: colocated)
}

// apply gives ev of the engine name to every replica's index.
func (s *Sim) apply(name string, ev kvindex.Event) {
	for _, v := range s.views {
		v.index.Apply(name, ev)
	}
}

// share schedules apply of what replica from learned (a decision, a time
// to first token) on the other replicas' indexes, ShareLag later.
func (s *Sim) share(from int, apply func(*kvindex.Index)) {
	if s.cfg.ShareLag < 0 {
		return
	}
	lag := s.cfg.ShareLag.Seconds()
	if f := s.cfg.ShareLate; f > 0 && f < 1 && s.late.Float64() >= f {
		lag = 0
	}
	s.at(s.now+lag, func(float64) {
		for i, v := range s.views {
			if i != from {
				apply(v.index)
			}
		}
	})
}

// Sim is one run's state.
type Sim struct {
	cfg        Config
	now        float64
	events     eventHeap
	seq        uint64
	processed  int64
	views      []*view // the scheduler replicas
	usesKeys   bool
	engines    map[*pool.Worker]*engine // every replica's workers
	figures    cost.Figures
	kvPerBlock float64
	linkBW     float64
	defaultMax int
	prefixLen  int
	seed       uint64
	dispatch   func() float64 // nil: no dispatch delay
	late       *rand.Rand     // draws what is shared late (Config.ShareLate)
}

func newSim(cfg Config) (*Sim, error) {
	cfg = cfg.withDefaults()
	if cfg.Prefill > 0 && cfg.Decode == 0 || cfg.Prefill == 0 && cfg.Decode > 0 || cfg.Prefill > 0 && cfg.Workers > 0 {
		return nil, fmt.Errorf("fleet: %d colocated, %d prefill, %d decode workers: either colocated workers or both prefill and decode ones", cfg.Workers, cfg.Prefill, cfg.Decode)
	}
	if cfg.Replicas < 1 {
		return nil, fmt.Errorf("replicas: %d is not positive", cfg.Replicas)
	}
	if !(cfg.ShareLate >= 0 && cfg.ShareLate <= 1) {
		return nil, fmt.Errorf("share late: %v is not a part between 0 and 1", cfg.ShareLate)
	}
	if err := cfg.Dispatch.Validate(); err != nil {
		return nil, err
	}
	reg := cfg.Registry
	if reg == nil {
		reg = &routing.Registry{}
		routing.RegisterBuiltins(reg)
	}
	s := &Sim{cfg: cfg, engines: map[*pool.Worker]*engine{}, prefixLen: cfg.PrefixLength, seed: cfg.Seed,
		dispatch: cfg.Dispatch.sampler(cfg.Seed), late: rand.New(rand.NewPCG(cfg.Seed, 0x1a7e))}
	params := routing.Params{ConcurrencyThreshold: cfg.ConcurrencyThreshold}
	for r := range cfg.Replicas {
		v := &view{}
		icfg := kvindex.Config{Now: func() time.Time {
			return epoch.Add(time.Duration(s.now * float64(time.Second)))
		}}
		if cfg.Replicas > 1 {
			icfg.OnPredict = func(p kvindex.Prediction) {
				p.Keys = append([]uint64(nil), p.Keys...)
				s.share(r, func(x *kvindex.Index) { x.Shared(p) })
			}
			if cfg.ShareCorrections {
				icfg.OnObserve = func(o kvindex.Observation) { s.share(r, func(x *kvindex.Index) { x.SharedTTFT(o) }) }
			}
		}
		v.index = kvindex.New(icfg)
		// Replica 0 draws as a lone scheduler does.
		deps := routing.Deps{Rand: routing.SeededRand(cfg.Seed + uint64(r)), Index: v.index}
		var err error
		if v.strategy, err = reg.New(cfg.Strategy, params, deps); err != nil {
			return nil, err
		}
		if cfg.Disaggregated() {
			if v.decode, err = reg.New(cfg.DecodeStrategy, params, deps); err != nil {
				return nil, fmt.Errorf("decode %w", err)
			}
		}
		s.views = append(s.views, v)
	}
	v0 := s.views[0]
	s.usesKeys = routing.UsesKeys(v0.strategy) || v0.decode != nil && routing.UsesKeys(v0.decode)

	// One real engine, closed at once, gives the configuration with its
	// defaults and the cost figures a worker reports.
	simCfg := sim.Config{Cost: cost.Config{Model: cfg.Model, GPU: cfg.GPU},
		Tiers: sim.Tiers{GPUBlocks: cfg.KVBlocks, CPUBlocks: bench.SimCPUBlocks(cfg.CPUBlocks)}}
	probe, err := sim.New(simCfg)
	if err != nil {
		return nil, err
	}
	full := probe.Config()
	cm := probe.CostModel()
	gpuCap, cpuCap := probe.Cache().Capacity(), probe.Cache().CPUCapacity()
	s.figures, _ = cost.FromProto(probe.CostParams())
	probe.Close()
	s.kvPerBlock = float64(cm.KVBytesPerToken()) * sim.BlockTokens
	s.linkBW = full.Disagg.LinkBandwidth
	s.defaultMax = full.DefaultMaxTokens

	pcfg := pool.Config{HealthInterval: time.Hour, HealthTimeout: time.Minute}
	for _, v := range s.views {
		if v.pool, err = pool.New(pcfg); err != nil {
			s.close()
			return nil, err
		}
		if v.prefill, err = pool.New(pcfg); err != nil {
			v.pool.Close()
			s.close()
			return nil, err
		}
	}
	phases := rand.New(rand.NewPCG(cfg.Seed, 0x10ad))
	// mk starts n engines of role and returns each replica's workers for
	// them.
	mk := func(role string, n int) [][]*pool.Worker {
		ws := make([][]*pool.Worker, len(s.views))
		for i := range n {
			// Named as baton bench's fleets name them, so that prefix_aware's
			// ring places prefixes on the same workers.
			name := fmt.Sprintf("%s-%d", role, i)
			if role == sim.RoleBoth {
				name = fmt.Sprintf("sim-%d", i)
			}
			// Each engine's load ticker has its own phase, as engines
			// started at different moments do.
			e := newEngine(s, name, full, cm, gpuCap, cpuCap, phases.Float64()*full.LoadInterval.Seconds())
			if e.watched {
				e.reported = e.load()
				for _, v := range s.views {
					v.index.SetInfo(name, kvindex.Info{BlockTokens: sim.BlockTokens, Cost: s.figures, HasCost: true})
				}
				s.apply(name, kvindex.Event{Seq: 1, Snapshot: &kvindex.Snapshot{Load: e.reported}})
				e.evSeq = 1
			}
			for r := range s.views {
				pw := &pool.Worker{Name: name, Addr: name, Client: client{}}
				s.engines[pw] = e
				ws[r] = append(ws[r], pw)
			}
		}
		return ws
	}
	gen := mk(sim.RoleBoth, cfg.Workers)
	if cfg.Disaggregated() {
		gen = mk(sim.RoleDecode, cfg.Decode)
		for r, ws := range mk(sim.RolePrefill, cfg.Prefill) {
			if err := s.views[r].prefill.Set(ws); err != nil {
				s.close()
				return nil, err
			}
		}
	}
	for r, ws := range gen {
		if err := s.views[r].pool.Set(ws); err != nil {
			s.close()
			return nil, err
		}
	}
	return s, nil
}

func (s *Sim) close() {
	for _, v := range s.views {
		if v.pool != nil {
			v.pool.Close()
		}
		if v.prefill != nil {
			v.prefill.Close()
		}
	}
}

// client stands in for an engine client: the pool only health-checks it.
type client struct{}

func (client) Generate(context.Context, *eng.Request) (eng.Stream, error) {
	return nil, errors.New("vsim: no engine behind this client")
}
func (client) Check(context.Context) error { return nil }
func (client) Close() error                { return nil }

// at schedules fn at virtual time t (never before now).
func (s *Sim) at(t float64, fn func(now float64)) {
	s.seq++
	heap.Push(&s.events, event{t: max(t, s.now), seq: s.seq, fn: fn})
}

func (s *Sim) run(ctx context.Context, w *workload.Workload) (*Result, error) {
	rate := s.cfg.Rate
	arr, err := bench.Arrivals(w, rate, s.cfg.Seed)
	if err != nil {
		return nil, err
	}
	scale := 1.0
	if s.cfg.RateScale > 0 {
		scale = 1 / s.cfg.RateScale
	}
	res := &Result{Requests: make([]bench.Result, len(w.Requests))}
	seed := blockkey.Seed(s.cfg.Model, "")
	// Arrivals are fed one ahead, so the heap holds the engines' events
	// and the next arrival only.
	var next func(i int)
	rank := burstRanks(arr, s.cfg.Seed, len(s.views))
	next = func(i int) {
		if i >= len(w.Requests) {
			return
		}
		s.at(arr[i]*scale, func(now float64) {
			wr := &w.Requests[i]
			d := s.cfg.Dispatch
			pick := now + float64(rank[i])*d.Spacing.Seconds()
			if d.PerToken > 0 {
				pick += d.PerToken.Seconds() * float64(blockkey.Tokens(blockkey.Chars(wr.RoutingText())))
			}
			if pick > now {
				s.at(pick, func(float64) { s.arrive(i, wr, seed, &res.Requests[i], now) })
			} else {
				s.arrive(i, wr, seed, &res.Requests[i], now)
			}
			next(i + 1)
		})
	}
	next(0)
	for len(s.events) > 0 {
		if s.processed&1023 == 0 && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		ev := heap.Pop(&s.events).(event)
		s.now = ev.t
		s.processed++
		ev.fn(ev.t)
	}
	res.Events = s.processed
	first, last := 0.0, 0.0
	for i := range res.Requests {
		r := &res.Requests[i]
		if i == 0 || r.Done-r.E2E < first {
			first = r.Done - r.E2E
		}
		last = max(last, r.Done)
	}
	res.Duration = last - first
	for _, e := range s.engines {
		res.Steps += e.steps
	}
	return res, nil
}

// burstRanks returns each request's place among the requests that arrive
// at the same instant as it and go to the same one of replicas (request i
// to replica i mod replicas), in a random order drawn from seed: 0 for
// the first its replica's front end takes up, and for a request that
// arrives alone. Replicas take up their shares of a burst side by side,
// each one request after another.
func burstRanks(arr []float64, seed uint64, replicas int) []int {
	rank := make([]int, len(arr))
	rng := rand.New(rand.NewPCG(seed, 0xb0257))
	var next []int
	for i := 0; i < len(arr); {
		j := i + 1
		for j < len(arr) && arr[j] == arr[i] {
			j++
		}
		if j-i > 1 {
			// One order for the whole burst, as one replica takes it up;
			// each replica keeps its requests' order within it.
			perm := rng.Perm(j - i)
			order := make([]int, j-i)
			for k, r := range perm {
				order[r] = i + k
			}
			next = append(next[:0], make([]int, replicas)...)
			for _, q := range order {
				rank[q] = next[q%replicas]
				next[q%replicas]++
			}
		}
		i = j
	}
	return rank
}

type event struct {
	t   float64
	seq uint64
	fn  func(now float64)
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].t != h[j].t {
		return h[i].t < h[j].t
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	n := len(old)
	x := old[n-1]
	*h = old[:n-1]
	return x
}
