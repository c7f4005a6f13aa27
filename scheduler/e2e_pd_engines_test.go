package scheduler_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/workers/openai/openaitest"
)

// pdEngine is a vLLM or SGLang server in a disaggregated fleet, speaking
// its engine's protocol for its role:
//
//   - vLLM (NixlConnector): a prefill engine takes a request asking for a
//     remote decode, computes one token and answers kv_transfer_params
//     naming its engine and the blocks it holds for the request; a decode
//     engine given kv_transfer_params pulls those blocks (the hub checks
//     they are exactly the ones issued under the same X-Request-Id), or
//     without them prefills itself.
//   - SGLang (bootstrap): prefill and decode engines get the same request
//     with the prefill engine's bootstrap host, port and a room; each
//     waits, in the hub, for its partner to reach the room, so a
//     scheduler that sent them one after the other would stall.
//
// Every engine generates the same text for the same prompt (a word per
// token, from the prompt's tokens), so a disaggregated answer can be
// compared with a colocated one. Its prefix cache has its own block size
// and hash; the usage reports its hits as cached tokens. A vLLM decode
// engine counts the blocks it pulled as cached, as vLLM does. An SGLang
// decode engine reports the prefill engine's count, which came with the
// blocks (SGLang's transfer metadata carries it), or, with oldSGLang, as
// SGLang did before, none; SGLang's usage has prompt_tokens_details null
// unless some tokens were cached (--enable-cache-report).
type pdEngine struct {
	name, kind, role string
	bootstrapPort    int  // an SGLang prefill engine's
	oldSGLang        bool // an SGLang decode engine whose usage reports no cached tokens
	hub              *pdHub
	srv              *httptest.Server

	mu       sync.Mutex
	cache    map[uint64]int // block hash → block id
	requests []pdRequest
	// fail answers this status to every chat completion while set.
	fail int
	// hold keeps a prefill's answer, or a decode's stream after its first
	// token, until the client goes away; canceled counts those that did.
	hold     bool
	canceled int
	// loras are the LoRA adapters the engine holds, loaded through
	// vLLM's /v1/load_lora_adapter; loads counts those calls by adapter.
	// A request for an adapter it does not hold is a violation.
	loras map[string]bool
	loads map[string]int
}

// pdRequest is a chat completion a pdEngine received.
type pdRequest struct {
	id   string // X-Request-Id
	raw  []byte
	body map[string]json.RawMessage
}

// field returns the body's value of key, compacted, or "" if absent.
func (r pdRequest) field(key string) string {
	v, ok := r.body[key]
	if !ok {
		return ""
	}
	var b bytes.Buffer
	if json.Compact(&b, v) != nil {
		return string(v)
	}
	return b.String()
}

// pdHub is what the engines of one test share: the transfer parameters
// vLLM prefill engines issued, SGLang's bootstrap rooms, and the protocol
// violations any engine saw, which fail the test.
type pdHub struct {
	t          testing.TB
	mu         sync.Mutex
	issued     map[string]string // X-Request-Id → kv_transfer_params
	rooms      map[uint64]*pdRoom
	violations []string
}

// pdRoom is an SGLang bootstrap room: each side closes its channel on
// arrival, and the prefill engine kv once it sent the blocks, with
// prefillCached, the prompt tokens it found cached.
type pdRoom struct {
	prefill, decode, kv chan struct{}
	prefillCached       int
	prefillAddr         string // host:port of the prefill engine's bootstrap server
	decodeAddr          string // host:port the decode request named
}

func newPDHub(t testing.TB) *pdHub {
	h := &pdHub{t: t, issued: map[string]string{}, rooms: map[uint64]*pdRoom{}}
	t.Cleanup(func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		for _, v := range h.violations {
			t.Errorf("protocol violation: %s", v)
		}
	})
	return h
}

func (h *pdHub) violate(format string, args ...any) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.violateLocked(format, args...)
}

// violateLocked is violate with h.mu held.
func (h *pdHub) violateLocked(format string, args ...any) {
	h.violations = append(h.violations, fmt.Sprintf(format, args...))
}

// room returns the room, creating it.
func (h *pdHub) room(id uint64) *pdRoom {
	h.mu.Lock()
	defer h.mu.Unlock()
	r := h.rooms[id]
	if r == nil {
		r = &pdRoom{prefill: make(chan struct{}), decode: make(chan struct{}), kv: make(chan struct{})}
		h.rooms[id] = r
	}
	return r
}

