package frontend

import (
	"bytes"
	"container/list"
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"golang.org/x/sync/singleflight"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// Tokenizer turns a request's prompt into the token ids its engine will
// compute, so that the request's block keys are those of the blocks the
// engine's KV events report.
//
// The front end calls Tokenize from the request's goroutine, before
// routing, with a ctx bounded by TokenKeys.Timeout; Tokenize may block
// until ctx ends. Any error makes the front end key the request by its
// text: a request never fails for its tokens. No tokens and no error means
// the request cannot be tokenized this way (keyed by text, not counted as
// a failure). The front end never modifies the returned slice, and may
// keep it.
type Tokenizer interface {
	Tokenize(ctx context.Context, req *engine.Request) ([]uint32, error)
}

// Defaults of TokenKeys.
const (
	DefaultTokenizeTimeout = 250 * time.Millisecond
	DefaultCacheTokens     = 1 << 22
)

// TokenKeys has the front end key requests by an engine's tokens (see
// WithTokenKeys).
type TokenKeys struct {
	// Tokenizer gives a request's tokens. Required.
	Tokenizer Tokenizer
	// BlockSize returns the engine's tokens per KV block; it is read for
	// each request, as the engine's may be learned after the start.
	// Required.
	BlockSize func() int
	// Model returns the model that salts the engine's keys, as the
	// watcher's watch.Translator is configured. A request for another
	// model is taken as for that LoRA adapter of it. Required.
	Model func() string
	// Timeout bounds one tokenization. Default 250ms; the cache makes a
	// repeated prompt cost no call.
	Timeout time.Duration
	// CacheTokens bounds the tokens the cache keeps, least recently used
	// dropped first. Default 4Mi tokens (16 MiB); -1: no cache.
	CacheTokens int
}

// WithTokenKeys has the front end key requests by tokens rather than text,
// when its strategies route on keys: for fleets of vLLM or SGLang
// workers, whose KV events are keyed by their tokens.
func WithTokenKeys(tk TokenKeys) Option {
	return func(s *Server) { s.tokenKeys = &tk }
}

// Outcomes of a tokenization, in baton_tokenize_total.
const (
	tokHit         = "hit"         // the cache had the tokens
	tokMiss        = "miss"        // the tokenizer gave them
	tokShared      = "shared"      // a call for the same prompt in flight gave them
	tokFailed      = "failed"      // it failed: text keys
	tokUnsupported = "unsupported" // the request cannot be tokenized: text keys
)

// tokenizer computes requests' keys from their tokens.
type tokenizer struct {
	cfg     TokenKeys
	cache   *tokenCache // nil: none
	metrics *metrics.Metrics
	log     *slog.Logger
	failing atomic.Bool // the last tokenizer call failed
	// calls merges concurrent misses of one prompt into one call, by the
	// prompt's hash.
	calls singleflight.Group
}

func newTokenizer(cfg TokenKeys, m *metrics.Metrics, log *slog.Logger) *tokenizer {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTokenizeTimeout
	}
	if cfg.CacheTokens == 0 {
		cfg.CacheTokens = DefaultCacheTokens
	}
	t := &tokenizer{cfg: cfg, metrics: m, log: log}
	if cfg.CacheTokens > 0 {
		t.cache = newTokenCache(cfg.CacheTokens)
	}
	return t
}

// keys sets rreq.Keys and rreq.Tokens from req's tokens and reports
// whether it could; when not, the caller keys req by its text.
func (t *tokenizer) keys(ctx context.Context, req *engine.Request, rreq *routing.Request) bool {
	start := time.Now()
	toks, outcome := t.tokens(ctx, req)
	t.metrics.Tokenize.WithLabelValues(outcome).Inc()
	t.metrics.TokenizeDuration.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	if toks == nil {
		return false
	}
	bs := t.cfg.BlockSize()
	model, lora := t.cfg.Model(), ""
	if req.Model != model {
		lora = req.Model
	}
	seed := blockkey.TokenSeed(blockkey.Salt(model, lora, cacheSalt(req.Body)))
	rreq.Keys = blockkey.AppendTokens(make([]uint64, 0, len(toks)/max(bs, 1)), seed, toks, bs)
	rreq.Tokens = len(toks)
	return true
}

