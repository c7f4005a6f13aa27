package main

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	pmodel "github.com/prometheus/common/model"
)

// metrics is one scrape of a /metrics endpoint.
type metrics map[string]*dto.MetricFamily

func scrape(ctx context.Context, base string) (metrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /metrics: HTTP %d", resp.StatusCode)
	}
	p := expfmt.NewTextParser(pmodel.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

// sum adds the values of name's series whose labels include match.
func (m metrics) sum(name string, match map[string]string) float64 {
	var s float64
	for _, mt := range m.series(name, match) {
		s += value(mt)
	}
	return s
}

func (m metrics) series(name string, match map[string]string) []*dto.Metric {
	mf := m[name]
	if mf == nil {
		return nil
	}
	var out []*dto.Metric
	for _, mt := range mf.GetMetric() {
		if matches(mt, match) {
			out = append(out, mt)
		}
	}
	return out
}

func matches(mt *dto.Metric, match map[string]string) bool {
	n := 0
	for _, lp := range mt.GetLabel() {
		if v, ok := match[lp.GetName()]; ok {
			if v != lp.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(match)
}

func value(mt *dto.Metric) float64 {
	switch {
	case mt.Counter != nil:
		return mt.Counter.GetValue()
	case mt.Gauge != nil:
		return mt.Gauge.GetValue()
	case mt.Untyped != nil:
		return mt.Untyped.GetValue()
	}
	return 0
}

// byLabels returns name's values keyed by the values of labels, joined.
func (m metrics) byLabels(name string, labels ...string) map[string]float64 {
	out := map[string]float64{}
	for _, mt := range m.series(name, nil) {
		var key []string
		for _, l := range labels {
			for _, lp := range mt.GetLabel() {
				if lp.GetName() == l {
					key = append(key, lp.GetValue())
				}
			}
		}
		out[strings.Join(key, "→")] += value(mt)
	}
	return out
}

// transitions describes the breaker transitions between two scrapes of
// baton_breaker_transitions_total, e.g. "d1→open 1, d1→half_open 1".
func transitions(before, after metrics) string {
	b := before.byLabels("baton_breaker_transitions_total", "worker", "to")
	a := after.byLabels("baton_breaker_transitions_total", "worker", "to")
	var parts []string
	for k, v := range a {
		if d := v - b[k]; d > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, d))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// tierTransitions describes the shared tier's breaker transitions in the
// workers between two scrapes: baton_kv_store_breaker_transitions_total.
// A worker restarted in between counts from zero.
func tierTransitions(before, after map[string]metrics) string {
	n := map[string]float64{}
	for name, a := range after {
		b := before[name].byLabels("baton_kv_store_breaker_transitions_total", "to")
		for to, v := range a.byLabels("baton_kv_store_breaker_transitions_total", "to") {
			if v < b[to] { // restarted
				b[to] = 0
			}
			n["→"+to] += v - b[to]
		}
	}
	var parts []string
	for k, v := range n {
		if v > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, v))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}