// startPDEngine starts an engine of kind (scheduler.KindVLLM or
// KindSGLang) and role, closed when the test ends.
func startPDEngine(t testing.TB, hub *pdHub, name, kind, role string) *pdEngine {
	t.Helper()
	e := &pdEngine{name: name, kind: kind, role: role, hub: hub, cache: map[uint64]int{}, loras: map[string]bool{}, loads: map[string]int{}}
	if kind == scheduler.KindSGLang && role == scheduler.RolePrefill {
		e.bootstrapPort = 9000 + int(xxhash.Sum64String(name)%900) // distinct per name
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /metrics", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		e.mu.Lock()
		defer e.mu.Unlock()
		data := []map[string]any{{"id": model, "object": "model"}}
		for n := range e.loras {
			data = append(data, map[string]any{"id": n, "object": "model", "parent": model})
		}
		openaitest.Models(w, "application/json", data...)
	})
	mux.HandleFunc("POST /v1/load_lora_adapter", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Name string `json:"lora_name"`
			Path string `json:"lora_path"`
		}
		if json.NewDecoder(r.Body).Decode(&req) != nil || req.Name == "" || req.Path == "" {
			http.Error(w, "bad load", http.StatusBadRequest)
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		e.loras[req.Name] = true
		e.loads[req.Name]++
	})
	mux.HandleFunc("POST /v1/unload_lora_adapter", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Name string `json:"lora_name"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		e.mu.Lock()
		defer e.mu.Unlock()
		if !e.loras[req.Name] {
			http.Error(w, "no such adapter", http.StatusNotFound)
			return
		}
		delete(e.loras, req.Name)
	})
	mux.HandleFunc("POST /v1/chat/completions", e.chat)
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

// config is the engine's scheduler worker entry.
func (e *pdEngine) config() scheduler.WorkerConfig {
	wc := scheduler.WorkerConfig{Name: e.name, Kind: e.kind, Address: e.srv.URL, Role: e.role, Models: []string{model},
		EngineConfig: scheduler.EngineConfig{TokenizePath: scheduler.TokenizeNone}}
	if e.bootstrapPort != 0 {
		wc.BootstrapPort = e.bootstrapPort
	}
	return wc
}

// received returns the chat completions received so far.
func (e *pdEngine) received() []pdRequest {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]pdRequest(nil), e.requests...)
}

func (e *pdEngine) set(f func(e *pdEngine)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f(e)
}

func (e *pdEngine) cancels() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.canceled
}

// pdBlock is the engines' KV block size, in tokens.
const pdBlock = 16

// prefix looks tokens up in the engine's prefix cache and stores their
// full blocks: it returns the tokens found cached and the ids of every
// full block.
func (e *pdEngine) prefix(mdl string, tokens []uint32) (cached int, ids []int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	h := xxhash.Sum64String(e.name) // the engine's own seed
	if mdl != model {
		h = xxhash.Sum64String(e.name + "/" + mdl) // an adapter's blocks are its own, as vLLM hashes the LoRA in
	}
	hit := true
	for i := 0; i+pdBlock <= len(tokens); i += pdBlock {
		var b [4 * pdBlock]byte
		for j, tok := range tokens[i : i+pdBlock] {
			binary.LittleEndian.PutUint32(b[4*j:], tok)
		}
		h = xxhash.Sum64(append(binary.LittleEndian.AppendUint64(nil, h), b[:]...))
		id, ok := e.cache[h]
		if !ok {
			id = len(e.cache) + 1
			e.cache[h] = id
			hit = false
		}
		if hit {
			cached += pdBlock
		}
		ids = append(ids, id)
	}
	return cached, ids
}

// pdWords is the text every engine generates for a prompt: n words, each
// a function of the prompt's tokens and its position.
func pdWords(tokens []uint32, n int) []string {
	var seed uint64
	for _, t := range tokens {
		seed = seed*31 + uint64(t)
	}
	out := make([]string, n)
	for i := range out {
		out[i] = "w" + strconv.FormatUint((seed+uint64(i)*2654435761)%997, 10) + " "
	}
	return out
}

// nixlPrefillParams is what a vLLM prefill request must carry.
const nixlPrefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

func (e *pdEngine) chat(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	req := pdRequest{id: r.Header.Get("X-Request-Id"), raw: raw}
	var body struct {
		Model               string               `json:"model"`
		Messages            []openaitest.Message `json:"messages"`
		Stream              bool                 `json:"stream"`
		MaxTokens           *int                 `json:"max_tokens"`
		MaxCompletionTokens *int                 `json:"max_completion_tokens"`
		StreamOptions       json.RawMessage      `json:"stream_options"`
		KVTransferParams    json.RawMessage      `json:"kv_transfer_params"`
		BootstrapHost       string               `json:"bootstrap_host"`
		BootstrapPort       int                  `json:"bootstrap_port"`
		BootstrapRoom       *uint64              `json:"bootstrap_room"`
	}
	if json.Unmarshal(raw, &req.body) != nil || json.Unmarshal(raw, &body) != nil {
		http.Error(w, `{"error":{"message":"bad json"}}`, http.StatusBadRequest)
		return
	}
	e.mu.Lock()
	e.requests = append(e.requests, req)
	fail, hold := e.fail, e.hold
	unknown := body.Model != model && !e.loras[body.Model]
	e.mu.Unlock()
	if unknown {
		e.hub.violate("%s: request for model %q, which it does not hold", e.name, body.Model)
		http.Error(w, `{"error":{"message":"model not found"}}`, http.StatusNotFound)
		return
	}
	sglangPrefill := e.kind == scheduler.KindSGLang && e.role == scheduler.RolePrefill
	if fail != 0 && !sglangPrefill {
		http.Error(w, `{"error":{"message":"injected failure"}}`, fail)
		return
	}
	tokens := fakeTokens(body.Messages)
	n := 16
	if body.MaxTokens != nil {
		n = *body.MaxTokens
	}
	includeUsage := strings.Contains(string(body.StreamOptions), `"include_usage":true`)
	ans := pdAnswer{stream: body.Stream, usage: includeUsage, prompt: len(tokens), sglang: e.kind == scheduler.KindSGLang}
	ctx := r.Context()
	waitCancel := func() bool {
		select {
		case <-ctx.Done():
			e.set(func(e *pdEngine) { e.canceled++ })
			return true
		case <-time.After(20 * time.Second):
			return false
		}
	}
	hasParams := len(body.KVTransferParams) > 0 && string(body.KVTransferParams) != "null"
	switch {
	case e.kind == scheduler.KindVLLM && e.role == scheduler.RolePrefill:
		if got := req.field("kv_transfer_params"); got != nixlPrefillParams {
			e.hub.violate("%s: prefill kv_transfer_params %s, want %s", e.name, got, nixlPrefillParams)
		}
		if body.Stream || body.StreamOptions != nil || body.MaxTokens == nil || *body.MaxTokens != 1 ||
			body.MaxCompletionTokens != nil && *body.MaxCompletionTokens != 1 || req.id == "" {
			e.hub.violate("%s: prefill request %s with X-Request-Id %q: want stream false, max_tokens 1, no stream_options, an id", e.name, raw, req.id)
		}
		cached, ids := e.prefix(body.Model, tokens)
		idsJSON, _ := json.Marshal(ids)
		// Newer vLLM versions add fields: the scheduler must not care.
		params := fmt.Sprintf(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":%s,"remote_engine_id":"%s-engine","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"remote_request_id":%q,"x_future":{"a":[1,"<&>"]}}`,
			idsJSON, e.name, req.id)
		e.hub.mu.Lock()
		e.hub.issued[req.id] = params
		e.hub.mu.Unlock()
		if hold && waitCancel() {
			return
		}
		ans.stream, ans.cached, ans.extra = false, cached, params
		ans.write(w, pdWords(tokens, 1), nil)
	case e.kind == scheduler.KindVLLM && e.role == scheduler.RoleDecode && hasParams:
		e.hub.mu.Lock()
		issued, ok := e.hub.issued[req.id]
		e.hub.mu.Unlock()
		if !ok || req.field("kv_transfer_params") != issued {
			e.hub.violate("%s: decode request %q carries kv_transfer_params %s; its prefill issued %q", e.name, req.id, req.field("kv_transfer_params"), issued)
			http.Error(w, `{"error":{"message":"no such remote blocks"}}`, http.StatusBadRequest)
			return
		}
		_, ids := e.prefix(body.Model, tokens)
		ans.cached = len(ids) * pdBlock // pulled blocks count as cached
		ans.write(w, pdWords(tokens, n), holdAfterFirst(hold, waitCancel))
	case e.kind == scheduler.KindSGLang && e.role != scheduler.RoleBoth:
		if body.BootstrapRoom == nil || body.BootstrapHost == "" || body.BootstrapPort == 0 {
			e.hub.violate("%s: request without bootstrap fields: %s", e.name, raw)
			http.Error(w, `{"error":{"message":"no bootstrap"}}`, http.StatusBadRequest)
			return
		}
		room := e.hub.room(*body.BootstrapRoom)
		addr := fmt.Sprintf("%s:%d", body.BootstrapHost, body.BootstrapPort)
		// The decode engine waits for the blocks, the prefill engine for
		// its partner before it sends them.
		mine, theirs := room.decode, room.kv
		e.hub.mu.Lock()
		if e.role == scheduler.RolePrefill {
			mine, theirs = room.prefill, room.decode
			if want := fmt.Sprintf("127.0.0.1:%d", e.bootstrapPort); addr != want {
				e.hub.violateLocked("%s: bootstrap address %s, want its own %s", e.name, addr, want)
			}
			room.prefillAddr = addr
		} else {
			room.decodeAddr = addr
		}
		select {
		case <-mine:
			e.hub.violateLocked("%s: room %d used twice", e.name, *body.BootstrapRoom)
		default:
			close(mine)
		}
		e.hub.mu.Unlock()
		select {
		case <-theirs:
		case <-ctx.Done():
			e.set(func(e *pdEngine) { e.canceled++ })
			return
		case <-time.After(20 * time.Second):
			e.hub.violate("%s: room %d: the partner never came", e.name, *body.BootstrapRoom)
			http.Error(w, `{"error":{"message":"bootstrap timeout"}}`, http.StatusInternalServerError)
			return
		}
		if e.role == scheduler.RolePrefill {
			if fail != 0 { // the transfer failed
				http.Error(w, `{"error":{"message":"injected failure"}}`, fail)
				return
			}
			ans.cached, _ = e.prefix(body.Model, tokens)
			e.hub.mu.Lock()
			select {
			case <-room.kv: // reported as the room's reuse
			default:
				room.prefillCached = ans.cached
				close(room.kv)
			}
			e.hub.mu.Unlock()
			ans.write(w, pdWords(tokens, 1), holdAfterFirst(hold, waitCancel))
			return
		}
		e.hub.mu.Lock()
		if room.prefillAddr != room.decodeAddr {
			e.hub.violateLocked("%s: room %d: decode named %s, prefill serves %s", e.name, *body.BootstrapRoom, room.decodeAddr, room.prefillAddr)
		}
		if !e.oldSGLang {
			ans.cached = room.prefillCached
		}
		e.hub.mu.Unlock()
		ans.write(w, pdWords(tokens, n), holdAfterFirst(hold, waitCancel))
	default: // colocated, or a vLLM decode engine prefilling itself
		ans.cached, _ = e.prefix(body.Model, tokens)
		ans.write(w, pdWords(tokens, n), holdAfterFirst(hold, waitCancel))
	}
}

