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
	if q := bucketQuantile(0.5, bounds, cum); !(q > 1.6e-6 && q <= 3.2e-6) || math.IsNaN(q) {
		t.Errorf("p50 %v, want within the 1.6–3.2 µs bucket", q)
	}
}
