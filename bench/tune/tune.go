// Package tune searches fleet shapes and routing for goodput on the
// virtual clock (bench/vsim): prefill:decode splits of a number of GPUs
// (colocated included), strategies, concurrency thresholds and
// min_remote_prefill_tokens. Goodput is the requests per second that
// meet both latency targets, at the workload's own arrival rate.
package tune

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/batonllm/baton/bench"
	"github.com/batonllm/baton/bench/vsim"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler/routing"
)

// Options configure a search. Base carries everything a candidate does
// not vary: model, GPU, KV and CPU blocks, arrival rate, seed.
type Options struct {
	Base vsim.Config
	// GPUs is the fleet size searched in full.
	GPUs int
	// GPUCounts are the fleet sizes the goodput-against-GPUs curve
	// covers, with the best routing found at GPUs (default 1…GPUs).
	GPUCounts []int
	// SLOTTFT and SLOITL are the targets: a request meets them when its
	// time to first token and the 90th percentile of its inter-token
	// gaps are within them.
	SLOTTFT, SLOITL time.Duration
	// Strategies, Thresholds (concurrency_threshold of prefix_aware and
	// kv_aware) and MinRemote (min_remote_prefill_tokens of
	// disaggregated fleets) are the routing values searched. Defaults:
	// every built-in but round_robin; 8, 16, 32; 256, 512, 2048.
	Strategies []string
	Thresholds []int
	MinRemote  []int
	// Top is how many of the best shapes have their thresholds and
	// min_remote_prefill_tokens searched (default 3).
	Top int
	// Parallel runs that many simulations at once (default GOMAXPROCS).
	Parallel int
	// Progress, if not nil, gets a line per candidate.
	Progress io.Writer
}

func (o Options) withDefaults() Options {
	if len(o.Strategies) == 0 {
		o.Strategies = []string{routing.Random, routing.LeastOutstanding, routing.PrefixAware, routing.KVAware}
	}
	if len(o.Thresholds) == 0 {
		o.Thresholds = []int{8, 16, 32}
	}
	if len(o.MinRemote) == 0 {
		o.MinRemote = []int{256, 512, 2048}
	}
	if len(o.GPUCounts) == 0 {
		for g := 1; g <= o.GPUs; g++ {
			o.GPUCounts = append(o.GPUCounts, g)
		}
	}
	if o.Top == 0 {
		o.Top = 3
	}
	if o.Parallel == 0 {
		o.Parallel = runtime.GOMAXPROCS(0)
	}
	return o
}

// Validate reports the first invalid option, named as tune's flags are.
func (o Options) Validate() error {
	o = o.withDefaults()
	switch {
	case o.GPUs < 1:
		return fmt.Errorf("--gpus: must be at least 1, got %d", o.GPUs)
	case o.SLOTTFT <= 0:
		return fmt.Errorf("--slo-ttft-p90: must be positive, got %v", o.SLOTTFT)
	case o.SLOITL <= 0:
		return fmt.Errorf("--slo-itl-p90: must be positive, got %v", o.SLOITL)
	case o.Top < 1:
		return fmt.Errorf("--top: must be at least 1, got %d", o.Top)
	}
	for _, g := range o.GPUCounts {
		if g < 1 {
			return fmt.Errorf("--gpu-counts: must be at least 1, got %d", g)
		}
	}
	for _, t := range o.Thresholds {
		if t < routing.MinConcurrencyThreshold || t > routing.MaxConcurrencyThreshold {
			return fmt.Errorf("--thresholds: must be %d–%d, got %d", routing.MinConcurrencyThreshold, routing.MaxConcurrencyThreshold, t)
		}
	}
	for _, m := range o.MinRemote {
		if m < 1 || m > 1<<20 {
			return fmt.Errorf("--min-remote: must be 1–1048576, got %d", m)
		}
	}
	return nil
}

// Candidate is one configuration and how it did.
type Candidate struct {
	Config vsim.Config
	// Stage is the search stage that ran it: "shape" (every split with
	// each strategy's defaults), "routing" (thresholds and
	// min_remote_prefill_tokens of the best shapes) or "gpus" (the best
	// routing on other fleet sizes).
	Stage string
	// Goodput is the requests per modelled second that met both targets;
	// Attainment the fraction of requests that did.
	Goodput, Attainment float64
	// MeetsSLO: the fleet's TTFT p90 and ITL p90 are within the targets.
	MeetsSLO bool
	// The bench's statistics of the run, in modelled seconds.
	TTFTP50, TTFTP90, ITLP90, HitRate, Throughput float64
	Errors                                        int
	Events                                        int64
	Wall                                          time.Duration
}

