// Package metrics defines the scheduler's Prometheus metrics, all named
// baton_*. Per-worker gauges (in-flight, health, breaker state) are read
// from the pool's snapshot at scrape time, so they can never drift from
// the pool's own counts.
package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/scheduler/pool"
)

// Request outcomes, the values of the outcome label.
const (
	OutcomeOK          = "ok"
	OutcomeInvalid     = "invalid"      // 4xx: the client's request was at fault
	OutcomeNoWorker    = "no_worker"    // 503: no worker could take it
	OutcomeWorkerError = "worker_error" // the worker failed it
	OutcomeCanceled    = "canceled"     // the client went away
	OutcomeTimeout     = "timeout"      // the request deadline passed
	OutcomeOverloaded  = "overloaded"   // 429: every worker at capacity and the queue full
	OutcomeRateLimited = "rate_limited" // 429: over its API key's token limit
	OutcomeInterrupted = "interrupted"  // still running when the scheduler's drain timed out
)

// Metrics holds the scheduler's metrics and the registry that serves them.
type Metrics struct {
	Registry *prometheus.Registry

	// Accepted counts requests that passed validation; every accepted
	// request ends as exactly one Completed or Failed.
	Accepted  prometheus.Counter
	Completed prometheus.Counter
	Failed    *prometheus.CounterVec // outcome

	Requests   *prometheus.CounterVec   // strategy, worker, outcome
	TTFT       *prometheus.HistogramVec // strategy
	InterToken *prometheus.HistogramVec // strategy
	Duration   *prometheus.HistogramVec // strategy, outcome
	Decision   *prometheus.HistogramVec // strategy
	// DecisionCPU is the CPU time the deciding thread spent on a decision
	// (Linux only): where it falls short of Decision's wall time, the
	// decision waited for a CPU rather than worked.
	DecisionCPU *prometheus.HistogramVec // strategy
	// RoutingPart is the time of each part of a routing profile.
	RoutingPart *prometheus.HistogramVec // strategy, part
	Spills      *prometheus.CounterVec   // strategy, worker (the worker spilled from)
	// Decisions counts committed routing decisions by why their worker
	// was chosen (routing.Reason).
	Decisions *prometheus.CounterVec // strategy, reason
	// PrefixCopies counts hot prefixes copied from their holder onto an
	// idle worker by KV transfer, by outcome: copied, held (the idle
	// worker had it), failed, holder_unavailable, unsupported (an engine
	// that cannot take transfers); all but copied recompute.
	PrefixCopies *prometheus.CounterVec // outcome
	Retries      *prometheus.CounterVec // reason

	QueueDepth prometheus.Gauge //
	// Draining is 1 once the scheduler drains for shutdown, else 0.
	Draining prometheus.Gauge
	// Connections is the client connections open on the front end
	// (max_connections bounds it).
	Connections     prometheus.Gauge
	QueueRejections *prometheus.CounterVec // reason (full, timeout)

	BreakerTransitions *prometheus.CounterVec // worker, to

	PromptTokens *prometheus.CounterVec // worker
	CachedTokens *prometheus.CounterVec // worker

	// KV-aware routing.
	PredictedCached *prometheus.CounterVec // strategy
	AchievedCached  *prometheus.CounterVec // strategy
	TierHits        *prometheus.CounterVec // tier (gpu, cpu, redis)
	IndexResyncs    *prometheus.CounterVec // worker, reason
	// Tokenize counts the tokenizations of requests keyed by an engine's
	// tokens, by outcome: hit (cached), miss (asked), failed and
	// unsupported (both keyed by text); TokenizeDuration times them.
	Tokenize         *prometheus.CounterVec   // outcome
	TokenizeDuration *prometheus.HistogramVec // outcome

	// Disaggregated prefill/decode.
	DisaggDecisions  *prometheus.CounterVec   // decision (remote, local), reason
	Fallbacks        *prometheus.CounterVec   // reason
	TransferBytes    prometheus.Counter       //
	TransferBlocks   *prometheus.CounterVec   // kind (sent, held, rejected)
	TransferDuration prometheus.Histogram     //
	TransferFailures *prometheus.CounterVec   // reason
	TTFTPhase        *prometheus.HistogramVec // phase (queue, prefill, transfer, first_decode)
}

