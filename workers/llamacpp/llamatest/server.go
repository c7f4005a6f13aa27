// Package llamatest is a fake llama.cpp llama-server for tests. It speaks
// the server's HTTP API (chat and text completions, streamed or not,
// /health, /props, /slots, /metrics, /v1/models) and keeps its prompt
// cache as the server does, one prompt per slot: a request takes the idle
// slot whose prompt it shares most of (more than Config.Similarity of its
// own), else the one used least lately, reuses the tokens they share if
// it asked to (cache_prompt), and leaves its own prompt there. It reports
// what it reused in timings.cache_n and, like newer servers, in usage.
// Its "tokens" are 4 characters of the prompt; it generates no real text,
// but says which LoRA adapters it applied: each generated token is "ok "
// from the base model alone, else the applied adapters' file names
// (without extension) joined by "+" (as "sql ").
package llamatest

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/openai/openaitest"
)

// Config describes a fake server. The zero value is one slot of 8,192
// tokens, with /metrics, serving "model".
type Config struct {
	// Slots is the server's --parallel; 0 means 1.
	Slots int
	// CtxPerSlot is the tokens a slot holds; 0 means 8,192.
	CtxPerSlot int
	// NoMetrics answers /metrics 501, as a server started without
	// --metrics does.
	NoMetrics bool
	// Model is the model it serves; "" means "model".
	Model string
	// Similarity is the server's --slot-prompt-similarity; 0 means its
	// default, 0.5.
	Similarity float64
	// CachePromptDefault is what a request without cache_prompt gets:
	// false as in servers before late 2024.
	CachePromptDefault bool
	// NoUsageDetails leaves prompt_tokens_details out of usage, as
	// servers before 2025 did: only timings tell the cached tokens.
	NoUsageDetails bool
	// PrefillPerToken is the time each prompt token not reused takes to
	// compute, and TokenTime each generated token: 0 answers at once.
	PrefillPerToken, TokenTime time.Duration
	// LoRA are the paths of the LoRA adapters loaded at start (--lora),
	// whose ids are their positions: GET /lora-adapters lists them, at
	// scale 1 (0 with LoRAInitWithoutApply).
	//
	// A request's lora field ([{id, scale}]) sets the scales of the
	// adapters it names. As late-2026 servers do, a request whose lora is
	// empty ([]) or absent gets every adapter at scale 1, whatever the
	// global scales (even with --lora-init-without-apply), and an adapter
	// a non-empty lora leaves out keeps scale 1 too (the least forgiving
	// reading; older servers set it to 0): a client that wants the base
	// model alone must name every adapter at scale 0.
	LoRA []string
	// LoRAInitWithoutApply is --lora-init-without-apply: GET
	// /lora-adapters lists every adapter at scale 0.
	LoRAInitWithoutApply bool
}

// Request is what the server did with one completion request.
type Request struct {
	Slot         int
	PromptTokens int
	CachedTokens int
	CachePrompt  bool // the request asked to reuse the slot's cache
	// LoRA is the request's lora field, nil without one.
	LoRA []LoRA
	// Applied are the paths of the adapters the server applied, with a
	// scale above 0, in id order; nil for the base model alone.
	Applied []string
}

// LoRA is an adapter's scale in a request's lora field.
type LoRA struct {
	ID    int     `json:"id"`
	Scale float64 `json:"scale"`
}

// Server is a running fake llama-server.
type Server struct {
	// URL is its base URL, as http://127.0.0.1:port.
	URL string

	cfg Config
	hs  *httptest.Server

	mu       sync.Mutex
	freed    *sync.Cond // a slot became idle
	slots    []slot
	tick     int64
	deferred int
	loading  bool
	requests []Request
	hold     *Hold
}

// Hold holds the next request in its slot until released.
type Hold struct {
	arrived, release chan struct{}
}