// holdAfterFirst returns what a stream does after its first token: wait
// for the client to go away when hold, else nothing.
func holdAfterFirst(hold bool, waitCancel func() bool) func() bool {
	if !hold {
		return nil
	}
	return waitCancel
}

// pdAnswer is a chat completion answer.
type pdAnswer struct {
	stream, usage  bool
	sglang         bool // prompt_tokens_details null without cached tokens
	prompt, cached int
	extra          string // kv_transfer_params, if any
}

// write answers words, streamed or whole; afterFirst, if set, runs after
// the first token is flushed and ends the answer if it returns true.
func (a pdAnswer) write(w http.ResponseWriter, words []string, afterFirst func() bool) {
	var details any = openaitest.Cached(a.cached)
	if a.sglang && a.cached == 0 {
		details = nil
	}
	usage := openaitest.Usage(a.prompt, len(words), details, true)
	c := openaitest.Completion{ID: "chatcmpl-pd", Model: model, Created: 1, Chat: true}
	if !a.stream {
		var extra map[string]any
		if a.extra != "" {
			extra = map[string]any{"kv_transfer_params": json.RawMessage(a.extra)}
		}
		openaitest.WriteJSON(w, http.StatusOK, "application/json", c.Body(c.Choice(strings.Join(words, ""), "length", nil), usage, extra))
		return
	}
	st := c.Stream(w, "text/event-stream")
	st.Send(st.Chunk(map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil}, nil))
	for i, word := range words {
		st.Token(word, nil, nil)
		if i == 0 && afterFirst != nil && afterFirst() {
			return
		}
	}
	st.Send(st.Chunk(map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "length"}, nil))
	if a.usage {
		st.Usage(usage)
	}
	st.Done()
}
