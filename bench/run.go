// Package bench is baton bench: it replays one workload against every
// selected routing strategy, each on a fresh simulated fleet with cold
// caches (or against a running baton), and reports latency, throughput,
// KV hit rate and balance side by side.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/sim"
)

// Options configure a bench run.
type Options struct {
	Strategies []string
	// Target is a running baton's base URL; empty starts an in-process
	// fleet per strategy.
	Target string
	// Workers is the in-process fleet size.
	Workers int
	// Model is the model preset of the simulated workers and the model
	// requested.
	Model string
	GPU   string
	// KVBlocks overrides each simulated worker's KV capacity (0: from the
	// cost model).
	KVBlocks int64
	// CPUBlocks is each worker's CPU KV tier in blocks: 0 for none (the
	// SageMaker study's fleet had only GPU caches), -1 for the simulator's
	// default (host memory).
	CPUBlocks int64
	// ConcurrencyThreshold and PrefixLength tune prefix_aware (0: default).
	ConcurrencyThreshold int
	PrefixLength         int
	// Speedup compresses time: arrivals come Speedup times faster and the
	// simulated engines run their clock Speedup times faster. Reported
	// latencies and rates are in modelled (uncompressed) time.
	Speedup float64
	// Rate is the Poisson arrival rate in modelled requests/s; 0 with a
	// timed workload replays its timestamps.
	Rate float64
	// Concurrency caps requests in flight (0: open loop, no cap).
	Concurrency int
	Seed        uint64
	// Progress receives a progress line per second; nil: none.
	Progress io.Writer
}

// Arrivals returns the modelled arrival offsets, in seconds, of n requests:
// the workload's timestamps when it is timed and rate is 0, else Poisson at
// rate from seed.
func Arrivals(w *workload.Workload, rate float64, seed uint64) ([]float64, error) {
	at := make([]float64, len(w.Requests))
	if w.Timed && rate == 0 {
		for i := range w.Requests {
			at[i] = w.Requests[i].At.Seconds()
		}
		return at, nil
	}
	if !(rate > 0) {
		return nil, errors.New("rate: a positive arrival rate is required for an untimed workload")
	}
	rng := rand.New(rand.NewPCG(seed, 0xa77))
	t := 0.0
	for i := range at {
		at[i] = t
		t += rng.ExpFloat64() / rate
	}
	return at, nil
}

// fleet is an in-process scheduler and its simulated workers.
type fleet struct {
	url     string
	sched   *scheduler.Scheduler
	workers []*sim.Worker
}

