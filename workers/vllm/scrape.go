package vllm

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
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
	return &Scraper{url: u.String(), engine: e, hc: &http.Client{Transport: rt}, tr: rt}, nil
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
func (s *Scraper) Scrape(ctx context.Context) (Metrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url, nil)
	if err != nil {
		return Metrics{}, err
	}
	// The text format: expfmt's text parser reads it, and every version of
	// both engines serves it.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := s.hc.Do(req)
	if err != nil {
		return Metrics{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return Metrics{}, fmt.Errorf("GET %s: status %d", s.url, resp.StatusCode)
	}
	return ParseEngine(io.LimitReader(resp.Body, maxMetricsBytes), s.engine, s.rank)
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
