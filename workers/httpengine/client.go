// Package httpengine is the scheduler's client of an engine that speaks the
// OpenAI HTTP API itself: vLLM, SGLang, llama.cpp's llama-server. It relays
// such an engine's responses byte for byte (Proxy), or turns its
// server-sent events into engine events (Generate).
//
// Status codes: a 2xx response is relayed. A 4xx response other than 429 is
// the client's own error (bad request, unknown model, context too long) and
// is relayed unchanged too: Proxy returns no error and Written is true. Any
// other status (429, 5xx, unfollowed 3xx) is answered by a *StatusError
// before anything is written, so the caller may retry elsewhere or write
// its own error; it wraps engine.ErrUnavailable for 429, 502, 503 and 504
// (the engine is overloaded, starting or behind a failing proxy), not for
// 500 and the rest (the engine failed on this very request).
package httpengine

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// ErrInvalid is returned (wrapped) for a request this package cannot send
// (no path, or a body that is not a JSON object) and by Generate for a 4xx
// answer. It is engine.ErrInvalid, named here for callers of this package.
var ErrInvalid = engine.ErrInvalid

// StatusError is an engine response that was not relayed: its status and
// the start of its body, for logs.
type StatusError struct {
	Status  int
	Message string
}

func (e *StatusError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("engine answered %d %s", e.Status, http.StatusText(e.Status))
	}
	return fmt.Sprintf("engine answered %d %s: %s", e.Status, http.StatusText(e.Status), e.Message)
}

// Unwrap returns what callers branch on: engine.ErrUnavailable for the
// statuses by which an engine refuses work it could do elsewhere or later
// (429, 502, 503, 504); engine.ErrUnknownModel for 404 (vLLM's and
// SGLang's answer for a model they do not serve); engine.ErrTooLarge for
// 413; engine.ErrInvalid for
// the other 4xx, the request's own fault; nil for the rest (500: the
// engine failed on this very request).
func (e *StatusError) Unwrap() error {
	switch s := e.Status; {
	case s == http.StatusTooManyRequests, s == http.StatusBadGateway,
		s == http.StatusServiceUnavailable, s == http.StatusGatewayTimeout:
		return engine.ErrUnavailable
	case s == http.StatusNotFound:
		return engine.ErrUnknownModel
	case s == http.StatusRequestEntityTooLarge:
		return engine.ErrTooLarge
	case s/100 == 4:
		return engine.ErrInvalid
	}
	return nil
}

// maxErrorBody bounds how much of a refused response's body StatusError keeps.
const maxErrorBody = 1 << 10

// Option configures New.
type Option func(*Client)

// WithHTTPClient replaces the tuned default client (tests, custom TLS).
func WithHTTPClient(hc *http.Client) Option {
	return func(c *Client) { c.hc = hc }
}

// WithTLS reaches an https engine with cfg (tlsconf.Client): its
// certificate verified against cfg's roots (a private CA) and, for an
// engine that requires one, cfg's client certificate presented. Without
// it the system roots verify. It applies to every call: requests, health
// checks, the model list, LoRA loads.
func WithTLS(cfg *tls.Config) Option {
	return func(c *Client) { c.tls = cfg }
}

// WithResponseHeaderTimeout bounds the wait for the engine's response
// headers on the default transport. The default, 0, waits as long as the
// request's context allows: a non-streamed completion sends its headers
// only when generation ends.
func WithResponseHeaderTimeout(d time.Duration) Option {
	return func(c *Client) { c.headerTimeout = d }
}

// WithAPIKey sends "Authorization: Bearer key" with every request (vLLM's
// and llama-server's --api-key).
func WithAPIKey(key string) Option {
	return func(c *Client) { c.apiKey = key }
}

// Client drives one OpenAI-compatible engine. Its methods are safe for
// concurrent use.
type Client struct {
	base          string // scheme://host[/prefix], no trailing slash
	hc            *http.Client
	rt            http.RoundTripper // hc's own transport, called directly: no redirects to follow
	h1            *h1Transport      // rt when it is the default one
	target        *h1Target         // the engine as h1.post reaches it; nil: through rt or hc
	headerTimeout time.Duration
	tls           *tls.Config
	apiKey        string
	// protocol is the engine's disaggregation protocol; bootstrapHost and
	// bootstrapPort its bootstrap server's address (Bootstrap).
	protocol      Protocol
	bootstrapHost string
	bootstrapPort int
	// dpRank is the HeaderDPRank of every request, "" for none.
	dpRank string
}

// New returns a client of the engine at baseURL (for instance
// "http://10.0.0.7:8000"); request paths such as "/v1/chat/completions"
// are appended to it.
func New(baseURL string, opts ...Option) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil {
		return nil, fmt.Errorf("engine url %q: %w", baseURL, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("engine url %q: scheme must be http or https", baseURL)
	}
	if u.Host == "" {
		return nil, fmt.Errorf("engine url %q: no host", baseURL)
	}
	if u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return nil, fmt.Errorf("engine url %q: must not have a query, fragment or user info", baseURL)
	}
	c := &Client{base: strings.TrimRight(u.String(), "/")}
	for _, opt := range opts {
		opt(c)
	}
	c.setBootstrapDefaults(u)
	if c.hc == nil {
		tr := newTransport(c.headerTimeout)
		tr.TLSClientConfig = c.tls
		c.h1 = newH1Transport(c.headerTimeout, tr)
		c.rt = c.h1
		c.hc = &http.Client{Transport: c.rt}
		c.target = newH1Target(u, c.apiKey, c.dpRank)
	}
	return c, nil
}