// Histogram buckets, in seconds.
var (
	// Time to first token and end to end: 5 ms to about 80 s.
	latencyBuckets = prometheus.ExponentialBuckets(0.005, 2, 15)
	// Inter-token latency: 0.5 ms to about 1 s.
	tokenBuckets = prometheus.ExponentialBuckets(0.0005, 2, 12)
	// Routing decisions: 250 ns to 10 ms, closest from 10 to 100 µs,
	// where decisions and their aims lie (a bucket bound at 50 µs), so
	// that a p99 interpolated in one bucket is within about 25% of it.
	decisionBuckets = []float64{
		0.25e-6, 0.5e-6, 1e-6, 2e-6, 3e-6, 5e-6, 7.5e-6,
		10e-6, 12.5e-6, 15e-6, 20e-6, 25e-6, 30e-6, 40e-6, 50e-6, 60e-6, 75e-6,
		100e-6, 150e-6, 200e-6, 300e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
	}
	// Tokenization: 1 µs (a cache hit) to about 0.5 s.
	tokenizeBuckets = prometheus.ExponentialBuckets(1e-6, 2, 20)
)

// New registers every metric on a fresh registry, with the Go runtime and
// process collectors. The snapshots (one per pool) are read at each scrape
// for the per-worker gauges.
func New(snapshots ...func() *pool.Snapshot) *Metrics {
	r := prometheus.NewRegistry()
	f := func(c prometheus.Collector) { r.MustRegister(c) }
	m := &Metrics{
		Registry: r,
		Accepted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_requests_accepted_total", Help: "Requests that passed validation and were routed.",
		}),
		Completed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_requests_completed_total", Help: "Accepted requests that ended in a completion.",
		}),
		Failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_requests_failed_total", Help: "Accepted requests that ended in an error the client saw, by outcome.",
		}, []string{"outcome"}),
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_requests_total", Help: "Generation requests by strategy, worker and outcome (worker is empty when none was chosen).",
		}, []string{"strategy", "worker", "outcome"}),
		TTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_time_to_first_token_seconds", Help: "From the request's arrival to its first generated token.", Buckets: latencyBuckets,
		}, []string{"strategy"}),
		InterToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_inter_token_latency_seconds", Help: "Time between two generated chunks, per token.", Buckets: tokenBuckets,
		}, []string{"strategy"}),
		Duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_request_duration_seconds", Help: "From the request's arrival to its last byte.", Buckets: latencyBuckets,
		}, []string{"strategy", "outcome"}),
		Decision: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_routing_decision_seconds", Help: "Time a strategy took to pick a worker.", Buckets: decisionBuckets,
		}, []string{"strategy"}),
		DecisionCPU: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_routing_decision_cpu_seconds", Help: "CPU time of the thread that picked a worker, for one decision in eight, those made without changing threads (Linux only); beside baton_routing_decision_seconds, the rest is time waiting for a CPU.", Buckets: decisionBuckets,
		}, []string{"strategy"}),
		RoutingPart: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_routing_part_seconds", Help: "Time each part of a routing profile (its filters, each scorer, the picker) took in one decision.", Buckets: decisionBuckets,
		}, []string{"strategy", "part"}),
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_routing_decisions_total", Help: "Committed routing decisions, by the reason their worker was chosen (home, spill, kv_aware, replicate, ...).",
		}, []string{"strategy", "reason"}),
		PrefixCopies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_prefix_copies_total", Help: "Hot prefixes copied from their holder onto an idle worker by KV transfer, by outcome (copied; held, failed, holder_unavailable, unsupported recompute).",
		}, []string{"outcome"}),
		Spills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_overflow_spills_total", Help: "Requests that left their prefix's worker because it was at the concurrency threshold.",
		}, []string{"strategy", "worker"}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_retries_total", Help: "Requests sent to another worker after one failed before the first token, by reason.",
		}, []string{"reason"}),
		Draining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_draining", Help: "1 while the scheduler drains for shutdown: /readyz answers 503 and in-flight requests finish.",
		}),
		Connections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_http_connections", Help: "Client connections open on the front end; max_connections bounds them.",
		}),
		QueueDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_queue_depth", Help: "Requests waiting in the scheduler for a worker with room (max_in_flight).",
		}),
		QueueRejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_queue_rejections_total", Help: "Requests answered 429 because the queue was full or their wait timed out, by reason.",
		}, []string{"reason"}),
		BreakerTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_breaker_transitions_total", Help: "Worker breaker state changes, by the state entered.",
		}, []string{"worker", "to"}),
		PromptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_prompt_tokens_total", Help: "Prompt tokens of completed requests, by worker.",
		}, []string{"worker"}),
		CachedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_cached_tokens_total", Help: "Prompt tokens served from the worker's KV cache, by worker (hit rate = cached / prompt).",
		}, []string{"worker"}),
		PredictedCached: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_kv_predicted_cached_tokens_total", Help: "Prompt tokens the strategy expected the chosen worker to find cached (strategies that predict, such as kv_aware).",
		}, []string{"strategy"}),
		AchievedCached: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_kv_achieved_cached_tokens_total", Help: "Prompt tokens the chosen worker did find cached, for the requests counted in baton_kv_predicted_cached_tokens_total.",
		}, []string{"strategy"}),
		TierHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_cached_tokens_by_tier_total", Help: "Cached prompt tokens by the tier the worker found them in (gpu, cpu, redis).",
		}, []string{"tier"}),
		IndexResyncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_kv_index_resyncs_total", Help: "Times the KV index resubscribed to a worker's cache events, by worker and reason: gap (a sequence number skipped: events were lost), stream (the stream broke or ended) or unreachable (a subscription attempt failed).",
		}, []string{"worker", "reason"}),
		Tokenize: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_tokenize_total", Help: "Tokenizations of requests keyed by an engine's tokens, by outcome (hit: cached; miss: asked; failed and unsupported: keyed by text).",
		}, []string{"outcome"}),
		TokenizeDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_tokenize_seconds", Help: "Time to get a request's tokens (cache and tokenizer), by outcome.", Buckets: tokenizeBuckets,
		}, []string{"outcome"}),
		DisaggDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_disagg_decisions_total", Help: "Disaggregation decisions: remote prefill on a prefill worker, or local prefill on the decode worker, and why.",
		}, []string{"decision", "reason"}),
		Fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_fallbacks_total", Help: "Disaggregated requests that fell back (another prefill worker, local prefill, another decode worker), by reason.",
		}, []string{"reason"}),
		TransferBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "baton_transfer_bytes_total", Help: "KV payload bytes pushed from prefill to decode workers.",
		}),
		TransferBlocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_transfer_blocks_total", Help: "KV blocks of transfers: sent, held already by the decode worker (not sent), rejected as corrupt.",
		}, []string{"kind"}),
		TransferDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_transfer_duration_seconds", Help: "Time to push a prefill's KV blocks to the decode worker.", Buckets: tokenBuckets,
		}),
		TransferFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_transfer_failures_total", Help: "Prefill calls (computation or KV push) that failed, by reason.",
		}, []string{"reason"}),
		TTFTPhase: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "baton_ttft_phase_seconds", Help: "Time to first token of disaggregated requests, broken into queue, prefill, transfer and first decode step.", Buckets: latencyBuckets,
		}, []string{"phase"}),
	}
	for _, c := range []prometheus.Collector{
		m.PredictedCached, m.AchievedCached, m.TierHits, m.IndexResyncs, m.Tokenize, m.TokenizeDuration,
		m.DisaggDecisions, m.Fallbacks, m.TransferBytes, m.TransferBlocks, m.TransferDuration, m.TransferFailures, m.TTFTPhase,
		m.Accepted, m.Completed, m.Failed, m.Requests, m.TTFT, m.InterToken, m.Duration, m.Decision, m.DecisionCPU, m.RoutingPart, m.Decisions, m.PrefixCopies,
		m.Spills, m.Retries, m.QueueDepth, m.Draining, m.Connections, m.QueueRejections, m.BreakerTransitions, m.PromptTokens, m.CachedTokens,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		f(c)
	}
	if len(snapshots) > 0 {
		f(&workerCollector{snapshots: snapshots})
	}
	return m
}

