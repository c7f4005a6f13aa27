// Package bench is baton bench: it replays one workload against every
// selected routing strategy, each on a fresh simulated fleet with cold
// caches (or against a running baton), and reports latency, throughput,
// KV hit rate and balance side by side.
package bench

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"
)

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

// Fleet is the shape of an in-process fleet: Workers colocated workers
// (role both) when Prefill is 0, else Prefill prefill and Decode decode
// workers serving disaggregated.
type Fleet struct {
	Workers int
	Prefill int
	Decode  int
	// Name overrides Label (ParseFleets names colocated:N fleets).
	Name string
}

// Disaggregated reports whether f has prefill workers.
func (f Fleet) Disaggregated() bool { return f.Prefill > 0 }

// Label is the suffix of f's columns: empty for a colocated fleet,
// "disagg:P:D" for a disaggregated one.
func (f Fleet) Label() string {
	if f.Name != "" {
		return f.Name
	}
	if !f.Disaggregated() {
		return ""
	}
	return fmt.Sprintf("disagg:%d:%d", f.Prefill, f.Decode)
}

// String describes f.
func (f Fleet) String() string {
	if !f.Disaggregated() {
		return fmt.Sprintf("%d colocated", f.Workers)
	}
	return fmt.Sprintf("%d prefill + %d decode", f.Prefill, f.Decode)
}

// generators is the number of workers that stream tokens (the
// X-Baton-Worker of a response): the decode workers of a disaggregated
// fleet, else all.
func (f Fleet) generators() int {
	if f.Disaggregated() {
		return f.Decode
	}
	return f.Workers
}

