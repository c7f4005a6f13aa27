// Package vllmtest is a fake vLLM server, for tests and for benchmarks of
// a fleet of them (bench/cmd/fakevllm). It speaks vLLM's HTTP API (chat and
// text completions, streamed or not, /tokenize, /metrics, /health,
// /v1/models) and keeps a prefix cache as vLLM does: full blocks of
// Config.BlockSize tokens of its own tokenizer (Tokenize), under its own
// chained hash salted by the request's cache_salt, at most
// Config.GPUBlocks of them, the least recently used evicted first. It
// publishes BlockStored, BlockRemoved and AllBlocksCleared over ZeroMQ as
// vLLM's --kv-events-config publisher does, with a replay socket, and
// reports in usage.prompt_tokens_details.cached_tokens the tokens its cache
// held.
//
// Time is modelled with workers/engine/cost, over Config.TimeScale: a
// request waits for one of Config.MaxRunning running slots, then for the
// engine's compute to prefill the tokens it did not find cached (one
// prefill at a time), then each token takes a decode step of the running
// batch. Decode steps do not wait for prefills, unlike vLLM's; the text is
// "ok" repeated.
package vllmtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/openai/openaitest"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// Config describes a fake server. The zero value serves Llama-3.1-8B on
// one H100 at real time, with KV events and a replay socket, on free
// loopback ports.
type Config struct {
	// Model is the served model name. Default: the cost model's preset
	// name (llama-3.1-8b).
	Model string
	// Cost is the modelled engine whose prefill and decode times the
	// server sleeps. Default: cost.Config's defaults.
	Cost cost.Config
	// TimeScale runs the modelled clock this many times faster than real
	// time. Default 1.
	TimeScale float64
	// BlockSize is the tokens of a KV block (vLLM's --block-size).
	// Default 16.
	BlockSize int
	// GPUBlocks is the KV cache's capacity in blocks. Default: what the
	// cost model's GPU memory holds.
	GPUBlocks int
	// MaxRunning is the running sequences at most (vLLM's
	// --max-num-seqs); the rest wait. Default 256.
	MaxRunning int
	// MaxModelLen bounds a request's prompt and completion tokens.
	// Default 131,072.
	MaxModelLen int
	// HTTPAddr, EventsAddr and ReplayAddr are where the HTTP server, the
	// event publisher and its replay socket listen. Default: free ports
	// on 127.0.0.1.
	HTTPAddr, EventsAddr, ReplayAddr string
	// Topic is the events' topic. Default "kv-events".
	Topic string
	// Encoding is the events' msgpack layout. Default array-like.
	Encoding kveventstest.Encoding
	// EventsVariant is how the events write what their encoding leaves
	// open (a first block's parent as nil or 0, older field sets, ...), as
	// other publishers do. Default vLLM's.
	EventsVariant kveventstest.Variant
	// NoEvents publishes no KV events; NoReplay keeps no replay socket.
	NoEvents, NoReplay bool
	// NoCachedTokens leaves prompt_tokens_details out of usage, as vLLM
	// without --enable-prompt-tokens-details does.
	NoCachedTokens bool
	// DPRank is the data-parallel rank the server is of a DP engine
	// (NewDP): its batches carry it, as vLLM's publishers stamp theirs.
	DPRank int
	// SGLang has the server speak as SGLang does where it differs from
	// vLLM (see sglang.go): /metrics has SGLang's series, labelled
	// dp_rank; /tokenize takes a prompt only; every event batch carries
	// the rank (attn_dp_rank); and a DP front (NewDP) pins a request to a
	// rank by the X-Data-Parallel-Rank header or the body's
	// routed_dp_rank (data_parallel_rank before SGLang renamed it).
	SGLang bool
	// LoRAModules are the LoRA adapters served from the start, name →
	// path (vLLM's --lora-modules); MaxLoRAs is --max-loras. Either
	// enables LoRA (--enable-lora): /v1/models lists the adapters with
	// their parent, requests may name one, whose blocks its name salts,
	// and /metrics has vllm:lora_requests_info. RuntimeLoRA serves
	// /v1/load_lora_adapter and /v1/unload_lora_adapter, as
	// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True does.
	LoRAModules map[string]string
	MaxLoRAs    int
	RuntimeLoRA bool
	// MetricsQuery is how /metrics answers a query naming the series
	// wanted. Default QueryNames, as vLLM in one API server process.
	MetricsQuery MetricsQuery
}

