package vllmtest

import (
	"bytes"
	"net/http"
)

// MetricsQuery is how the server's /metrics answers a query naming the
// series wanted (name[]=…, once a name), as prometheus_client's exposition
// reads it in the versions and modes vLLM runs it.
type MetricsQuery uint8

const (
	// QueryNames serves only the samples named, each family's HELP and
	// TYPE with them: prometheus_client's restricted registry over the
	// registry of one process, vLLM's default.
	QueryNames MetricsQuery = iota
	// QueryIgnored serves the whole page whatever the query, as
	// prometheus_client's ASGI app did while it read the query's keys as
	// bytes and looked for a text one.
	QueryIgnored
	// QueryEmpty serves an empty page to a query naming series: a
	// multiprocess registry (PROMETHEUS_MULTIPROC_DIR, which vLLM sets
	// with several API server processes) has one collector that describes
	// no names, so the restricted registry finds none to collect.
	QueryEmpty
	// QueryRefused answers a query with 400, as a server that takes no
	// query there might.
	QueryRefused
)

// writeMetricsPage writes page (a whole text-format page) to w as the
// server's mode answers r's query.
func writeMetricsPage(w http.ResponseWriter, r *http.Request, mode MetricsQuery, page []byte) {
	var names []string
	if r != nil {
		names = r.URL.Query()["name[]"]
	}
	if r != nil && r.URL.RawQuery != "" && mode == QueryRefused {
		http.Error(w, "unexpected query", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	switch {
	case len(names) == 0 || mode == QueryIgnored:
		w.Write(page)
	case mode == QueryEmpty:
	default:
		w.Write(restrictPage(page, names))
	}
}

// restrictPage returns the samples of page whose names are among names,
// each family (its lines from one HELP comment to the next) with its
// comments, and no family none of whose samples is named.
func restrictPage(page []byte, names []string) []byte {
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	out, comments, samples := make([]byte, 0, len(page)/2), make([]byte, 0, 512), make([]byte, 0, 512)
	flush := func() {
		if len(samples) > 0 {
			out = append(out, comments...)
			out = append(out, samples...)
		}
		comments, samples = comments[:0], samples[:0]
	}
	for len(page) > 0 {
		line := page
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i+1], page[i+1:]
		} else {
			page = nil
		}
		if bytes.HasPrefix(line, []byte("# HELP ")) {
			flush()
		}
		if line[0] == '#' {
			comments = append(comments, line...)
			continue
		}
		name := line
		if i := bytes.IndexAny(line, "{ \n"); i >= 0 {
			name = line[:i]
		}
		if want[string(name)] {
			samples = append(samples, line...)
		}
	}
	flush()
	return out
}