func startFleet(o *Options, strategy string) (*fleet, error) {
	f := &fleet{}
	cfg := scheduler.Config{Listen: "127.0.0.1:0", Strategy: strategy, LogLevel: "error"}
	cfg.ConcurrencyThreshold = o.ConcurrencyThreshold
	cfg.PrefixLength = o.PrefixLength
	for i := range o.Workers {
		name := fmt.Sprintf("sim-%d", i)
		w, err := sim.Start(sim.Config{Name: name, Model: o.Model, GPU: o.GPU, TimeScale: o.Speedup,
			BlockCapacity: o.KVBlocks, CPUBlocks: cpuBlocks(o.CPUBlocks)}, "127.0.0.1:0", "", nil)
		if err != nil {
			f.close()
			return nil, err
		}
		f.workers = append(f.workers, w)
		cfg.Workers = append(cfg.Workers, scheduler.WorkerConfig{Name: name, Address: w.GRPCAddr})
	}
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	s, err := scheduler.New(cfg, reg, slog.New(slog.DiscardHandler))
	if err != nil {
		f.close()
		return nil, err
	}
	f.sched = s
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.close()
		return nil, err
	}
	go s.Serve(l)
	f.url = "http://" + l.Addr().String()
	for range 100 {
		resp, err := http.Get(f.url + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return f, nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.close()
	return nil, errors.New("in-process scheduler never became ready")
}

func (f *fleet) close() {
	if f.sched != nil {
		f.sched.Close()
	}
	for _, w := range f.workers {
		w.Close()
	}
}

// gather returns the metric families of the scheduler: in process from its
// registry, else scraped from target's /metrics.
func gather(f *fleet, target string) ([]*dto.MetricFamily, error) {
	if f != nil {
		return f.sched.Metrics.Registry.Gather()
	}
	resp, err := http.Get(strings.TrimSuffix(target, "/") + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: HTTP %d", resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	m, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	out := make([]*dto.MetricFamily, 0, len(m))
	for _, mf := range m {
		out = append(out, mf)
	}
	return out, nil
}

// decisionHistogram sums baton_routing_decision_seconds over its label
// sets: bucket bounds and cumulative counts.
func decisionHistogram(mfs []*dto.MetricFamily) (bounds, cum []float64) {
	for _, mf := range mfs {
		if mf.GetName() != "baton_routing_decision_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			h := m.GetHistogram()
			if h == nil {
				continue
			}
			bs := h.GetBucket()
			if bounds == nil {
				bounds = make([]float64, len(bs)+1)
				cum = make([]float64, len(bs)+1)
				for i, b := range bs {
					bounds[i] = b.GetUpperBound()
				}
				bounds[len(bs)] = math.Inf(1)
			}
			if len(bs)+1 != len(bounds) {
				continue
			}
			for i, b := range bs {
				cum[i] += float64(b.GetCumulativeCount())
			}
			cum[len(bs)] += float64(h.GetSampleCount())
		}
	}
	return bounds, cum
}

// cpuWatch samples the in-process engines to compare the wall time they
// were busy with the modelled time of the steps they ran: on an overloaded
// CPU, steps overrun their modelled time and the ratio climbs above 1.
type cpuWatch struct {
	busy     []time.Duration
	modelled []float64
	stop     chan struct{}
	done     chan struct{}
}

func watchCPU(ws []*sim.Worker) *cpuWatch {
	c := &cpuWatch{busy: make([]time.Duration, len(ws)), modelled: make([]float64, len(ws)),
		stop: make(chan struct{}), done: make(chan struct{})}
	for i, w := range ws {
		c.modelled[i] = w.Engine.Stats().ModelledSeconds
	}
	go func() {
		defer close(c.done)
		const tick = 5 * time.Millisecond
		t := time.NewTicker(tick)
		defer t.Stop()
		prev := time.Now()
		for {
			select {
			case <-c.stop:
				return
			case now := <-t.C:
				d := now.Sub(prev)
				prev = now
				for i, w := range ws {
					if l := w.Engine.Load(); l.Running+l.Waiting > 0 {
						c.busy[i] += d
					}
				}
			}
		}
	}()
	return c
}

// finish returns the ratio of busy wall time to modelled step time (in
// wall units), over the whole fleet.
func (c *cpuWatch) finish(ws []*sim.Worker, timeScale float64) float64 {
	close(c.stop)
	<-c.done
	var busy time.Duration
	var modelled float64
	for i, w := range ws {
		busy += c.busy[i]
		modelled += w.Engine.Stats().ModelledSeconds - c.modelled[i]
	}
	if modelled <= 0 {
		return math.NaN()
	}
	return busy.Seconds() / (modelled / timeScale)
}

// runOne replays the workload against one strategy.
func runOne(ctx context.Context, o *Options, w *workload.Workload, arrivals []float64, strategy string) (*StrategyReport, error) {
	var f *fleet
	base := strings.TrimSuffix(o.Target, "/")
	if o.Target == "" {
		var err error
		if f, err = startFleet(o, strategy); err != nil {
			return nil, fmt.Errorf("%s: start fleet: %w", strategy, err)
		}
		defer f.close()
		base = f.url
	}
	before, _ := gather(f, base)
	var cpu *cpuWatch
	if f != nil {
		cpu = watchCPU(f.workers)
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096,
		IdleConnTimeout: 30 * time.Second, DisableCompression: true}}
	defer hc.CloseIdleConnections()

	n := len(w.Requests)
	results := make([]Result, n)
	var sem chan struct{}
	if o.Concurrency > 0 {
		sem = make(chan struct{}, o.Concurrency)
	}
	var sent, done, failed, inflight atomic.Int64
	var maxLag atomic.Int64 // ns
	start := time.Now()
	stopProgress := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		if o.Progress == nil {
			return
		}
		t := time.NewTicker(time.Second)
		defer t.Stop()
		line := func(end string) {
			el := time.Since(start).Seconds()
			fmt.Fprintf(o.Progress, "\r[%s] %4.0fs  sent %d/%d  done %d  errors %d  in flight %d  max lag %.0f ms%s",
				strategy, el, sent.Load(), n, done.Load(), failed.Load(), inflight.Load(),
				float64(maxLag.Load())/1e6, end)
		}
		for {
			select {
			case <-t.C:
				line("   ")
			case <-stopProgress:
				line("\n")
				return
			}
		}
	}()

	var wg sync.WaitGroup
	for i := range w.Requests {
		due := start.Add(time.Duration(arrivals[i] / o.Speedup * float64(time.Second)))
		if d := time.Until(due); d > 0 {
			select {
			case <-time.After(d):
			case <-ctx.Done():
			}
		}
		if ctx.Err() != nil {
			break
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
		}
		lag := time.Since(due)
		if int64(lag) > maxLag.Load() {
			maxLag.Store(int64(lag))
		}
		sent.Add(1)
		inflight.Add(1)
		wg.Add(1)
		go func(i int, lag time.Duration) {
			defer wg.Done()
			r := &results[i]
			r.Index = i
			r.Lag = max(lag.Seconds(), 0)
			send(ctx, hc, base, o.Model, &w.Requests[i], r)
			r.Done = time.Since(start).Seconds()
			inflight.Add(-1)
			done.Add(1)
			if r.Err != "" {
				failed.Add(1)
			}
			if sem != nil {
				<-sem
			}
		}(i, lag)
	}
	wg.Wait()
	close(stopProgress)
	<-progressDone
	wall := time.Since(start).Seconds()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	stretch := math.NaN()
	if cpu != nil {
		stretch = cpu.finish(f.workers, o.Speedup)
	}
	rep := summarize(strategy, results[:sent.Load()], o, wall)
	rep.CPUStretch = stretch
	after, err := gather(f, base)
	if err == nil {
		b1, c1 := decisionHistogram(after)
		_, c0 := decisionHistogram(before)
		if len(c0) == len(c1) {
			for i := range c1 {
				c1[i] -= c0[i]
			}
		}
		rep.DecisionP50us = bucketQuantile(0.5, b1, c1) * 1e6
		rep.DecisionP99us = bucketQuantile(0.99, b1, c1) * 1e6
	}
	rep.checkHealth(o)
	return rep, nil
}