func (c Config) withDefaults() Config {
	c.Cost = c.Cost.WithDefaults()
	if c.Model == "" {
		c.Model = c.Cost.Model
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.BlockSize == 0 {
		c.BlockSize = 16
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = 256
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = 131072
	}
	if c.Topic == "" {
		c.Topic = "kv-events"
	}
	if c.MaxLoRAs == 0 && (len(c.LoRAModules) > 0 || c.RuntimeLoRA) {
		c.MaxLoRAs = 1 // vLLM's default
	}
	return c
}

// Request is what the server did with one completion request.
type Request struct {
	Path             string // /v1/chat/completions or /v1/completions
	CacheSalt        string
	PromptTokens     int
	CachedTokens     int // tokens found in the prefix cache
	CompletionTokens int
	Stream           bool
}

// Stats counts what the server did.
type Stats struct {
	Requests      int   // completions served
	PromptTokens  int64 // their prompt tokens
	CachedTokens  int64 // of which found cached
	Tokenizes     int   // /tokenize calls answered
	BlocksStored  int64 // blocks in BlockStored events
	BlocksRemoved int64 // blocks in BlockRemoved events
	Clears        int   // AllBlocksCleared events
}

// Server is a running fake vLLM.
type Server struct {
	// URL is its base URL, as http://127.0.0.1:port.
	URL string

	cfg   Config
	eng   cost.Engine
	ln    net.Listener
	hs    *http.Server
	pub   *kveventstest.Publisher
	quit  chan struct{}
	once  sync.Once
	slots chan struct{} // a running sequence's slot
	gpu   chan struct{} // held while prefilling: one prefill at a time

	mu       sync.Mutex
	cache    *cache
	running  int
	waiting  int
	context  int // tokens of the running sequences
	ts       float64
	stats    Stats
	requests []Request
	// loras are the adapters served, name → path; loraRunning and
	// loraWaiting count their requests running and waiting.
	loras                    map[string]string
	loraRunning, loraWaiting map[string]int

	// rest is the page's other families as last written, for restReq
	// requests: they change with the requests served alone, and an idle
	// fleet of a thousand fakes scraped four thousand times a second
	// would otherwise spend cores formatting the same 45 KB.
	// restNames and restOnly are rest restricted to the series a scrape
	// named last (restrictPage), kept as rest is.
	restMu    sync.Mutex
	rest      []byte
	restReq   int64
	restNames string
	restOnly  []byte
}

// New starts a server. Close it.
func New(cfg Config) (*Server, error) {
	cfg = cfg.withDefaults()
	eng, err := cfg.Cost.Engine()
	if err != nil {
		return nil, fmt.Errorf("cost: %w", err)
	}
	if err := eng.Validate(); err != nil && cfg.GPUBlocks == 0 {
		return nil, fmt.Errorf("cost: %w", err)
	}
	if cfg.GPUBlocks == 0 {
		cfg.GPUBlocks = int(eng.BlockCapacity(cfg.BlockSize))
	}
	switch {
	case !(cfg.TimeScale > 0):
		return nil, fmt.Errorf("time scale: %v must be positive", cfg.TimeScale)
	case cfg.BlockSize < 1:
		return nil, fmt.Errorf("block size: %d is below 1", cfg.BlockSize)
	case cfg.GPUBlocks < 1:
		return nil, fmt.Errorf("gpu blocks: %d is below 1", cfg.GPUBlocks)
	case cfg.MaxRunning < 1:
		return nil, fmt.Errorf("max running: %d is below 1", cfg.MaxRunning)
	}
	s := &Server{cfg: cfg, eng: eng, quit: make(chan struct{}),
		slots: make(chan struct{}, cfg.MaxRunning), gpu: make(chan struct{}, 1),
		cache: newCache(cfg.BlockSize, cfg.GPUBlocks),
		loras: make(map[string]string), loraRunning: make(map[string]int), loraWaiting: make(map[string]int)}
	for n, p := range cfg.LoRAModules {
		s.loras[n] = p
	}
	if !cfg.NoEvents {
		pc := kveventstest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Topic: cfg.Topic,
			Encoding: cfg.Encoding, Variant: cfg.EventsVariant, Replay: !cfg.NoReplay,
			// vLLM puts the topic in replies from 0.26, whose events are maps.
			ReplayTopic: cfg.Encoding != kveventstest.ArrayLike}
		if cfg.EventsAddr != "" {
			pc.Endpoint = "tcp://" + cfg.EventsAddr
		}
		if cfg.ReplayAddr != "" && !cfg.NoReplay {
			pc.ReplayEndpoint = "tcp://" + cfg.ReplayAddr
		}
		if s.pub, err = kveventstest.NewPublisher(pc); err != nil {
			return nil, err
		}
	}
	addr := cfg.HTTPAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	if s.ln, err = net.Listen("tcp", addr); err != nil {
		if s.pub != nil {
			s.pub.Close()
		}
		return nil, err
	}
	s.URL = "http://" + s.ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /metrics", s.metrics)
	mux.HandleFunc("POST /tokenize", s.tokenize)
	mux.HandleFunc("POST /v1/chat/completions", s.complete)
	mux.HandleFunc("POST /v1/completions", s.complete)
	if cfg.RuntimeLoRA {
		mux.HandleFunc("POST /v1/load_lora_adapter", s.loadLoRA)
		mux.HandleFunc("POST /v1/unload_lora_adapter", s.unloadLoRA)
	}
	s.hs = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go s.hs.Serve(s.ln)
	return s, nil
}