// BreakerChanged records a breaker transition; give it to
// pool.OnBreakerChange.
func (m *Metrics) BreakerChanged(worker string, _, to gobreaker.State) {
	m.BreakerTransitions.WithLabelValues(worker, to.String()).Inc()
}

var (
	inFlightDesc = prometheus.NewDesc("baton_worker_in_flight", "Requests in flight on each worker.", []string{"worker"}, nil)
	healthyDesc  = prometheus.NewDesc("baton_worker_healthy", "1 if the worker passes its health checks, else 0.", []string{"worker"}, nil)
	breakerDesc  = prometheus.NewDesc("baton_worker_breaker_state", "State of the worker's breaker: 0 closed, 1 half-open, 2 open.", []string{"worker"}, nil)
	workersDesc  = prometheus.NewDesc("baton_workers_available", "Workers that are healthy with their breaker not open.", nil, nil)
)

// workerCollector reads per-worker gauges from the pool at scrape time.
type workerCollector struct {
	snapshots []func() *pool.Snapshot
}

func (c *workerCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- inFlightDesc
	ch <- healthyDesc
	ch <- breakerDesc
	ch <- workersDesc
}

func (c *workerCollector) Collect(ch chan<- prometheus.Metric) {
	available := 0
	for _, snapshot := range c.snapshots {
		snap := snapshot()
		if snap == nil {
			continue
		}
		available += c.collect(ch, snap)
	}
	ch <- prometheus.MustNewConstMetric(workersDesc, prometheus.GaugeValue, float64(available))
}