// ParseFleets parses a comma-separated list of fleets: "colocated"
// (workers colocated workers, columns labelled by the strategy alone),
// "colocated:N" (N colocated workers, columns strategy/colocated:N) and
// "disagg:P:D" (P prefill and D decode workers, columns
// strategy/disagg:P:D).
func ParseFleets(spec string, workers int) ([]Fleet, error) {
	var out []Fleet
	for _, f := range strings.Split(spec, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		parts := strings.Split(f, ":")
		num := func(s string) (int, error) {
			var n int
			if _, err := fmt.Sscanf(s, "%d", &n); err != nil || fmt.Sprint(n) != s || n < 1 || n > MaxVirtualWorkers {
				return 0, fmt.Errorf("fleet %q: %q is not a worker count 1–%d", f, s, MaxVirtualWorkers)
			}
			return n, nil
		}
		switch {
		case parts[0] == "colocated" && len(parts) == 1:
			out = append(out, Fleet{Workers: workers})
		case parts[0] == "colocated" && len(parts) == 2:
			n, err := num(parts[1])
			if err != nil {
				return nil, err
			}
			out = append(out, Fleet{Workers: n, Name: f})
		case parts[0] == "disagg" && len(parts) == 3:
			p, err := num(parts[1])
			if err != nil {
				return nil, err
			}
			d, err := num(parts[2])
			if err != nil {
				return nil, err
			}
			out = append(out, Fleet{Workers: p + d, Prefill: p, Decode: d})
		default:
			return nil, fmt.Errorf("fleet %q: want colocated, colocated:N or disagg:P:D", f)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no fleet given")
	}
	seen := map[string]bool{}
	for _, f := range out {
		if seen[f.Label()] {
			return nil, fmt.Errorf("fleet %s given twice (columns would share a label)", f)
		}
		seen[f.Label()] = true
	}
	return out, nil
}

// inProcess is an in-process fleet and the shared tier its workers use.
type inProcess struct {
	*fleet.Fleet
	store *kvstore.Memory
}

// LoRA adapters of in-process fleets.
const (
	// DefaultMaxLoRAs is a worker's adapter slots by default.
	DefaultMaxLoRAs = 4
	// AdapterBytes is each adapter's size: a rank-16 adapter of every
	// projection of Llama-3.1-8B in 16 bits is about 80 MiB.
	AdapterBytes = 80 << 20
)

func startFleet(o *Options, strategy string, shape Fleet, replicas int, adapters []string) (*inProcess, error) {
	f := &inProcess{}
	if o.SharedTier {
		f.store = kvstore.NewMemory(kvstore.MemoryConfig{Capacity: o.SharedTierBytes})
	}
	cfg := scheduler.Config{Strategy: strategy, LogLevel: "error"}
	cfg.ConcurrencyThreshold = o.ConcurrencyThreshold
	cfg.PrefixLength = o.PrefixLength
	// Every fleet draws the same random choices: random's (and the
	// tie-breaks of the others) repeat from run to run.
	cfg.Rand = routing.SeededRand(o.Seed)
	var lora sim.LoRA
	if len(adapters) > 0 {
		lora.MaxLoRAs = o.MaxLoRAs
		if lora.MaxLoRAs == 0 {
			lora.MaxLoRAs = DefaultMaxLoRAs
		}
		for _, a := range adapters {
			cfg.Adapters = append(cfg.Adapters, scheduler.AdapterConfig{Name: a, BaseModel: o.Model, Size: AdapterBytes})
			lora.Adapters = append(lora.Adapters, engine.Adapter{Name: a, Base: o.Model, Bytes: AdapterBytes})
		}
	}
	spec := fleet.Spec{
		Scheduler: cfg,
		Log:       slog.New(slog.DiscardHandler),
		Config: func(string, string) sim.Config {
			sc := sim.Config{TimeScale: o.Speedup, Cost: cost.Config{Model: o.Model, GPU: o.GPU},
				Tiers: sim.Tiers{GPUBlocks: o.KVBlocks, CPUBlocks: SimCPUBlocks(o.CPUBlocks)}, LoRA: lora}
			if f.store != nil {
				sc.Tiers.Store = f.store
			}
			return sc
		},
	}
	spec.MaxLoRAs = lora.MaxLoRAs
	spec.Replicas = replicas
	if (o.ShareRedis != "" || o.SharePeers) && replicas > 1 {
		// A stream of this fleet's own: no replica replays another run's.
		spec.Scheduler.Replicas = scheduler.ReplicasConfig{
			Stream: fmt.Sprintf("baton:bench:%d:%d:%s:%d", os.Getpid(), time.Now().UnixNano(), strategy, replicas),
		}
		if o.ShareRedis != "" {
			spec.Scheduler.Replicas.Redis = kvstore.RedisConfig{Addr: o.ShareRedis}
			spec.Scheduler.Replicas.Replay = -1
		}
	}
	if o.SharePeers && replicas > 1 {
		addrs, err := freeLoopbackPorts(replicas)
		if err != nil {
			f.close()
			return nil, err
		}
		spec.ReplicaConfig = func(i int, c *scheduler.Config) {
			c.Replicas.Peers = scheduler.ReplicaPeersConfig{Listen: addrs[i], Addresses: addrs}
		}
	}
	if shape.Disaggregated() {
		spec.Prefill, spec.Decode = shape.Prefill, shape.Decode
	} else {
		// Colocated workers are sim-0, sim-1, ...; disaggregated ones
		// prefill-0, decode-0, ...
		spec.Workers = shape.Workers
		spec.Name = func(_ string, i int) string { return fmt.Sprintf("sim-%d", i) }
	}
	var err error
	if f.Fleet, err = fleet.Start(spec); err != nil {
		f.close()
		return nil, err
	}
	return f, nil
}

func (f *inProcess) close() {
	if f.Fleet != nil {
		f.Fleet.Close()
	}
	if f.store != nil {
		f.store.Close()
	}
}

// gather returns the metric families of the scheduler: in process from
// its registry (every replica's, whose samples the readers sum), else
// scraped from target's /metrics.
func gather(f *inProcess, target string) ([]*dto.MetricFamily, error) {
	if f != nil {
		var out []*dto.MetricFamily
		for _, r := range f.Replicas {
			mfs, err := r.Scheduler.Metrics.Registry.Gather()
			if err != nil {
				return nil, err
			}
			out = append(out, mfs...)
		}
		return out, nil
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

// gatherAll is gather of every target of bases (the replicas of one
// baton), whose samples the readers sum; in process, of f's replicas.
func gatherAll(f *inProcess, bases []string) ([]*dto.MetricFamily, error) {
	if f != nil {
		return gather(f, "")
	}
	var out []*dto.MetricFamily
	for _, b := range bases {
		mfs, err := gather(nil, b)
		if err != nil {
			return nil, err
		}
		out = append(out, mfs...)
	}
	return out, nil
}

// decisionHistogram sums baton_routing_decision_seconds over its label
// sets: bucket bounds and cumulative counts.
func decisionHistogram(mfs []*dto.MetricFamily) (bounds, cum []float64) {
	h := histograms(mfs, "baton_routing_decision_seconds", "")[""]
	return h.bounds, h.cum
}

// histogramQuantiles returns the p50 and p99 of the histogram family name,
// summed over its label sets, between the before and after scrapes, in
// microseconds; 0 when it has no observation.
func histogramQuantiles(before, after []*dto.MetricFamily, name string) (p50, p99 float64) {
	h0, h1 := histograms(before, name, "")[""], histograms(after, name, "")[""]
	if len(h0.cum) == len(h1.cum) {
		for i := range h1.cum {
			h1.cum[i] -= h0.cum[i]
		}
	}
	if len(h1.cum) == 0 || h1.cum[len(h1.cum)-1] == 0 {
		return 0, 0
	}
	return bucketQuantile(0.5, h1.bounds, h1.cum) * 1e6, bucketQuantile(0.99, h1.bounds, h1.cum) * 1e6
}

// histogramCount returns the observations of the histogram family name
// (summed over its label sets) from before to after.
func histogramCount(before, after []*dto.MetricFamily, name string) float64 {
	h0, h1 := histograms(before, name, "")[""], histograms(after, name, "")[""]
	if len(h1.cum) == 0 {
		return 0
	}
	n := h1.cum[len(h1.cum)-1]
	if len(h0.cum) > 0 {
		n -= h0.cum[len(h0.cum)-1]
	}
	return n
}

// histogram is a histogram's bucket bounds and cumulative counts.
type histogram struct{ bounds, cum []float64 }

// histograms sums the histogram family name over its label sets, one sum
// per value of label ("" sums them all): bucket bounds and cumulative
// counts.
func histograms(mfs []*dto.MetricFamily, name, label string) map[string]histogram {
	out := map[string]histogram{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			h := m.GetHistogram()
			if h == nil {
				continue
			}
			key := ""
			for _, lp := range m.GetLabel() {
				if label != "" && lp.GetName() == label {
					key = lp.GetValue()
				}
			}
			sum := out[key]
			bs := h.GetBucket()
			if sum.bounds == nil {
				sum.bounds = make([]float64, len(bs)+1)
				sum.cum = make([]float64, len(bs)+1)
				for i, b := range bs {
					sum.bounds[i] = b.GetUpperBound()
				}
				sum.bounds[len(bs)] = math.Inf(1)
			}
			if len(bs)+1 != len(sum.bounds) {
				continue
			}
			for i, b := range bs {
				sum.cum[i] += float64(b.GetCumulativeCount())
			}
			sum.cum[len(bs)] += float64(h.GetSampleCount())
			out[key] = sum
		}
	}
	return out
}

// partQuantiles returns the p50 and p99 of each routing part
// (baton_routing_part_seconds) between the before and after scrapes, in
// microseconds.
func partQuantiles(before, after []*dto.MetricFamily) map[string][2]float64 {
	const name = "baton_routing_part_seconds"
	h0, h1 := histograms(before, name, "part"), histograms(after, name, "part")
	var out map[string][2]float64
	for part, h := range h1 {
		if c0 := h0[part].cum; len(c0) == len(h.cum) {
			for i := range h.cum {
				h.cum[i] -= c0[i]
			}
		}
		if len(h.cum) == 0 || h.cum[len(h.cum)-1] == 0 {
			continue
		}
		if out == nil {
			out = map[string][2]float64{}
		}
		out[part] = [2]float64{bucketQuantile(0.5, h.bounds, h.cum) * 1e6, bucketQuantile(0.99, h.bounds, h.cum) * 1e6}
	}
	return out
}

// explained are the scheduler's counters a report lists per column, when
// they moved: how disaggregated requests were prefilled, fallbacks and
// failures, breaker trips, queue rejections, and cached tokens by tier.
var explained = []string{"baton_disagg_decisions_total", "baton_fallbacks_total", "baton_transfer_failures_total",
	"baton_breaker_transitions_total", "baton_queue_rejections_total", "baton_retries_total", "baton_cached_tokens_by_tier_total",
	"baton_routing_decisions_total", "baton_prefix_copies_total",
	"baton_adapter_loads_total", "baton_adapter_evictions_total", "baton_adapter_requests_total",
	"baton_replica_sync_messages_total", "baton_replica_sync_entries_total", "baton_replica_sync_dropped_entries_total",
	"baton_replica_sync_missed_messages_total", "baton_replica_sync_lost_entries_total", "baton_replica_sync_duplicate_entries_total"}

// counters returns the explained counters of mfs by name{label=value,...}.
func counters(mfs []*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, mf := range mfs {
		if !slices.Contains(explained, mf.GetName()) {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetCounter() == nil {
				continue
			}
			var ls []string
			for _, l := range m.GetLabel() {
				if strings.HasPrefix(mf.GetName(), "baton_adapter_") && (l.GetName() == "adapter" || l.GetName() == "worker") {
					continue // summed over the fleet's many adapters
				}
				if l.GetValue() != "" {
					ls = append(ls, l.GetName()+"="+l.GetValue())
				}
			}
			out[strings.TrimPrefix(mf.GetName(), "baton_")+"{"+strings.Join(ls, ",")+"}"] += m.GetCounter().GetValue()
		}
	}
	return out
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
		return 0 // unknown (JSON has no NaN)
	}
	return busy.Seconds() / (modelled / timeScale)
}

// Column is the label of strategy's column on shape: the strategy, with
// "/" and the fleet's label for a disaggregated fleet.
func Column(strategy string, shape Fleet) string {
	if l := shape.Label(); l != "" {
		return strategy + "/" + l
	}
	return strategy
}

// ReplicasColumn is Column with "/replicas:N" appended when the run
// compares numbers of replicas (o.Replicas other than one alone).
func ReplicasColumn(o *Options, strategy string, shape Fleet, replicas int) string {
	l := Column(strategy, shape)
	if len(o.Replicas) > 1 || len(o.Replicas) == 1 && o.Replicas[0] != 1 {
		l += fmt.Sprintf("/replicas:%d", replicas)
		if o.ReplicasFirst && replicas > 1 {
			l += ":first"
		}
	}
	return l
}

// runOne replays the workload against one strategy on one fleet with
// replicas schedulers, request i sent to replica i mod replicas.
func runOne(ctx context.Context, o *Options, w *workload.Workload, arrivals []float64, strategy string, shape Fleet, replicas int) (*StrategyReport, error) {
	var f *inProcess
	var bases []string
	for _, t := range strings.Split(o.Target, ",") {
		bases = append(bases, strings.TrimSuffix(strings.TrimSpace(t), "/"))
	}
	label := ReplicasColumn(o, strategy, shape, replicas)
	if o.Target == "" {
		var err error
		if f, err = startFleet(o, strategy, shape, replicas, w.Adapters); err != nil {
			return nil, fmt.Errorf("%s: start fleet: %w", label, err)
		}
		defer f.close()
		bases = bases[:0]
		for _, r := range f.Replicas {
			bases = append(bases, r.URL())
		}
	}
	before, _ := gatherAll(f, bases)
	sendTo := bases
	if o.ReplicasFirst {
		sendTo = bases[:1]
	}
	var cpu *cpuWatch
	if f != nil {
		cpu = watchCPU(f.Workers)
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
				label, el, sent.Load(), n, done.Load(), failed.Load(), inflight.Load(),
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
			send(ctx, hc, sendTo[i%len(sendTo)], o.Model, &w.Requests[i], r)
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
	stretch := 0.0 // unknown for a target (JSON has no NaN)
	if cpu != nil {
		stretch = cpu.finish(f.Workers, o.Speedup)
	}
	rep := summarize(label, results[:sent.Load()], o, shape.generators(), wall)
	rep.Fleet = shape.String()
	if replicas > 1 {
		rep.Fleet += fmt.Sprintf(", %d scheduler replicas", replicas)
		switch {
		case o.ShareRedis != "" && o.SharePeers:
			rep.Fleet += " sharing through Redis and straight"
		case o.ShareRedis != "":
			rep.Fleet += " sharing through Redis"
		case o.SharePeers:
			rep.Fleet += " sharing straight, replica to replica"
		}
	}
	if o.Target != "" {
		rep.Fleet = "target"
	}
	rep.CPUStretch = stretch
	after, err := gatherAll(f, bases)
	if err == nil {
		b1, c1 := decisionHistogram(after)
		_, c0 := decisionHistogram(before)
		if len(c0) == len(c1) {
			for i := range c1 {
				c1[i] -= c0[i]
			}
		}
		c0s := counters(before)
		for k, v := range counters(after) {
			if d := v - c0s[k]; d > 0 {
				if rep.Counters == nil {
					rep.Counters = map[string]float64{}
				}
				rep.Counters[k] = d
			}
		}
		rep.DecisionP50us = bucketQuantile(0.5, b1, c1) * 1e6
		rep.DecisionP99us = bucketQuantile(0.99, b1, c1) * 1e6
		rep.DecisionCPUP50us, rep.DecisionCPUP99us = histogramQuantiles(before, after, "baton_routing_decision_cpu_seconds")
		rep.PartsUs = partQuantiles(before, after)
		if p50, p99 := histogramQuantiles(before, after, "baton_replica_sync_lag_seconds"); p99 > 0 {
			rep.SyncLagMs = [2]float64{p50 / 1e3, p99 / 1e3}
		}
		if n := histogramCount(before, after, "baton_replica_sync_unseen_seconds"); n > 0 {
			var received float64
			for k, v := range rep.Counters {
				if strings.HasPrefix(k, "replica_sync_entries_total{direction=received") {
					received += v
				}
			}
			p50, p99 := histogramQuantiles(before, after, "baton_replica_sync_unseen_seconds")
			rep.SyncUnseen = [3]float64{n / max(received, n), p50 / 1e3, p99 / 1e3}
		}
	}
	rep.checkHealth(o)
	return rep, nil
}

// Run replays w against every strategy of o, one after another, each on a
// fresh fleet with cold caches (in process) or the target.
func Run(ctx context.Context, o Options, w *workload.Workload) (*Report, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.Speedup == 0 {
		o.Speedup = 1
	}
	if o.Model == "" {
		o.Model = "llama-3.1-8b"
	}
	if o.GPU == "" {
		o.GPU = "h100"
	}
	if len(o.Fleets) == 0 || o.Target != "" {
		o.Fleets = []Fleet{{Workers: o.Workers}}
	}
	arrivals, err := Arrivals(w, o.Rate, o.Seed)
	if err != nil {
		return nil, err
	}
	rep := &Report{Workload: w.Name, Describe: w.Describe, Requests: len(w.Requests), Workers: o.Workers,
		Speedup: o.Speedup, Rate: o.Rate, Concurrency: o.Concurrency, Seed: o.Seed, Target: o.Target,
		Model: o.Model, GPU: o.GPU, SharedTier: o.SharedTier}
	for _, f := range o.Fleets {
		rep.Fleets = append(rep.Fleets, f.String())
	}
	if len(arrivals) > 1 && arrivals[len(arrivals)-1] > 0 {
		rep.OfferedRate = float64(len(arrivals)-1) / arrivals[len(arrivals)-1]
	}
	replicas := o.Replicas
	if len(replicas) == 0 {
		replicas = []int{1}
	}
	for _, s := range o.Strategies {
		for _, shape := range o.Fleets {
			for _, n := range replicas {
				sr, err := runOne(ctx, &o, w, arrivals, s, shape, n)
				if err != nil {
					return nil, err
				}
				rep.Strategies = append(rep.Strategies, *sr)
			}
		}
	}
	return rep, nil
}

// SimCPUBlocks maps Options.CPUBlocks (--cpu-blocks: 0 none, -1 the
// simulator's default) to sim.Tiers.CPUBlocks, whose zero means the
// default tier and -1 none.
func SimCPUBlocks(n int64) int64 {
	switch {
	case n == 0:
		return -1
	case n < 0:
		return 0
	}
	return n
}

// freeLoopbackPorts returns n loopback addresses whose ports were free a
// moment ago, for in-process replicas to listen on.
func freeLoopbackPorts(n int) ([]string, error) {
	var addrs []string
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		addrs = append(addrs, l.Addr().String())
	}
	return addrs, nil
}