// better orders candidates: more goodput, then meeting the targets, then
// fewer GPUs, then lower TTFT p90, then the label (a stable order).
func better(a, b *Candidate) int {
	if c := cmp.Compare(b.Goodput, a.Goodput); c != 0 {
		return c
	}
	if a.MeetsSLO != b.MeetsSLO {
		if a.MeetsSLO {
			return -1
		}
		return 1
	}
	if c := cmp.Compare(a.Config.GPUs(), b.Config.GPUs()); c != 0 {
		return c
	}
	if c := cmp.Compare(a.TTFTP90, b.TTFTP90); c != 0 {
		return c
	}
	return cmp.Compare(a.Config.Label(), b.Config.Label())
}

// Report is a search's outcome.
type Report struct {
	Workload, Describe string
	Requests           int
	Options            Options
	// OfferedRate is the workload's arrival rate, requests/s.
	OfferedRate float64
	// Candidates are every configuration run, best first.
	Candidates []Candidate
	// Best is Candidates[0].
	Best *Candidate
	// ByGPUs is the best candidate of each fleet size of GPUCounts with
	// Routing, the strategy, threshold and min_remote_prefill_tokens of
	// the best configuration on GPUs.
	ByGPUs  []Candidate
	Routing vsim.Config
	// Events is the simulated events of all runs, Elapsed the search's
	// wall time.
	Events  int64
	Elapsed time.Duration
	// Command is the command line, for the report.
	Command string
}

// Search runs the search on w.
func Search(ctx context.Context, o Options, w *workload.Workload) (*Report, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o = o.withDefaults()
	if len(w.Requests) == 0 {
		return nil, errors.New("workload: no requests")
	}
	start := time.Now()
	rep := &Report{Workload: w.Name, Describe: w.Describe, Requests: len(w.Requests), Options: o}
	if arr, err := bench.Arrivals(w, o.Base.Rate, o.Base.Seed); err == nil && len(arr) > 1 && arr[len(arr)-1] > 0 {
		rep.OfferedRate = float64(len(arr)-1) / arr[len(arr)-1]
		if o.Base.RateScale > 0 {
			rep.OfferedRate *= o.Base.RateScale
		}
	}
	r := &runner{o: o, w: w, done: map[string]*Candidate{}}

	// Stage 1: every shape of GPUs with each strategy's defaults.
	var shape []vsim.Config
	for _, f := range shapes(o.GPUs) {
		for _, s := range o.Strategies {
			c := f
			c.Strategy = s
			shape = append(shape, c)
		}
	}
	if err := r.runAll(ctx, "shape", shape); err != nil {
		return nil, err
	}
	// Stage 2: thresholds and min_remote_prefill_tokens of the best.
	var tuned []vsim.Config
	for _, c := range r.best(o.Top) {
		tuned = append(tuned, variants(c.Config, o)...)
	}
	if err := r.runAll(ctx, "routing", tuned); err != nil {
		return nil, err
	}
	best := r.best(1)[0]
	rep.Routing = best.Config
	// Stage 3: the best routing on every other fleet size.
	var sizes []vsim.Config
	for _, g := range o.GPUCounts {
		for _, f := range shapes(g) {
			c := best.Config
			c.Workers, c.Prefill, c.Decode = f.Workers, f.Prefill, f.Decode
			sizes = append(sizes, c)
		}
	}
	if err := r.runAll(ctx, "gpus", sizes); err != nil {
		return nil, err
	}
	for _, c := range r.all {
		rep.Candidates = append(rep.Candidates, *c)
		rep.Events += c.Events
	}
	slices.SortFunc(rep.Candidates, func(a, b Candidate) int { return better(&a, &b) })
	rep.Best = &rep.Candidates[0]
	for _, g := range o.GPUCounts {
		for i := range rep.Candidates {
			if c := &rep.Candidates[i]; c.Config.GPUs() == g && sameRouting(c.Config, best.Config) {
				rep.ByGPUs = append(rep.ByGPUs, *c)
				break
			}
		}
	}
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// shapes are the fleets of g GPUs: colocated, then every prefill:decode
// split.
func shapes(g int) []vsim.Config {
	out := []vsim.Config{{Workers: g}}
	for p := 1; p < g; p++ {
		out = append(out, vsim.Config{Prefill: p, Decode: g - p})
	}
	return out
}

// variants are c with each threshold (strategies that spill) and each
// min_remote_prefill_tokens (disaggregated fleets).
func variants(c vsim.Config, o Options) []vsim.Config {
	ts := []int{c.ConcurrencyThreshold}
	if c.Strategy == routing.PrefixAware || c.Strategy == routing.KVAware {
		ts = o.Thresholds
	}
	ms := []int{c.MinRemotePrefillTokens}
	if c.Disaggregated() {
		ms = o.MinRemote
	}
	var out []vsim.Config
	for _, t := range ts {
		for _, m := range ms {
			v := c
			v.ConcurrencyThreshold, v.MinRemotePrefillTokens = t, m
			out = append(out, v)
		}
	}
	return out
}

func sameRouting(a, b vsim.Config) bool {
	return a.Strategy == b.Strategy && a.ConcurrencyThreshold == b.ConcurrencyThreshold &&
		(a.MinRemotePrefillTokens == b.MinRemotePrefillTokens || !a.Disaggregated() || !b.Disaggregated())
}

// runner runs candidates, each configuration once.
type runner struct {
	o    Options
	w    *workload.Workload
	mu   sync.Mutex
	done map[string]*Candidate // by label
	all  []*Candidate
	n    int
}

// key identifies a configuration; defaults count as their values.
func key(c vsim.Config) string { return c.Label() }

func (r *runner) runAll(ctx context.Context, stage string, cs []vsim.Config) error {
	var todo []vsim.Config
	for _, c := range cs {
		c = r.withBase(c)
		if r.done[key(c)] == nil && !slices.ContainsFunc(todo, func(t vsim.Config) bool { return key(t) == key(c) }) {
			todo = append(todo, c)
		}
	}
	out := make([]*Candidate, len(todo))
	errs := make([]error, len(todo))
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(r.o.Parallel, len(todo)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				out[i], errs[i] = r.evaluate(ctx, stage, todo[i])
				r.progress(len(todo), out[i], errs[i])
			}
		}()
	}
	for i := range todo {
		next <- i
	}
	close(next)
	wg.Wait()
	for i, c := range out {
		if errs[i] != nil {
			return fmt.Errorf("%s: %w", key(todo[i]), errs[i])
		}
		r.done[key(c.Config)] = c
		r.all = append(r.all, c)
	}
	return ctx.Err()
}