// Hold makes the next request wait, holding its slot, until the Hold is
// released.
func (s *Server) Hold() *Hold {
	h := &Hold{arrived: make(chan struct{}), release: make(chan struct{})}
	s.mu.Lock()
	s.hold = h
	s.mu.Unlock()
	return h
}

// Wait returns once the held request has taken its slot.
func (h *Hold) Wait() { <-h.arrived }

// Release lets the held request finish.
func (h *Hold) Release() { close(h.release) }

type slot struct {
	tokens []string
	lora   string // the adapters its tokens were computed with
	busy   bool
	used   int64 // tick of its last request
}

// Start starts a server; the test's cleanup closes it.
func Start(t testing.TB, cfg Config) *Server {
	s := New(cfg)
	t.Cleanup(s.Close)
	return s
}

// New starts a server outside a test (a benchmark's fleet); Close it.
func New(cfg Config) *Server {
	if cfg.Slots <= 0 {
		cfg.Slots = 1
	}
	if cfg.CtxPerSlot <= 0 {
		cfg.CtxPerSlot = 8192
	}
	if cfg.Model == "" {
		cfg.Model = "model"
	}
	if cfg.Similarity == 0 {
		cfg.Similarity = 0.5
	}
	s := &Server{cfg: cfg, slots: make([]slot, cfg.Slots)}
	s.freed = sync.NewCond(&s.mu)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.health)
	mux.HandleFunc("GET /props", s.props)
	mux.HandleFunc("GET /slots", s.slotsJSON)
	mux.HandleFunc("GET /metrics", s.metrics)
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /lora-adapters", s.loraAdapters)
	mux.HandleFunc("POST /v1/chat/completions", s.complete)
	mux.HandleFunc("POST /v1/completions", s.complete)
	s.hs = httptest.NewServer(mux)
	s.URL = s.hs.URL
	return s
}

// Close stops the server.
func (s *Server) Close() { s.hs.Close() }

// Restart empties every slot, as a server that restarted would have
// them.
func (s *Server) Restart() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.slots {
		s.slots[i].tokens = nil
	}
}

// SetLoading makes /health answer 503, as while the server loads its
// model, or 200 again.
func (s *Server) SetLoading(loading bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loading = loading
}

// Requests returns what the server did with each completion request so
// far, in order.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	openaitest.WriteJSON(w, status, "application/json; charset=utf-8", v)
}

func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	loading := s.loading
	s.mu.Unlock()
	if loading {
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{
			"error": map[string]any{"code": 503, "message": "Loading model", "type": "unavailable_error"}})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) props(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"default_generation_settings": map[string]any{"n_ctx": s.cfg.CtxPerSlot, "params": map[string]any{"temperature": 0.8}},
		"total_slots":                 s.cfg.Slots,
		"model_path":                  "models/" + s.cfg.Model + ".gguf",
		"build_info":                  "b0-llamatest",
	})
}

func (s *Server) slotsJSON(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	out := make([]map[string]any, len(s.slots))
	for i, sl := range s.slots {
		out[i] = map[string]any{"id": i, "n_ctx": s.cfg.CtxPerSlot, "is_processing": sl.busy}
	}
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	if s.cfg.NoMetrics {
		writeJSON(w, http.StatusNotImplemented, map[string]any{
			"error": map[string]any{"code": 501, "message": "This server does not support metrics endpoint. Start it with `--metrics`", "type": "not_supported_error"}})
		return
	}
	s.mu.Lock()
	busy := 0
	for _, sl := range s.slots {
		if sl.busy {
			busy++
		}
	}
	deferred := s.deferred
	s.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	fmt.Fprintf(w, "# HELP llamacpp:requests_processing Number of requests processing.\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing %d\n", busy)
	fmt.Fprintf(w, "# HELP llamacpp:requests_deferred Number of requests deferred.\n# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred %d\n", deferred)
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	openaitest.Models(w, "application/json; charset=utf-8", map[string]any{"id": s.cfg.Model, "object": "model", "owned_by": "llamacpp"})
}