// tokens returns req's tokens, from the cache or the tokenizer, and the
// outcome; nil tokens when there are none to key by.
func (t *tokenizer) tokens(ctx context.Context, req *engine.Request) ([]uint32, string) {
	h := promptHash(req)
	if t.cache != nil {
		if toks, ok := t.cache.get(h); ok {
			return toks, tokHit
		}
	}
	// A burst of one prompt (siblings of a new document) asks the engine
	// once. The call outlives a caller that goes away (its timeout still
	// bounds it): the others wait on it.
	v, err, shared := t.calls.Do(strconv.FormatUint(h, 16), func() (any, error) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.cfg.Timeout)
		defer cancel()
		return t.cfg.Tokenizer.Tokenize(ctx, req)
	})
	toks, _ := v.([]uint32)
	if err != nil {
		if !t.failing.Swap(true) {
			t.log.Warn("tokenization failed; keying requests by their text until it works", "err", err)
		}
		return nil, tokFailed
	}
	if t.failing.Swap(false) {
		t.log.Info("tokenization works again; keying requests by their tokens")
	}
	if len(toks) == 0 {
		return nil, tokUnsupported
	}
	if shared {
		return toks, tokShared
	}
	if t.cache != nil {
		t.cache.add(h, toks)
	}
	return toks, tokMiss
}

// promptHash identifies a prompt for the cache: its model, route and
// routing text (a chat's messages by role and text, however the JSON was
// laid out). Tools and non-text parts are not in it: two requests that
// differ only there share cached tokens, a small routing error.
func promptHash(req *engine.Request) uint64 {
	var d xxhash.Digest
	d.Reset()
	d.WriteString(req.Model)
	d.Write([]byte{0})
	d.WriteString(req.Path)
	d.Write([]byte{0})
	d.WriteString(req.Prompt)
	return d.Sum64()
}

// cacheSalt returns the request's cache_salt, vLLM's and SGLang's tenant
// salt, which their events carry and so must salt the request's keys.
func cacheSalt(body []byte) string {
	if !bytes.Contains(body, []byte(`"cache_salt"`)) {
		return ""
	}
	var v struct {
		CacheSalt string `json:"cache_salt"`
	}
	_ = json.Unmarshal(body, &v) // the body was parsed already
	return v.CacheSalt
}

// withCacheSalt returns body, a JSON object, with its cache_salt set to
// tenant: where it has none, or always when force (a tenant bound to the
// caller's API key, which must not read another tenant's cache by naming
// its salt). body is returned as it is when it is not an object.
func withCacheSalt(body []byte, tenant string, force bool) []byte {
	if !force && cacheSalt(body) != "" {
		return body
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil || m == nil {
		return body
	}
	salt, err := json.Marshal(tenant)
	if err != nil {
		return body
	}
	m["cache_salt"] = salt
	out, err := json.Marshal(m)
	if err != nil {
		return body
	}
	return out
}

// tokenCache is an LRU of prompts' tokens, bounded by their total count.
type tokenCache struct {
	max int

	mu   sync.Mutex
	ll   list.List // of *tokenEntry, most recent first
	m    map[uint64]*list.Element
	size int // tokens held
}

type tokenEntry struct {
	key  uint64
	toks []uint32
}

func newTokenCache(maxTokens int) *tokenCache {
	return &tokenCache{max: maxTokens, m: make(map[uint64]*list.Element)}
}

func (c *tokenCache) get(key uint64) ([]uint32, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[key]
	if !ok {
		return nil, false
	}
	c.ll.MoveToFront(e)
	return e.Value.(*tokenEntry).toks, true
}

func (c *tokenCache) add(key uint64, toks []uint32) {
	if len(toks) > c.max {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.m[key]; ok {
		c.ll.MoveToFront(e)
		return
	}
	c.m[key] = c.ll.PushFront(&tokenEntry{key: key, toks: toks})
	c.size += len(toks)
	for c.size > c.max {
		e := c.ll.Back()
		ent := e.Value.(*tokenEntry)
		c.ll.Remove(e)
		delete(c.m, ent.key)
		c.size -= len(ent.toks)
	}
}
