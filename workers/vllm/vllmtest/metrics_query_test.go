package vllmtest

import "testing"

// TestRestrictPage: a query naming series gets those samples with their
// families' comments, as prometheus_client's restricted registry writes
// them: a counter is named by its sample (_total), and a family none of
// whose samples is named is left out whole.
func TestRestrictPage(t *testing.T) {
	const page = `# HELP a_gauge A gauge.
# TYPE a_gauge gauge
a_gauge{engine="0"} 1.0
a_gauge{engine="1"} 2.0
# HELP b_requests_total Requests.
# TYPE b_requests_total counter
b_requests_total{engine="0"} 5.0
# HELP b_requests_created Requests.
# TYPE b_requests_created gauge
b_requests_created{engine="0"} 1.7e9
# HELP c_seconds Latency.
# TYPE c_seconds histogram
c_seconds_bucket{le="1.0"} 3.0
c_seconds_count 3.0
c_seconds_sum 1.5
`
	for _, tt := range []struct {
		names []string
		want  string
	}{
		{[]string{"a_gauge", "b_requests_total"}, `# HELP a_gauge A gauge.
# TYPE a_gauge gauge
a_gauge{engine="0"} 1.0
a_gauge{engine="1"} 2.0
# HELP b_requests_total Requests.
# TYPE b_requests_total counter
b_requests_total{engine="0"} 5.0
`},
		{[]string{"c_seconds_count", "missing"}, `# HELP c_seconds Latency.
# TYPE c_seconds histogram
c_seconds_count 3.0
`},
		{[]string{"c_seconds", "b_requests"}, ``},
	} {
		if got := string(restrictPage([]byte(page), tt.names)); got != tt.want {
			t.Errorf("restrictPage(%q) =\n%s\nwant\n%s", tt.names, got, tt.want)
		}
	}
}
