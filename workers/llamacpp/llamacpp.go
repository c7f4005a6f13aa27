// Package llamacpp drives llama.cpp's llama-server as a baton worker
// (kind llamacpp): its OpenAI API through workers/httpengine, with
// cache_prompt set on every request, and its load and prompt-cache
// capacity, read from /metrics (or /slots) and /props.
//
// llama-server publishes no KV cache events: it keeps one prompt per slot
// (--parallel; more with --cache-ram), a request taking the slot whose
// prompt it shares most of. The scheduler learns what each server holds
// from its own routing, bounded by the slots this package reads, and from
// the cached tokens each response reports (its timings' cache_n).
package llamacpp

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
)

// Client is the scheduler's client of one llama-server: an
// httpengine.Client whose requests ask the server to reuse its cached
// prompt (cache_prompt), which servers before late 2024 do not by default.
type Client struct {
	*httpengine.Client
	base string       // for the routes httpengine does not know
	hc   *http.Client // for them
	lora loraState    // lora.go
}

// New returns a client of the llama-server at baseURL (as
// http://10.0.0.7:8080).
func New(baseURL string, opts ...httpengine.Option) (*Client, error) {
	c, err := httpengine.New(baseURL, opts...)
	if err != nil {
		return nil, err
	}
	// The same transport, so an https server is verified as httpengine's
	// calls verify it (httpengine.WithTLS).
	hc := &http.Client{Transport: c.Transport(), Timeout: 30 * time.Second}
	return &Client{Client: c, base: strings.TrimRight(baseURL, "/"), hc: hc}, nil
}

// Close releases the client's connections. It is idempotent.
func (c *Client) Close() error {
	c.hc.CloseIdleConnections()
	return c.Client.Close()
}

// Proxy relays req as httpengine.Client.Proxy does, with cache_prompt
// set to true unless the client set it, and the LoRA adapter it names
// applied, every other the server holds at scale 0 (lora.go). A request
// for an adapter the server does not hold is refused
// (engine.ErrUnknownModel), and any request while the server's adapters
// cannot be read (engine.ErrUnavailable), before anything is written.
func (c *Client) Proxy(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func()) (engine.ProxyResult, error) {
	if req != nil {
		r := *req
		held, err := c.heldLoRA(ctx)
		if err != nil {
			return engine.ProxyResult{}, fmt.Errorf("proxy: %w", err)
		}
		body, ok := c.withLoRA(req.Body, req.Model, held)
		if !ok {
			return engine.ProxyResult{}, fmt.Errorf("llama-server does not hold the adapter %q: %w", req.Model, engine.ErrUnknownModel)
		}
		r.Body = WithCachePrompt(body)
		req = &r
	}
	return c.Client.Proxy(ctx, req, w, onFirstToken)
}

// cachePromptKey is the request field llama-server reads.
var cachePromptKey = []byte(`"cache_prompt"`)

// WithCachePrompt returns body, a JSON object, with "cache_prompt": true
// added unless it has the key already (a quoted key cannot occur inside a
// JSON string, whose quotes are escaped). A body that is not an object is
// returned as it is, for the engine to refuse.
func WithCachePrompt(body []byte) []byte {
	i := bytes.IndexFunc(body, func(r rune) bool { return r != ' ' && r != '\t' && r != '\n' && r != '\r' })
	if i < 0 || body[i] != '{' || bytes.Contains(body, cachePromptKey) {
		return body
	}
	rest := bytes.TrimLeft(body[i+1:], " \t\r\n")
	sep := ","
	if len(rest) > 0 && rest[0] == '}' {
		sep = ""
	}
	out := make([]byte, 0, len(body)+len(cachePromptKey)+8)
	out = append(out, body[:i+1]...)
	out = append(out, cachePromptKey...)
	out = append(out, ":true"...)
	out = append(out, sep...)
	return append(out, body[i+1:]...)
}

var (
	_ engine.Proxier   = (*Client)(nil)
	_ engine.Describer = (*Client)(nil)
)

// errStatus is an answer other than 200 from one of the server's
// endpoints.
func errStatus(url string, status int) error {
	return fmt.Errorf("GET %s: status %d", url, status)
}