func (r *runner) withBase(c vsim.Config) vsim.Config {
	b := r.o.Base
	b.Workers, b.Prefill, b.Decode = c.Workers, c.Prefill, c.Decode
	b.Strategy, b.ConcurrencyThreshold, b.MinRemotePrefillTokens = c.Strategy, c.ConcurrencyThreshold, c.MinRemotePrefillTokens
	if b.ConcurrencyThreshold == 0 {
		b.ConcurrencyThreshold = routing.DefaultConcurrencyThreshold
	}
	if b.MinRemotePrefillTokens == 0 {
		b.MinRemotePrefillTokens = 512
	}
	return b
}

func (r *runner) progress(total int, c *Candidate, err error) {
	if r.o.Progress == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
	if err != nil {
		fmt.Fprintf(r.o.Progress, "baton tune: error: %v\n", err)
		return
	}
	fmt.Fprintf(r.o.Progress, "baton tune: %s [%d] %-48s goodput %6.2f req/s, TTFT p90 %7.0f ms, ITL p90 %5.1f ms (%.1f s)\n",
		c.Stage, r.n, c.Config.Label(), c.Goodput, c.TTFTP90*1e3, c.ITLP90*1e3, c.Wall.Seconds())
}

// best returns the n best candidates so far.
func (r *runner) best(n int) []*Candidate {
	s := slices.Clone(r.all)
	slices.SortFunc(s, better)
	return s[:min(n, len(s))]
}

// evaluate runs one configuration.
func (r *runner) evaluate(ctx context.Context, stage string, c vsim.Config) (*Candidate, error) {
	t0 := time.Now()
	res, err := vsim.Run(ctx, c, r.w)
	if err != nil {
		return nil, err
	}
	return score(stage, c, res, r.o, time.Since(t0)), nil
}

// score measures a run against the targets.
func score(stage string, c vsim.Config, res *vsim.Result, o Options, wall time.Duration) *Candidate {
	st := bench.Summarize(c.Strategy, res.Requests, c.GPUs())
	ttft, itl := o.SLOTTFT.Seconds(), o.SLOITL.Seconds()
	met := 0
	for i := range res.Requests {
		x := &res.Requests[i]
		if x.Err == "" && x.TTFT <= ttft && (len(x.Gaps) == 0 || bench.Percentile(x.Gaps, 90) <= itl) {
			met++
		}
	}
	cand := &Candidate{Config: c, Stage: stage, Attainment: float64(met) / float64(len(res.Requests)),
		TTFTP50: st.TTFT.P50, TTFTP90: st.TTFT.P90, ITLP90: st.ITL.P90, HitRate: st.HitRate,
		Throughput: st.RequestsPerSec, Errors: st.Errors, Events: res.Events, Wall: wall}
	if res.Duration > 0 {
		cand.Goodput = float64(met) / res.Duration
	}
	cand.MeetsSLO = st.Errors == 0 && st.TTFT.P90 <= ttft && st.ITL.P90 <= itl
	return cand
}