// Close stops the server, ending requests in progress. It is idempotent.
func (s *Server) Close() {
	s.once.Do(func() {
		close(s.quit)
		s.hs.Close()
		if s.pub != nil {
			s.pub.Close()
		}
	})
}

// Model returns the served model name.
func (s *Server) Model() string { return s.cfg.Model }

// BlockSize returns the tokens of a KV block.
func (s *Server) BlockSize() int { return s.cfg.BlockSize }

// GPUBlocks returns the KV cache's capacity in blocks.
func (s *Server) GPUBlocks() int { return s.cfg.GPUBlocks }

// Figures returns the modelled engine's cost figures in real seconds (over
// the time scale), as a worker's cost configuration states them.
func (s *Server) Figures() cost.Figures { return s.eng.Figures().Scaled(s.cfg.TimeScale) }

// EventsEndpoint returns the KV event publisher's address, as
// tcp://127.0.0.1:port; "" without events.
func (s *Server) EventsEndpoint() string {
	if s.pub == nil {
		return ""
	}
	return s.pub.Endpoint()
}

// ReplayEndpoint returns the replay socket's address; "" without one.
func (s *Server) ReplayEndpoint() string {
	if s.pub == nil {
		return ""
	}
	return s.pub.ReplayEndpoint()
}

// Topic returns the events' topic.
func (s *Server) Topic() string { return s.cfg.Topic }

// WaitSubscribed waits until a subscriber to the events is connected: a
// PUB socket drops what it publishes before.
func (s *Server) WaitSubscribed(ctx context.Context) error {
	if s.pub == nil {
		return errors.New("vllmtest: no events")
	}
	return s.pub.WaitSubscribed(ctx)
}

// Stats returns the server's counters.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// Requests returns what the server did with each completion request so
// far, in the order they started prefilling.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// CachedBlocks returns the blocks in the prefix cache.
func (s *Server) CachedBlocks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.cache.blocks)
}

// Cached returns how many leading tokens of tokens the prefix cache holds
// under salt, in full blocks, without touching it.
func (s *Server) Cached(tokens []uint32, salt string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, h := range s.cache.hashes(tokens, salt) {
		if _, ok := s.cache.blocks[h]; !ok {
			break
		}
		n += s.cfg.BlockSize
	}
	return n
}

// ResetPrefixCache empties the prefix cache and publishes
// AllBlocksCleared, as vLLM's /reset_prefix_cache does.
func (s *Server) ResetPrefixCache() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cache.clear()
	s.stats.Clears++
	return s.publish(&kvevents.AllBlocksCleared{})
}

// publish publishes events in one batch; s.mu is held, so that batches
// follow the cache's changes in order.
func (s *Server) publish(evs ...kvevents.Event) error {
	if s.pub == nil || len(evs) == 0 {
		return nil
	}
	s.ts++
	// SGLang's batches always carry their attn_dp_rank.
	_, err := s.pub.Publish(kvevents.Batch{TS: s.ts, Events: evs, DPRank: int64(s.cfg.DPRank), HasDPRank: s.cfg.DPRank > 0 || s.cfg.SGLang})
	return err
}