// loraAdapters answers GET /lora-adapters: the adapters loaded at start.
func (s *Server) loraAdapters(w http.ResponseWriter, _ *http.Request) {
	out := make([]map[string]any, len(s.cfg.LoRA))
	scale := 1.0
	if s.cfg.LoRAInitWithoutApply {
		scale = 0
	}
	for i, p := range s.cfg.LoRA {
		out[i] = map[string]any{"id": i, "path": p, "scale": scale}
	}
	writeJSON(w, http.StatusOK, out)
}

// completion is what the server reads of a request.
type completion struct {
	Messages      []openaitest.Message `json:"messages"`
	Prompt        json.RawMessage      `json:"prompt"`
	MaxTokens     int                  `json:"max_tokens"`
	Stream        bool                 `json:"stream"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	CachePrompt *bool  `json:"cache_prompt"`
	LoRA        []LoRA `json:"lora"`
}

// promptText renders the request's prompt as the server's chat template
// would, roughly.
func (c *completion) promptText() string {
	if len(c.Messages) == 0 {
		var p string
		json.Unmarshal(c.Prompt, &p)
		return p
	}
	var b strings.Builder
	for _, m := range c.Messages {
		b.WriteString("<|" + m.Role + "|>")
		b.WriteString(m.Text())
	}
	b.WriteString("<|assistant|>")
	return b.String()
}

// tokenize cuts text into tokens of 4 characters.
func tokenize(text string) []string {
	var toks []string
	for len(text) > 0 {
		n := min(4, len(text))
		toks = append(toks, text[:n])
		text = text[n:]
	}
	return toks
}

func commonPrefix(a, b []string) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// acquire takes the slot for prompt as llama-server picks it, waiting
// while every slot is busy, and returns it with the tokens it reuses.
func (s *Server) acquire(prompt []string, cachePrompt bool, lora []LoRA, applied []float64) (int, int) {
	key := loraKey(applied)
	s.mu.Lock()
	defer s.mu.Unlock()
	waited := false
	for {
		best, bestSim, lru := -1, 0.0, -1
		for i, sl := range s.slots {
			if sl.busy {
				continue
			}
			if sim := float64(commonPrefix(sl.tokens, prompt)) / float64(max(len(prompt), 1)); len(sl.tokens) > 0 && sl.lora == key &&
				sim > s.cfg.Similarity && sim > bestSim {
				best, bestSim = i, sim
			}
			if lru < 0 || sl.used < s.slots[lru].used {
				lru = i
			}
		}
		if best < 0 {
			best = lru
		}
		if best >= 0 {
			if waited {
				s.deferred--
			}
			sl := &s.slots[best]
			cached := 0
			if cachePrompt && sl.lora == key {
				// At least one token is evaluated, for its logits; a
				// prompt computed with other adapters is recomputed.
				cached = min(commonPrefix(sl.tokens, prompt), len(prompt)-1)
			}
			s.tick++
			sl.busy, sl.used, sl.tokens, sl.lora = true, s.tick, append([]string(nil), prompt...), key
			s.requests = append(s.requests, Request{Slot: best, PromptTokens: len(prompt), CachedTokens: cached, CachePrompt: cachePrompt,
				LoRA: lora, Applied: s.appliedPaths(applied)})
			return best, cached
		}
		if !waited {
			waited = true
			s.deferred++
		}
		s.freed.Wait()
	}
}

// scales returns the scale of each loaded adapter, by id, for a request
// whose lora field is lora (Config.LoRA says how it is read).
func (s *Server) scales(lora []LoRA) []float64 {
	out := make([]float64, len(s.cfg.LoRA))
	for i := range out {
		out[i] = 1
	}
	for _, l := range lora {
		out[l.ID] = l.Scale
	}
	return out
}

// appliedPaths returns the paths of the adapters scales applies.
func (s *Server) appliedPaths(scales []float64) []string {
	var out []string
	for i, sc := range scales {
		if sc != 0 {
			out = append(out, s.cfg.LoRA[i])
		}
	}
	return out
}

// loraKey names the adapters applied at scales: those above 0.
func loraKey(scales []float64) string {
	var b strings.Builder
	for i, sc := range scales {
		if sc != 0 {
			fmt.Fprintf(&b, "%d:%g,", i, sc)
		}
	}
	return b.String()
}

// tokenText is each generated token: "ok " from the base model alone,
// else the applied adapters' names.
func tokenText(applied []string) string {
	if len(applied) == 0 {
		return "ok "
	}
	names := make([]string, len(applied))
	for i, p := range applied {
		names[i] = strings.TrimSuffix(path.Base(p), path.Ext(p))
	}
	return strings.Join(names, "+") + " "
}

func (s *Server) release(i int) {
	s.mu.Lock()
	s.slots[i].busy = false
	s.mu.Unlock()
	s.freed.Broadcast()
}

func (s *Server) complete(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	var c completion
	if err == nil {
		err = json.Unmarshal(body, &c)
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"code": 400, "message": "bad request: " + err.Error(), "type": "invalid_request_error"}})
		return
	}
	prompt := tokenize(c.promptText())
	if len(prompt) > s.cfg.CtxPerSlot {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"code": 400,
			"message": fmt.Sprintf("the request exceeds the available context size (%d tokens)", s.cfg.CtxPerSlot), "type": "exceed_context_size_error"}})
		return
	}
	cachePrompt := s.cfg.CachePromptDefault
	if c.CachePrompt != nil {
		cachePrompt = *c.CachePrompt
	}
	for _, l := range c.LoRA {
		if l.ID < 0 || l.ID >= len(s.cfg.LoRA) {
			writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"code": 400,
				"message": fmt.Sprintf("invalid adapter id %d", l.ID), "type": "invalid_request_error"}})
			return
		}
	}
	scales := s.scales(c.LoRA)
	i, cached := s.acquire(prompt, cachePrompt, c.LoRA, scales)
	defer s.release(i)
	s.mu.Lock()
	h := s.hold
	s.hold = nil
	s.mu.Unlock()
	if h != nil {
		close(h.arrived)
		<-h.release
	}

	time.Sleep(time.Duration(len(prompt)-cached) * s.cfg.PrefillPerToken)
	n := c.MaxTokens
	if n <= 0 {
		n = 4
	}
	tok := tokenText(s.appliedPaths(scales))
	text := strings.Repeat(tok, n)
	var details any
	if !s.cfg.NoUsageDetails {
		details = openaitest.Cached(cached)
	}
	usage := openaitest.Usage(len(prompt), n, details, false)
	timings := map[string]any{"cache_n": cached, "prompt_n": len(prompt) - cached, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 1.0}
	cmpl := openaitest.Completion{ID: "cmpl-llamatest", Model: s.cfg.Model, Created: time.Now().Unix(), Chat: len(c.Messages) > 0}
	if cmpl.Chat {
		cmpl.ID = "chatcmpl-llamatest"
	}
	if !c.Stream {
		time.Sleep(time.Duration(n) * s.cfg.TokenTime)
		writeJSON(w, http.StatusOK, cmpl.Body(cmpl.Choice(text, "length", nil), usage, map[string]any{"timings": timings}))
		return
	}
	// llama-server's chunks: no role chunk, no finish reason on a token's
	// chunk, then one with the finish reason and the timings.
	st := cmpl.Stream(w, "text/event-stream")
	for range n {
		time.Sleep(s.cfg.TokenTime)
		st.Token(tok, nil, nil)
	}
	last := map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "length"}
	if !cmpl.Chat {
		last = map[string]any{"index": 0, "text": "", "finish_reason": "length"}
	}
	st.Send(st.Chunk(last, map[string]any{"timings": timings}))
	if c.StreamOptions.IncludeUsage {
		st.Usage(usage)
	}
	st.Done()
}
