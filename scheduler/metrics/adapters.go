package metrics

import "github.com/prometheus/client_golang/prometheus"

// Adapters are the metrics of LoRA adapters: where requests for them were
// routed, and the loads the scheduler asked of workers.
type Adapters struct {
	// Requests counts requests for an adapter by adapter and route:
	// held (a worker held it) or loaded (it was loaded for them).
	Requests *prometheus.CounterVec
	// Loads counts adapter loads by worker, adapter and outcome (ok,
	// failed); Evictions the adapters unloaded to make room.
	Loads     *prometheus.CounterVec
	Evictions *prometheus.CounterVec
	// LoadSeconds is how long each load took, unload included.
	LoadSeconds prometheus.Histogram
	// Waiting counts requests waiting for an adapter's load.
	Waiting prometheus.Gauge
}

// NewAdapters registers the adapter metrics on m's registry.
func (m *Metrics) NewAdapters() *Adapters {
	a := &Adapters{
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_adapter_requests_total", Help: "Requests for a LoRA adapter, by adapter and route: held (a worker held it) or loaded (loaded for them).",
		}, []string{"adapter", "route"}),
		Loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_adapter_loads_total", Help: "LoRA adapter loads the scheduler asked of workers, by worker, adapter and outcome (ok, failed).",
		}, []string{"worker", "adapter", "outcome"}),
		Evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_adapter_evictions_total", Help: "LoRA adapters unloaded from a worker to make room for another, by worker.",
		}, []string{"worker"}),
		LoadSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "baton_adapter_load_seconds", Help: "Time a LoRA adapter load took on a worker, an eviction included.", Buckets: latencyBuckets,
		}),
		Waiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_adapter_load_waiting", Help: "Requests waiting for a LoRA adapter to be loaded.",
		}),
	}
	m.Registry.MustRegister(a.Requests, a.Loads, a.Evictions, a.LoadSeconds, a.Waiting)
	return a
}
