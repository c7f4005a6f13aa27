package vllm

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/workers/httpengine"
)

// DefaultMetricsPath is where vLLM and SGLang serve their metrics.
const DefaultMetricsPath = "/metrics"

// maxMetricsBytes bounds what a scrape reads: vLLM's text is tens of KiB,
// with a histogram per LoRA adapter a few hundred.
const maxMetricsBytes = 8 << 20

// Scraper reads one engine's metrics over HTTP. Its methods are safe for
// concurrent use.
type Scraper struct {
	url    string
	engine Engine
	rank   string // the data-parallel engine read, "" all
	hc     *http.Client
	tr     interface{ CloseIdleConnections() }

	// named is url asking for only the series baton reads (vLLM); ""
	// when the engine's kind is not asked so. whole is set once the
	// engine answered it without them and the whole page with them.
	named string
	whole atomic.Bool
}

// HTTPOption configures the HTTP transport of a Scraper or a Tokenizer.
type HTTPOption func(*http.Transport)

// WithTLS reaches an https engine with cfg (tlsconf.Client): its
// certificate verified against cfg's roots, cfg's client certificate
// presented to an engine that requires one. Without it the system roots
// verify.
func WithTLS(cfg *tls.Config) HTTPOption {
	return func(tr *http.Transport) { tr.TLSClientConfig = cfg }
}

// NewScraper returns a Scraper of the engine at baseURL (as
// http://10.0.0.7:8000), whose metrics are at path (DefaultMetricsPath
// when empty). Close it.
func NewScraper(baseURL, path string, e Engine, opts ...HTTPOption) (*Scraper, error) {
	if path == "" {
		path = DefaultMetricsPath
	}
	u, err := endpointURL(baseURL, path, "metrics")
	if err != nil {
		return nil, err
	}
	// One connection, kept alive between scrapes; no proxy: engines sit
	// on the cluster network.
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 1,
		IdleConnTimeout:     time.Minute,
	}
	for _, opt := range opts {
		opt(tr)
	}
	rt := httpengine.PlainHTTP(tr)
	s := &Scraper{url: u.String(), engine: e, hc: &http.Client{Transport: rt}, tr: rt}
	if e == VLLM {
		s.named = namedURL(u, engineNames[e].read)
	}
	return s, nil
}

// namedURL returns u asking for only the series names: the query
// prometheus_client's exposition reads (name[]=…, once a name), which
// vLLM's /metrics serves through. A vLLM page is tens of kilobytes, most
// of it histograms baton does not read; the series it reads are a few
// hundred bytes, and the engine writes only those.
func namedURL(u *url.URL, names map[string]struct{}) string {
	q := u.Query()
	for name := range names {
		q.Add("name[]", name)
	}
	q["name[]"] = slices.Sorted(slices.Values(q["name[]"]))
	n := *u
	n.RawQuery = q.Encode()
	return n.String()
}

// NewRankScraper is NewScraper of one data-parallel rank of a vLLM or
// SGLang engine (--data-parallel-size, --dp-size): it reads only that
// rank's series (ParseEngine).
func NewRankScraper(baseURL, path string, e Engine, rank int, opts ...HTTPOption) (*Scraper, error) {
	s, err := NewScraper(baseURL, path, e, opts...)
	if err != nil {
		return nil, err
	}
	s.rank = strconv.Itoa(rank)
	return s, nil
}

// URL returns the address scraped.
func (s *Scraper) URL() string { return s.url }

// Scrape fetches and parses the engine's metrics; ctx bounds it. An error
// wrapping ErrGarbage comes with the Metrics that could be read; any other
// error (the engine did not answer, or not with 200) with none.
//
// A vLLM engine is asked for only the series baton reads (namedURL). Not
// every server honours the query: prometheus_client's before it read
// the query as text serve the whole page, which Parse reads as well; a
// multiprocess registry (PROMETHEUS_MULTIPROC_DIR, as vLLM sets with
// several API server processes) answers with an empty page, and some
// other server might refuse the query. When the answer has no load,
// the whole page is read; if it has the load, the engine is not asked
// by name again.
func (s *Scraper) Scrape(ctx context.Context) (Metrics, error) {
	if s.named == "" || s.whole.Load() {
		m, _, err := s.get(ctx, s.url)
		return m, err
	}
	m, answered, err := s.get(ctx, s.named)
	if m.HasLoad || !answered {
		return m, err
	}
	m, _, err = s.get(ctx, s.url)
	if m.HasLoad && !s.whole.Swap(true) {
		slog.Info("engine metrics: the series asked for by name were not served; reading the whole page", "url", s.url)
	}
	return m, err
}

// Named reports whether the engine is asked for only the series baton
// reads (Scrape).
func (s *Scraper) Named() bool { return s.named != "" && !s.whole.Load() }

// get fetches and parses the metrics at target; answered is whether the
// engine answered at all (with any status).
func (s *Scraper) get(ctx context.Context, target string) (_ Metrics, answered bool, _ error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return Metrics{}, false, err
	}
	// The text format: expfmt's text parser reads it, and every version of
	// both engines serves it.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := s.hc.Do(req)
	if err != nil {
		return Metrics{}, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return Metrics{}, true, fmt.Errorf("GET %s: status %d", target, resp.StatusCode)
	}
	m, err := ParseEngine(io.LimitReader(resp.Body, maxMetricsBytes), s.engine, s.rank)
	return m, true, err
}

// Close releases the scraper's idle connection.
func (s *Scraper) Close() error {
	s.tr.CloseIdleConnections()
	return nil
}

// endpointURL returns the URL of the engine at baseURL's endpoint path,
// which must be an http or https URL with a host; what names the endpoint
// in errors.
func endpointURL(baseURL, path, what string) (*url.URL, error) {
	u, err := url.Parse(strings.TrimRight(baseURL, "/") + path)
	if err != nil {
		return nil, fmt.Errorf("%s url: %w", what, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("%s url %q: not an http URL", what, u)
	}
	return u, nil
}
