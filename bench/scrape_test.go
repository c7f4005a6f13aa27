package bench

import (
	"math"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/batonllm/baton/scheduler/metrics"
)

// --target reads the decision histogram from the scheduler's /metrics text.
func TestScrapeDecisionHistogram(t *testing.T) {
	m := metrics.New(nil)
	for range 10 {
		m.Decision.WithLabelValues("prefix_aware").Observe(3e-6)
	}
	srv := httptest.NewServer(promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	defer srv.Close()
	mfs, err := gather(nil, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	bounds, cum := decisionHistogram(mfs)
	if len(cum) == 0 || cum[len(cum)-1] != 10 {
		t.Fatalf("histogram %v %v", bounds, cum)
	}
	if q := bucketQuantile(0.5, bounds, cum); !(q > 2e-6 && q <= 3e-6) || math.IsNaN(q) {
		t.Errorf("p50 %v, want within the 2–3 µs bucket", q)
	}
}

// The report breaks the decision into the profile's parts.
func TestPartQuantiles(t *testing.T) {
	m := metrics.New(nil)
	srv := httptest.NewServer(promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	defer srv.Close()
	before, err := gather(nil, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	for range 10 {
		m.RoutingPart.WithLabelValues("kv_aware", "kv").Observe(30e-6)
		m.RoutingPart.WithLabelValues("kv_aware", "filters").Observe(1e-6)
	}
	after, err := gather(nil, srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := partQuantiles(before, after)
	if len(q) != 2 {
		t.Fatalf("parts %v, want kv and filters", q)
	}
	if kv := q["kv"]; !(kv[0] > 25 && kv[0] <= 30 && kv[1] <= 30) {
		t.Errorf("kv p50/p99 %v µs, want within the 25–30 µs bucket", kv)
	}
	if f := q["filters"]; !(f[0] > 0.5 && f[0] <= 1) {
		t.Errorf("filters p50 %v µs, want within the 0.5–1 µs bucket", f[0])
	}
}