// newTransport returns a transport for many long, concurrent streams to one
// host. It has no overall timeout: deadlines come from each request's
// context. It ignores HTTP_PROXY: engines sit on the cluster network.
func newTransport(headerTimeout time.Duration) *http.Transport {
	return &http.Transport{
		DialContext: (&net.Dialer{
			Timeout:   5 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		// One connection per concurrent HTTP/1.1 stream; keep as many idle
		// as a busy engine runs sequences, so bursts do not reconnect.
		MaxIdleConns:          0, // no overall limit
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
		ResponseHeaderTimeout: headerTimeout,
		// Compressed event streams would be buffered; relay bytes as sent.
		DisableCompression: true,
	}
}

// Check reports the engine's health: GET /health answering 200. Anything
// else is an error wrapping engine.ErrUnavailable (or ctx's error).
func (c *Client) Check(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/health", nil)
	if err != nil {
		return fmt.Errorf("health check: %w", err)
	}
	c.setAuth(req)
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("health check: %w", transportError(ctx, err))
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("health check: %w: status %d", engine.ErrUnavailable, resp.StatusCode)
	}
	return nil
}

// Describe lists the models the engine serves, from its /v1/models (the
// OpenAI model list vLLM, SGLang and llama-server all answer); entries
// with a parent are LoRA adapters (vLLM's). An engine without that route
// (404) serves any model. Role is always "both".
func (c *Client) Describe(ctx context.Context) (engine.Description, error) {
	d := engine.Description{Role: "both"}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/v1/models", nil)
	if err != nil {
		return d, fmt.Errorf("listing models: %w", err)
	}
	c.setAuth(req)
	resp, err := c.hc.Do(req)
	if err != nil {
		return d, fmt.Errorf("listing models: %w", transportError(ctx, err))
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return d, nil
	case resp.StatusCode != http.StatusOK:
		return d, fmt.Errorf("listing models: %w: status %d", engine.ErrUnavailable, resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID     string `json:"id"`
			Parent string `json:"parent"` // vLLM's: a LoRA adapter's base model
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxModelList)).Decode(&list); err != nil {
		return d, fmt.Errorf("listing models: %w: %w", engine.ErrUnavailable, err)
	}
	for _, m := range list.Data {
		if m.ID != "" && !slices.Contains(d.Models, m.ID) {
			d.Models = append(d.Models, m.ID)
			if m.Parent != "" && m.Parent != m.ID {
				d.Adapters = append(d.Adapters, m.ID)
			}
		}
	}
	return d, nil
}

// maxModelList bounds the /v1/models answer read.
const maxModelList = 4 << 20

// Transport returns the round tripper the client's calls go over, for
// routes of an engine this package does not know.
func (c *Client) Transport() http.RoundTripper {
	if c.hc.Transport == nil {
		return http.DefaultTransport
	}
	return c.hc.Transport
}

// Close releases idle connections. It is idempotent; calls in flight go on.
func (c *Client) Close() error {
	c.hc.CloseIdleConnections()
	return nil
}

// post sends body to path as JSON and returns the engine's response, or an
// error when none came: ErrUnavailable when the engine cannot be reached,
// ctx's error when ctx ended first.
func (c *Client) post(ctx context.Context, r *engine.Request, body []byte) (*answer, error) {
	if !strings.HasPrefix(r.Path, "/") {
		return nil, fmt.Errorf("%w: path %q", ErrInvalid, r.Path)
	}
	if c.target != nil {
		if !validTarget(r.Path) {
			return nil, fmt.Errorf("%w: path %q", ErrInvalid, r.Path)
		}
		a, err := c.h1.post(ctx, c.target, r.Path, r.ID, body)
		if err != nil {
			return nil, transportError(ctx, err)
		}
		return a, nil
	}
	// A *bytes.Reader body also lets the transport replay it (GetBody) on a
	// stale pooled connection.
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+r.Path, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if r.ID != "" {
		req.Header.Set("X-Request-Id", r.ID)
	}
	if c.dpRank != "" {
		req.Header.Set(HeaderDPRank, c.dpRank)
	}
	c.setAuth(req)
	var resp *http.Response
	if c.rt != nil {
		// An engine's API answers where it is asked: its own transport
		// is called without http.Client's copies of the request for
		// redirects.
		resp, err = c.rt.RoundTrip(req)
	} else {
		resp, err = c.hc.Do(req)
	}
	if err != nil {
		return nil, transportError(ctx, err)
	}
	return fromResponse(resp), nil
}

func (c *Client) setAuth(req *http.Request) {
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
}

// transportError maps an error of http.Client.Do: ctx's own error if ctx
// ended, otherwise the engine could not be reached.
func transportError(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return fmt.Errorf("%w: %w", ctxErr, err)
	}
	return fmt.Errorf("%w: %w", engine.ErrUnavailable, err)
}

// refused reports whether resp must not be relayed, and if so consumes it
// into a *StatusError.
func refused(resp *answer) *StatusError {
	s := resp.StatusCode
	if s/100 == 2 || (s/100 == 4 && s != http.StatusTooManyRequests) {
		return nil
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	return &StatusError{Status: s, Message: strings.TrimSpace(string(msg))}
}
