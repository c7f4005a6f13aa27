package scheduler_test

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
)

// BenchmarkAddedLatency measures what serve adds to the time to first
// byte of a streaming chat request: each iteration sends one request
// straight to a simulated worker's own OpenAI endpoint and one through the
// scheduler to the same worker (over gRPC), alternating which goes first
// so that noise hits both alike. The simulated clock is so fast that the
// engine's own time is negligible.
func BenchmarkAddedLatency(b *testing.B) {
	w := startWorker(b, "bench", 1e6, "127.0.0.1:0", true)
	_, addr := startScheduler(b, scheduler.Config{
		Strategy: "round_robin",
		Workers:  []scheduler.WorkerConfig{{Name: "bench", Address: w.GRPCAddr}},
	})
	hc := httpClient(b)
	body := `{"model":"` + model + `","stream":true,"max_tokens":1,"messages":[{"role":"user","content":"How far is the sun?"}]}`
	direct := "http://" + w.HTTPAddr + "/v1/chat/completions"
	via := "http://" + addr + "/v1/chat/completions"

	ttfb := func(url string) time.Duration {
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		start := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		var one [1]byte
		if _, err := io.ReadFull(resp.Body, one[:]); err != nil {
			b.Fatalf("%s: reading the first byte: %v", url, err)
		}
		d := time.Since(start)
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("%s: status %d", url, resp.StatusCode)
		}
		io.Copy(io.Discard, resp.Body)
		return d
	}
	// Warm both paths' connections.
	ttfb(direct)
	ttfb(via)

	b.ReportAllocs()
	ds := make([]time.Duration, 0, b.N)
	vs := make([]time.Duration, 0, b.N)
	added := make([]time.Duration, 0, b.N)
	for i := 0; b.Loop(); i++ {
		var d, v time.Duration
		if i%2 == 0 {
			d, v = ttfb(direct), ttfb(via)
		} else {
			v, d = ttfb(via), ttfb(direct)
		}
		ds, vs, added = append(ds, d), append(vs, v), append(added, v-d)
	}
	b.StopTimer()
	for _, m := range []struct {
		name string
		ds   []time.Duration
	}{{"direct", ds}, {"serve", vs}, {"added", added}} {
		b.ReportMetric(quantile(m.ds, 0.50), "p50-"+m.name+"-µs")
		b.ReportMetric(quantile(m.ds, 0.99), "p99-"+m.name+"-µs")
	}
}

// quantile returns the q-quantile of ds in microseconds (nearest rank).
func quantile(ds []time.Duration, q float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s)) + 0.5)
	i = min(max(i-1, 0), len(s)-1)
	return float64(s[i].Nanoseconds()) / 1e3
}