// sleep waits d of modelled time; false if ctx ended or the server closed
// first.
func (s *Server) sleep(ctx context.Context, seconds float64) bool {
	d := time.Duration(seconds / s.cfg.TimeScale * float64(time.Second))
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-s.quit:
	}
	return false
}

// vLLM's error shape.
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{
		"message": msg, "type": typ, "param": nil, "code": status}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	openaitest.WriteJSON(w, status, "application/json", v)
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	data := []map[string]any{{
		"id": s.cfg.Model, "object": "model", "created": 1, "owned_by": "vllm", "root": s.cfg.Model,
		"parent": nil, "max_model_len": s.cfg.MaxModelLen}}
	for _, n := range s.Adapters() {
		s.mu.Lock()
		path := s.loras[n]
		s.mu.Unlock()
		data = append(data, map[string]any{"id": n, "object": "model", "created": 1, "owned_by": "vllm", "root": path,
			"parent": s.cfg.Model, "max_model_len": nil})
	}
	openaitest.Models(w, "application/json", data...)
}

// Adapters returns the LoRA adapters the server serves, sorted.
func (s *Server) Adapters() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := make([]string, 0, len(s.loras))
	for n := range s.loras {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// loadLoRA answers vLLM's /v1/load_lora_adapter: {"lora_name",
// "lora_path"}; 400 when the name is served already.
func (s *Server) loadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
		Path string `json:"lora_path"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || req.Name == "" || req.Path == "" {
		writeError(w, http.StatusBadRequest, "BadRequestError", "Both 'lora_name' and 'lora_path' must be provided.")
		return
	}
	s.mu.Lock()
	_, dup := s.loras[req.Name]
	if !dup {
		s.loras[req.Name] = req.Path
	}
	s.mu.Unlock()
	if dup {
		writeError(w, http.StatusBadRequest, "InvalidUserInput", fmt.Sprintf("The lora adapter '%s' has already been loaded.", req.Name))
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
}

// unloadLoRA answers vLLM's /v1/unload_lora_adapter: {"lora_name"}; 404
// when no such adapter is served.
func (s *Server) unloadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || req.Name == "" {
		writeError(w, http.StatusBadRequest, "BadRequestError", "'lora_name' must be provided.")
		return
	}
	s.mu.Lock()
	_, ok := s.loras[req.Name]
	delete(s.loras, req.Name)
	s.mu.Unlock()
	if !ok {
		writeError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name))
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", req.Name)
}

// loraNames returns the adapters of counts with a count above 0, sorted
// and comma-separated, as vLLM's lora_requests_info labels. s.mu is held.
func loraNames(counts map[string]int) string {
	var names []string
	for n, c := range counts {
		if c > 0 {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return strings.Join(names, ",")
}

func (s *Server) metrics(w http.ResponseWriter, r *http.Request) {
	if s.cfg.SGLang {
		var page bytes.Buffer
		s.sglangMetrics(&textRecorder{h: http.Header{}, buf: &page}, nil)
		writeMetricsPage(w, r, QueryEmpty, page.Bytes()) // its registry is a multiprocess one
		return
	}
	var names []string
	if r != nil && s.cfg.MetricsQuery == QueryNames {
		names = r.URL.Query()["name[]"]
	}
	if len(names) == 0 {
		var page bytes.Buffer
		s.vllmMetrics(&textRecorder{h: http.Header{}, buf: &page}, nil)
		writeMetricsPage(w, r, s.cfg.MetricsQuery, page.Bytes())
		return
	}
	// The page restricted to names: as restrictPage works family by
	// family, the restriction of the static families is kept with them.
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	w.Write(s.vllmMetrics(textOnly{w, names}, names))
}

// textOnly writes what is written to it restricted to names
// (restrictPage); it takes whole families in each Write.
type textOnly struct {
	w     http.ResponseWriter
	names []string
}

func (t textOnly) Header() http.Header { return http.Header{} }
func (t textOnly) Write(b []byte) (int, error) {
	t.w.Write(restrictPage(b, t.names))
	return len(b), nil
}
func (t textOnly) WriteHeader(int) {}

// vllmMetrics writes the server's vLLM page to w but for its static
// families (writeRestOfMetrics), which it returns, restricted to names
// when names are given, and writes too when they are not.
func (s *Server) vllmMetrics(w http.ResponseWriter, names []string) []byte {
	s.mu.Lock()
	running, waiting := s.running, s.waiting
	usage := float64(s.cache.held) / float64(s.cfg.GPUBlocks)
	st := s.stats
	loraRunning, loraWaiting := loraNames(s.loraRunning), loraNames(s.loraWaiting)
	s.mu.Unlock()
	l := fmt.Sprintf(`engine="0",model_name=%q`, s.cfg.Model)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	var head bytes.Buffer
	head.Grow(2048)
	gauge := func(name, help string, v float64) {
		fmt.Fprintf(&head, "# HELP %s %s\n# TYPE %s gauge\n%s{%s} %v\n", name, help, name, name, l, v)
	}
	counter := func(name, help string, v float64) {
		fmt.Fprintf(&head, "# HELP %s %s\n# TYPE %s counter\n%s{%s} %v\n", name, help, name, name, l, v)
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float64(running))
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(waiting))
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
	counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", float64(st.PromptTokens))
	counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", float64(st.CachedTokens))
	counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", float64(st.PromptTokens))
	counter("vllm:request_success_total", "Count of successfully processed requests.", float64(st.Requests))
	fmt.Fprintf(&head, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"+
		`vllm:cache_config_info{block_size="%d",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="%d",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0`+"\n",
		s.cfg.BlockSize, s.cfg.GPUBlocks)
	w.Write(head.Bytes())
	rest := s.restOfMetrics(l, int64(st.Requests), names)
	if names == nil {
		w.Write(rest)
	}
	if s.cfg.MaxLoRAs > 0 {
		// vLLM sets the series of the current labels to the time.
		fmt.Fprintf(w, "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n"+
			"vllm:lora_requests_info{max_lora=\"%d\",running_lora_adapters=%q,waiting_lora_adapters=%q} %v\n",
			s.cfg.MaxLoRAs, loraRunning, loraWaiting, float64(time.Now().UnixNano())/1e9)
	}
	return rest
}

// restOfMetrics returns writeRestOfMetrics's text for requests, written
// again only when requests changed; restricted to names if any.
func (s *Server) restOfMetrics(l string, requests int64, names []string) []byte {
	s.restMu.Lock()
	defer s.restMu.Unlock()
	if s.rest == nil || s.restReq != requests {
		var b bytes.Buffer
		writeRestOfMetrics(&b, l, requests)
		s.rest, s.restReq, s.restOnly = b.Bytes(), requests, nil
	}
	if names == nil {
		return s.rest
	}
	if key := strings.Join(names, "\n"); s.restOnly == nil || key != s.restNames {
		s.restOnly, s.restNames = append([]byte{}, restrictPage(s.rest, names)...), key
	}
	return s.restOnly
}

// request is what the server reads of a completion or tokenize request.
type request struct {
	Model               string          `json:"model"`
	Messages            []Message       `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	CacheSalt           string `json:"cache_salt"`
	AddGenerationPrompt *bool  `json:"add_generation_prompt"`
	AddSpecialTokens    *bool  `json:"add_special_tokens"`
}

// tokens returns the request's prompt tokens: chat messages through the
// chat template, or a completion's prompt (a string, a list of one string,
// or token ids).
func (r *request) tokens(chat bool) ([]uint32, error) {
	if chat {
		if len(r.Messages) == 0 {
			return nil, errors.New("messages: at least one message is required")
		}
		gen := r.AddGenerationPrompt == nil || *r.AddGenerationPrompt
		return ChatTokens(r.Messages, gen), nil
	}
	special := r.AddSpecialTokens == nil || *r.AddSpecialTokens
	var str string
	if json.Unmarshal(r.Prompt, &str) == nil {
		return CompletionTokens(str, special), nil
	}
	var strs []string
	if json.Unmarshal(r.Prompt, &strs) == nil && len(strs) == 1 {
		return CompletionTokens(strs[0], special), nil
	}
	var ids []uint32
	if json.Unmarshal(r.Prompt, &ids) == nil && len(ids) > 0 {
		return ids, nil
	}
	return nil, errors.New("prompt: a string, a list of one string, or token ids is required")
}

// read decodes a request and checks its model; false after answering an
// error.
func (s *Server) read(w http.ResponseWriter, r *http.Request, req *request) bool {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err == nil {
		err = json.Unmarshal(body, req)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", "invalid JSON: "+err.Error())
		return false
	}
	s.mu.Lock()
	_, lora := s.loras[req.Model]
	s.mu.Unlock()
	if req.Model != "" && req.Model != s.cfg.Model && !lora {
		writeError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return false
	}
	return true
}

// tokenize answers vLLM's TokenizeChatRequest (messages, through the chat
// template, add_generation_prompt true by default) or
// TokenizeCompletionRequest (prompt, add_special_tokens true by default).
func (s *Server) tokenize(w http.ResponseWriter, r *http.Request) {
	var req request
	if !s.read(w, r, &req) {
		return
	}
	if s.cfg.SGLang && !sglangTokenizable(w, &req) {
		return
	}
	toks, err := req.tokens(req.Messages != nil && !s.cfg.SGLang)
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	s.mu.Lock()
	s.stats.Tokenizes++
	s.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"count": len(toks), "max_model_len": s.cfg.MaxModelLen,
		"tokens": toks, "token_strs": nil})
}