// Run replays w against every strategy of o, one after another, each on a
// fresh fleet with cold caches (in process) or the target.
func Run(ctx context.Context, o Options, w *workload.Workload) (*Report, error) {
	if o.Speedup <= 0 {
		o.Speedup = 1
	}
	if o.Model == "" {
		o.Model = "llama-3.1-8b"
	}
	if o.GPU == "" {
		o.GPU = "h100"
	}
	arrivals, err := Arrivals(w, o.Rate, o.Seed)
	if err != nil {
		return nil, err
	}
	rep := &Report{Workload: w.Name, Describe: w.Describe, Requests: len(w.Requests), Workers: o.Workers,
		Speedup: o.Speedup, Rate: o.Rate, Concurrency: o.Concurrency, Seed: o.Seed, Target: o.Target,
		Model: o.Model, GPU: o.GPU}
	if len(arrivals) > 1 {
		rep.OfferedRate = float64(len(arrivals)-1) / arrivals[len(arrivals)-1]
	}
	for _, s := range o.Strategies {
		sr, err := runOne(ctx, &o, w, arrivals, s)
		if err != nil {
			return nil, err
		}
		rep.Strategies = append(rep.Strategies, *sr)
	}
	return rep, nil
}

// cpuBlocks maps Options.CPUBlocks to sim.Config.CPUBlocks, whose zero means
// the default tier and -1 none.
func cpuBlocks(n int64) int64 {
	switch {
	case n == 0:
		return -1
	case n < 0:
		return 0
	}
	return n
}
