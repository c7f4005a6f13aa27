package llamacpp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/batonllm/baton/workers/vllm"

	"github.com/batonllm/baton/workers/httpengine"
)

// DefaultMetricsPath is where llama-server serves its metrics (with
// --metrics).
const DefaultMetricsPath = "/metrics"

// propsEvery is how many scrapes reuse the server's /props: its slots and
// context size change only when it restarts, and then it answers /props
// anew before it serves.
const propsEvery = 40

// maxBody bounds what a scrape reads of one endpoint.
const maxBody = 4 << 20

// Scraper reads one llama-server's load and capacity: its running and
// waiting requests from /metrics (llamacpp:requests_processing and
// requests_deferred), or, when the server was started without --metrics,
// its busy slots from /slots; its slots and context size from /props. It
// implements the scheduler's watch.MetricsSource: Scrape is called from
// one goroutine at a time.
type Scraper struct {
	base, metrics string
	hc            *http.Client
	tr            interface{ CloseIdleConnections() }

	// The scrape goroutine's own: the last /props read, and scrapes
	// since.
	props     props
	propsAge  int
	noMetrics bool // /metrics answered 404 or 501: read /slots
}

// props is what the scraper reads of /props.
type props struct {
	Slots    int `json:"total_slots"`
	Settings struct {
		NCtx int64 `json:"n_ctx"` // per slot
	} `json:"default_generation_settings"`
}

// NewScraper returns a Scraper of the server at baseURL (as
// http://10.0.0.7:8080), whose metrics are at metricsPath
// (DefaultMetricsPath when empty); opts configure its transport
// (vllm.WithTLS). Close it.
func NewScraper(baseURL, metricsPath string, opts ...vllm.HTTPOption) (*Scraper, error) {
	if metricsPath == "" {
		metricsPath = DefaultMetricsPath
	}
	u, err := url.Parse(strings.TrimRight(baseURL, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("llama-server url %q: not an http URL", baseURL)
	}
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 1,
		IdleConnTimeout:     time.Minute,
	}
	for _, opt := range opts {
		opt(tr)
	}
	rt := httpengine.PlainHTTP(tr)
	return &Scraper{base: u.String(), metrics: u.String() + metricsPath, hc: &http.Client{Transport: rt}, tr: rt}, nil
}

// Scrape reads the server's load and capacity; ctx bounds it. The
// capacity (Metrics.Slots, and KVTokens: the slots' context) comes from
// /props, read on the first scrape and every propsEvery after; the load
// from /metrics, or /slots. An error wrapping vllm.ErrGarbage comes with
// what could be read.
func (s *Scraper) Scrape(ctx context.Context) (vllm.Metrics, error) {
	if s.propsAge == 0 || s.props.Slots == 0 {
		var p props
		if err := s.getJSON(ctx, "/props", &p); err != nil {
			return vllm.Metrics{}, err
		}
		if p.Slots < 0 || p.Settings.NCtx < 0 {
			return vllm.Metrics{}, fmt.Errorf("%w: /props: total_slots %d, n_ctx %d", vllm.ErrGarbage, p.Slots, p.Settings.NCtx)
		}
		s.props = p
	}
	s.propsAge = (s.propsAge + 1) % propsEvery
	m, err := s.load(ctx)
	m.Slots = s.props.Slots
	m.KVTokens = s.props.Settings.NCtx * int64(s.props.Slots)
	return m, err
}

// load reads the server's running and waiting requests.
func (s *Scraper) load(ctx context.Context) (vllm.Metrics, error) {
	if !s.noMetrics {
		m, err := s.scrapeMetrics(ctx)
		if !errors.Is(err, errNoEndpoint) {
			return m, err
		}
		s.noMetrics = true
	}
	var slots []struct {
		Processing bool `json:"is_processing"`
	}
	if err := s.getJSON(ctx, "/slots", &slots); err != nil {
		if errors.Is(err, errNoEndpoint) {
			s.noMetrics = false // neither: try /metrics again next time
		}
		return vllm.Metrics{}, err
	}
	m := vllm.Metrics{HasLoad: true}
	for _, sl := range slots {
		if sl.Processing {
			m.Running++
		}
	}
	return m, nil
}

// errNoEndpoint: the server does not serve the endpoint (404, or 501: it
// was started without --metrics or with --no-slots).
var errNoEndpoint = errors.New("endpoint not served")

func (s *Scraper) get(ctx context.Context, url string) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		resp.Body.Close()
		if resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusNotImplemented {
			return nil, fmt.Errorf("%w: %w", errNoEndpoint, errStatus(url, resp.StatusCode))
		}
		return nil, errStatus(url, resp.StatusCode)
	}
	return resp.Body, nil
}

func (s *Scraper) scrapeMetrics(ctx context.Context) (vllm.Metrics, error) {
	body, err := s.get(ctx, s.metrics)
	if err != nil {
		return vllm.Metrics{}, err
	}
	defer body.Close()
	return vllm.Parse(io.LimitReader(body, maxBody), vllm.LlamaCPP)
}

func (s *Scraper) getJSON(ctx context.Context, path string, v any) error {
	body, err := s.get(ctx, s.base+path)
	if err != nil {
		return err
	}
	defer body.Close()
	if err := json.NewDecoder(io.LimitReader(body, maxBody)).Decode(v); err != nil {
		return fmt.Errorf("%w: %s: %w", vllm.ErrGarbage, path, err)
	}
	return nil
}

// Close releases the scraper's idle connection.
func (s *Scraper) Close() error {
	s.tr.CloseIdleConnections()
	return nil
}