// admit waits for a running slot and the compute, then allocates the
// prompt's blocks and publishes what changed. It returns the allocation
// (release it), or false if ctx ended or the server closed while waiting.
func (s *Server) admit(ctx context.Context, prompt []uint32, salt, lora string) (alloc, bool) {
	s.mu.Lock()
	s.waiting++
	s.loraWaiting[lora]++
	s.mu.Unlock()
	unwait := func() {
		s.mu.Lock()
		s.waiting--
		s.loraWaiting[lora]--
		s.mu.Unlock()
	}
	select {
	case s.slots <- struct{}{}:
	case <-ctx.Done():
		unwait()
		return alloc{}, false
	case <-s.quit:
		unwait()
		return alloc{}, false
	}
	select {
	case s.gpu <- struct{}{}:
	case <-ctx.Done():
		<-s.slots
		unwait()
		return alloc{}, false
	case <-s.quit:
		<-s.slots
		unwait()
		return alloc{}, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waiting--
	s.running++
	s.loraWaiting[lora]--
	s.loraRunning[lora]++
	s.context += len(prompt)
	return s.store(prompt, salt, lora), true
}

// Churn stores prompt's blocks as a request's prefill would, evicting the
// least recently used blocks when the cache is full, and publishes the
// events, without a request: a fleet's cache churn at a chosen rate, for
// measuring what following the events costs. The blocks are free to be
// evicted at once.
func (s *Server) Churn(prompt []uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.store(prompt, "", "")
	s.cache.release(a.held)
}

// store allocates prompt's blocks and publishes what changed; s.mu is
// held.
func (s *Server) store(prompt []uint32, salt, lora string) alloc {
	// vLLM's block hashes take the LoRA name, then the cache salt, as
	// extra keys: an adapter's blocks are never its base model's.
	hashes := s.cache.hashes(prompt, loraSalt(lora, salt))
	// At least one token is computed, for its logits: a prompt cached to
	// its last block recomputes that block.
	a := s.cache.allocate(hashes, (len(prompt)-1)/s.cfg.BlockSize)
	var evs []kvevents.Event
	if len(a.evicted) > 0 {
		rm := &kvevents.BlockRemoved{Medium: "GPU", BlockHashes: make([]kvevents.Hash, 0, len(a.evicted))}
		for _, h := range a.evicted {
			rm.BlockHashes = append(rm.BlockHashes, kvevents.IntHash(h))
		}
		evs = append(evs, rm)
		s.stats.BlocksRemoved += int64(len(a.evicted))
	}
	if len(a.stored) > 0 {
		first, last := a.stored[0], a.stored[len(a.stored)-1]
		st := &kvevents.BlockStored{BlockSize: s.cfg.BlockSize, Medium: "GPU",
			TokenIDs: prompt[first*s.cfg.BlockSize : (last+1)*s.cfg.BlockSize], BlockHashes: make([]kvevents.Hash, 0, len(a.stored))}
		for _, i := range a.stored {
			st.BlockHashes = append(st.BlockHashes, kvevents.IntHash(hashes[i]))
		}
		if first > 0 {
			st.Parent = kvevents.IntHash(hashes[first-1])
		}
		if lora != "" {
			// Every block's extra keys start with the LoRA name.
			st.LoRAName = lora
			st.ExtraKeys = make([][]string, len(st.BlockHashes))
			for i := range st.ExtraKeys {
				st.ExtraKeys[i] = []string{lora}
			}
			if first == 0 && salt != "" {
				st.ExtraKeys[0] = append(st.ExtraKeys[0], salt)
			}
		} else if salt != "" {
			// vLLM's extra keys: the cache salt among the first block's.
			st.ExtraKeys = make([][]string, len(st.BlockHashes))
			if first == 0 {
				st.ExtraKeys[0] = []string{salt}
			}
		}
		evs = append(evs, st)
		s.stats.BlocksStored += int64(len(a.stored))
	}
	_ = s.publish(evs...) // a subscriber that misses it asks for a replay
	return a
}

// loraSalt is what seeds the block hashes of a request for the adapter
// lora ("" for the base model) with the cache salt salt.
func loraSalt(lora, salt string) string {
	if lora == "" {
		return salt
	}
	return lora + "\x00" + salt
}

// finish releases a request's slot and blocks.
func (s *Server) finish(a alloc, contextTokens int, lora string) {
	s.mu.Lock()
	s.cache.release(a.held)
	s.running--
	s.loraRunning[lora]--
	s.context -= contextTokens
	s.mu.Unlock()
	<-s.slots
}

func (s *Server) complete(w http.ResponseWriter, r *http.Request) {
	var req request
	if !s.read(w, r, &req) {
		return
	}
	chat := r.URL.Path == "/v1/chat/completions"
	prompt, err := req.tokens(chat)
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	n := 16
	if req.MaxTokens != nil {
		n = *req.MaxTokens
	}
	if req.MaxCompletionTokens != nil {
		n = *req.MaxCompletionTokens
	}
	if n < 1 {
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("max_tokens must be at least 1, got %d.", n))
		return
	}
	if len(prompt)+n > s.cfg.MaxModelLen {
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			s.cfg.MaxModelLen, len(prompt)+n, len(prompt), n))
		return
	}
	ctx := r.Context()
	lora := ""
	if req.Model != "" && req.Model != s.cfg.Model {
		lora = req.Model
	}
	a, ok := s.admit(ctx, prompt, req.CacheSalt, lora)
	if !ok {
		return
	}
	cached := a.hit * s.cfg.BlockSize
	s.mu.Lock()
	s.stats.Requests++
	s.stats.PromptTokens += int64(len(prompt))
	s.stats.CachedTokens += int64(cached)
	s.requests = append(s.requests, Request{Path: r.URL.Path, CacheSalt: req.CacheSalt, PromptTokens: len(prompt),
		CachedTokens: cached, CompletionTokens: n, Stream: req.Stream})
	s.mu.Unlock()
	generated := 0
	defer func() { s.finish(a, len(prompt)+generated, lora) }()
	// The prefill step yields the first token.
	ok = s.sleep(ctx, s.eng.PrefillSeconds(len(prompt)-cached, cached))
	<-s.gpu
	if !ok {
		return
	}
	step := func() bool {
		s.mu.Lock()
		secs := s.eng.DecodeStepSeconds(s.running, s.context)
		s.context++
		generated++
		s.mu.Unlock()
		return s.sleep(ctx, secs)
	}

	cmpl := openaitest.Completion{ID: "cmpl-" + randomID(), Model: s.cfg.Model, Created: time.Now().Unix(), Chat: chat}
	if chat {
		cmpl.ID = "chatcmpl-" + randomID()
	}
	var details any
	if !s.cfg.NoCachedTokens {
		details = openaitest.Cached(cached)
	}
	usage := openaitest.Usage(len(prompt), n, details, true)
	const word = "ok "
	if !req.Stream {
		for i := 1; i < n; i++ {
			if !step() {
				return
			}
		}
		text := strings.Repeat(word, n)
		choice := cmpl.Choice(text, "length", map[string]any{"logprobs": nil, "stop_reason": nil})
		if chat {
			choice["message"].(map[string]any)["tool_calls"] = []any{}
		}
		writeJSON(w, http.StatusOK, cmpl.Body(choice, usage, nil))
		return
	}

	// vLLM's chunks: a chat's first carries the role; the last token's
	// carries the finish reason.
	st := cmpl.Stream(w, "text/event-stream; charset=utf-8")
	if chat {
		st.Send(st.Chunk(map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "logprobs": nil, "finish_reason": nil}, nil))
	}
	extra := map[string]any{"logprobs": nil}
	if !chat {
		extra["stop_reason"] = nil
	}
	for i := range n {
		if i > 0 && !step() {
			return
		}
		var finish any
		if i == n-1 {
			finish = "length"
		}
		st.Token(word, finish, extra)
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		st.Usage(usage)
	}
	st.Done()
}

func randomID() string {
	var b [12]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
