package sim

import (
	"errors"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
)

// Metrics is a worker's Prometheus registry: its engine's KV cache,
// sequences and transfers (read from Load and Stats at each scrape), its
// shared tier's breaker and errors (fed by StoreOptions), and the Go and
// process collectors (RSS among them). Its methods are safe for
// concurrent use.
type Metrics struct {
	// Registry holds every collector; serve it with promhttp.HandlerFor.
	Registry *prometheus.Registry

	log              *slog.Logger
	storeState       *prometheus.GaugeVec
	storeTransitions *prometheus.CounterVec
	storeErrors      *prometheus.CounterVec
}

// NewMetrics returns a registry with the Go and process collectors and the
// shared tier's metrics; Engine adds an engine's. Breaker transitions are
// logged to log (nil discards).
func NewMetrics(log *slog.Logger) *Metrics {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		log:      log,
		storeState: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "baton_kv_store_breaker_state",
			Help: "State of the shared KV tier's breaker: 0 closed, 1 half-open, 2 open (the tier is bypassed).",
		}, []string{"store"}),
		storeTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_kv_store_breaker_transitions_total",
			Help: "State changes of the shared KV tier's breaker, by the state entered.",
		}, []string{"store", "to"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_kv_store_errors_total",
			Help: "Failed calls to the shared KV tier, by operation and reason: error (the store failed) or bypassed (the breaker refused the call).",
		}, []string{"store", "op", "reason"}),
	}
	m.Registry.MustRegister(m.storeState, m.storeTransitions, m.storeErrors,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// StoreOptions returns the options of the shared tier's breaker, named
// store, that log its transitions (WARN when it opens, INFO when it
// half-opens or closes) and count them and its errors. The state gauge
// starts at closed.
func (m *Metrics) StoreOptions(store string) []kvstore.BreakerOption {
	m.storeState.WithLabelValues(store).Set(0)
	for _, op := range []kvstore.Op{kvstore.OpPut, kvstore.OpGet, kvstore.OpExists, kvstore.OpTouch, kvstore.OpHottest} {
		for _, reason := range []string{"error", "bypassed"} {
			m.storeErrors.WithLabelValues(store, string(op), reason)
		}
	}
	return []kvstore.BreakerOption{
		kvstore.OnStateChange(m.storeStateChanged),
		kvstore.OnError(func(op kvstore.Op, err error) {
			reason := "error"
			if errors.Is(err, transfer.ErrBypassed) {
				reason = "bypassed"
			}
			m.storeErrors.WithLabelValues(store, string(op), reason).Inc()
		}),
	}
}

func (m *Metrics) storeStateChanged(store string, from, to gobreaker.State) {
	m.storeState.WithLabelValues(store).Set(breakerValue(to))
	m.storeTransitions.WithLabelValues(store, to.String()).Inc()
	if to == gobreaker.StateOpen {
		m.log.Warn("kv store breaker open: shared tier bypassed", "store", store, "from", from.String())
		return
	}
	m.log.Info("kv store breaker "+to.String(), "store", store, "from", from.String())
}

// breakerValue is a state's value in baton_kv_store_breaker_state, as in
// the scheduler's baton_worker_breaker_state.
func breakerValue(s gobreaker.State) float64 {
	switch s {
	case gobreaker.StateHalfOpen:
		return 1
	case gobreaker.StateOpen:
		return 2
	}
	return 0
}

// Engine registers e's metrics, read at each scrape.
func (m *Metrics) Engine(e *Engine) { m.Registry.MustRegister(engineCollector{e}, loraCollector{e}) }

var (
	blocksUsedDesc = prometheus.NewDesc("baton_worker_kv_blocks_used",
		"KV blocks in use by tier: GPU blocks referenced or reserved by sequences, blocks held in the CPU tier.", []string{"tier"}, nil)
	blocksCapDesc = prometheus.NewDesc("baton_worker_kv_blocks_capacity",
		"KV block capacity by tier.", []string{"tier"}, nil)
	seqsDesc = prometheus.NewDesc("baton_worker_sequences",
		"Sequences by state: running (in the batch) or waiting (queued).", []string{"state"}, nil)
	pendingDesc = prometheus.NewDesc("baton_worker_waiting_prefill_tokens",
		"Prompt tokens still to prefill.", nil, nil)
	transfersDesc = prometheus.NewDesc("baton_worker_transfers_total",
		"KV transfers, by direction: sent (pushes to decode workers) or received.", []string{"direction"}, nil)
	transferFailDesc = prometheus.NewDesc("baton_worker_transfer_failures_total",
		"KV transfers that failed or broke off, by direction.", []string{"direction"}, nil)
	transferBlocksDesc = prometheus.NewDesc("baton_worker_transfer_blocks_total",
		"KV blocks of transfers, by direction and outcome: sent, accepted (received into the cache) or rejected (received corrupt).", []string{"direction", "outcome"}, nil)
	transferBytesDesc = prometheus.NewDesc("baton_worker_transfer_bytes_total",
		"KV payload bytes of transfers, by direction (received: accepted blocks).", []string{"direction"}, nil)
	storeLookupsDesc = prometheus.NewDesc("baton_worker_store_lookups_total",
		"Lookups in the shared tier at admission, by outcome (ok or error, which includes bypassed).", []string{"outcome"}, nil)
	storeBlocksDesc = prometheus.NewDesc("baton_worker_store_blocks_total",
		"Blocks moved to or from the shared tier: fetched, written, write_failed, write_dropped (write queue full).", []string{"kind"}, nil)
)

// engineCollector reads an engine's Load and Stats at each scrape.
type engineCollector struct{ e *Engine }

func (c engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{blocksUsedDesc, blocksCapDesc, seqsDesc, pendingDesc,
		transfersDesc, transferFailDesc, transferBlocksDesc, transferBytesDesc, storeLookupsDesc, storeBlocksDesc} {
		ch <- d
	}
}

func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	l, s := c.e.Load(), c.e.Stats()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge(blocksUsedDesc, float64(l.BlocksUsed), "gpu")
	gauge(blocksUsedDesc, float64(l.CPUBlocksUsed), "cpu")
	gauge(blocksCapDesc, float64(l.BlocksTotal), "gpu")
	gauge(blocksCapDesc, float64(l.CPUBlocksTotal), "cpu")
	gauge(seqsDesc, float64(l.Running), "running")
	gauge(seqsDesc, float64(l.Waiting), "waiting")
	gauge(pendingDesc, float64(l.WaitingPrefillTokens))
	counter(transfersDesc, s.Pushes, "sent")
	counter(transfersDesc, s.TransfersReceived, "received")
	counter(transferFailDesc, s.PushFailures, "sent")
	counter(transferFailDesc, s.TransferFailures, "received")
	counter(transferBlocksDesc, s.PushBlocks, "sent", "sent")
	counter(transferBlocksDesc, s.ReceivedBlocks, "received", "accepted")
	counter(transferBlocksDesc, s.RejectedBlocks, "received", "rejected")
	counter(transferBytesDesc, s.PushBytes, "sent")
	counter(transferBytesDesc, s.ReceivedBlocks*uint64(c.e.BlockBytes()), "received")
	counter(storeLookupsDesc, s.StoreLookups-s.StoreErrors, "ok")
	counter(storeLookupsDesc, s.StoreErrors, "error")
	counter(storeBlocksDesc, s.StoreHitBlocks, "fetched")
	counter(storeBlocksDesc, s.StoreWrites, "written")
	counter(storeBlocksDesc, s.StoreWriteErrors, "write_failed")
	counter(storeBlocksDesc, s.StoreWriteDropped, "write_dropped")
}

var _ prometheus.Collector = engineCollector{}