func (c *workerCollector) collect(ch chan<- prometheus.Metric, snap *pool.Snapshot) (available int) {
	for _, w := range snap.Workers {
		ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(w.InFlight()), w.Name)
		ch <- prometheus.MustNewConstMetric(healthyDesc, prometheus.GaugeValue, b2f(w.Healthy()), w.Name)
		ch <- prometheus.MustNewConstMetric(breakerDesc, prometheus.GaugeValue, float64(breakerValue(w.BreakerState())), w.Name)
		if w.Available() {
			available++
		}
	}
	return available
}

func breakerValue(s gobreaker.State) int {
	switch s {
	case gobreaker.StateHalfOpen:
		return 1
	case gobreaker.StateOpen:
		return 2
	}
	return 0
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// EngineCounts are one vLLM or SGLang worker's cumulative counts, by the
// value of each metric's label.
type EngineCounts struct {
	Worker string
	// Scrapes counts scrapes of its metrics by outcome (ok, failed,
	// garbage).
	Scrapes map[string]uint64
	// Events counts its KV events by what the index made of them (blocks
	// stored and removed, clears, and the reasons some were dropped).
	Events map[string]uint64
	// Stream counts what happened to its stream of event batches
	// (batches, gaps, replays, resets, reconnects, ...).
	Stream map[string]uint64
	// ScrapeInterval is the interval between scrapes of its metrics in
	// use, 0 when unknown.
	ScrapeInterval time.Duration
}

var (
	engineScrapesDesc = prometheus.NewDesc("baton_engine_scrapes_total",
		"Scrapes of vLLM, SGLang and llama.cpp workers' metrics, by outcome: ok, failed (no answer, or not 200), garbage (text or values baton cannot use; what was usable still counts); and, with replicas.peers.share_load, skipped (another replica relayed the load within the interval) and relayed (reports taken from another replica).",
		[]string{"worker", "outcome"}, nil)
	kvEventsDesc = prometheus.NewDesc("baton_kv_events_total",
		"KV cache events of vLLM and SGLang workers by outcome: blocks stored and removed in the index, AllBlocksCleared events (cleared), and the blocks or events dropped (unknown_parent, bad_stored, ...).",
		[]string{"worker", "outcome"}, nil)
	scrapeIntervalDesc = prometheus.NewDesc("baton_engine_scrape_interval_seconds",
		"The interval between scrapes of vLLM and SGLang workers' metrics in use: the configured metrics_interval, or longer while the engines share scrapes_per_second.",
		[]string{"worker"}, nil)
	kvStreamDesc = prometheus.NewDesc("baton_kv_event_stream_total",
		"What happened to vLLM and SGLang workers' streams of KV event batches: batches delivered, decode errors, gaps, replays, resets, reconnects, ...",
		[]string{"worker", "event"}, nil)
)

// CollectEngines registers a collector that reads counts at each scrape.
func (m *Metrics) CollectEngines(counts func() []EngineCounts) {
	m.Registry.MustRegister(engineCollector(counts))
}

type engineCollector func() []EngineCounts

func (c engineCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- engineScrapesDesc
	ch <- kvEventsDesc
	ch <- kvStreamDesc
	ch <- scrapeIntervalDesc
}

func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c() {
		if e.ScrapeInterval > 0 {
			ch <- prometheus.MustNewConstMetric(scrapeIntervalDesc, prometheus.GaugeValue, e.ScrapeInterval.Seconds(), e.Worker)
		}
		for _, d := range []struct {
			desc   *prometheus.Desc
			counts map[string]uint64
		}{{engineScrapesDesc, e.Scrapes}, {kvEventsDesc, e.Events}, {kvStreamDesc, e.Stream}} {
			for label, v := range d.counts {
				ch <- prometheus.MustNewConstMetric(d.desc, prometheus.CounterValue, float64(v), e.Worker, label)
			}
		}
	}
}
