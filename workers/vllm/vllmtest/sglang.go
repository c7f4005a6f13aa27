package vllmtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// SGLang's wire formats, where they differ from vLLM's (Config.SGLang).
// They follow SGLang's OpenAI server (python/sglang/srt/entrypoints/openai:
// serving_base.py, serving_tokenize.py, protocol.py) and its metrics
// collector (sglang/srt/metrics/collector.py).

// HeaderSGLangDPRank is the header by which SGLang's OpenAI server pins a
// request to a data-parallel rank; it wins over the body's
// routed_dp_rank, and one that is not an integer is a 400.
const HeaderSGLangDPRank = "X-Data-Parallel-Rank"

// sglangMetrics serves SGLang's series of the scheduler of one rank,
// labelled as SGLang labels them (dp_rank is the rank's attention DP
// rank, which NewDP's front sets).
func (s *Server) sglangMetrics(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	running, waiting, held := s.running, s.waiting, s.cache.held
	st := s.stats
	s.mu.Unlock()
	capacity := s.cfg.GPUBlocks * s.cfg.BlockSize
	l := fmt.Sprintf(`dp_rank="%d",engine_type="unified",model_name=%q,pp_rank="0",tp_rank="0"`, s.cfg.DPRank, s.cfg.Model)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	series := func(name, typ, help string, v float64) {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %v\n", name, help, name, typ, name, l, v)
	}
	hit := 0.0
	if st.PromptTokens > 0 {
		hit = float64(st.CachedTokens) / float64(st.PromptTokens)
	}
	series("sglang:num_running_reqs", "gauge", "The number of running requests.", float64(running))
	series("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", float64(waiting))
	series("sglang:num_used_tokens", "gauge", "The number of used tokens.", float64(held*s.cfg.BlockSize))
	series("sglang:token_usage", "gauge", "The token usage.", float64(held)/float64(s.cfg.GPUBlocks))
	series("sglang:max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.", float64(capacity))
	series("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", hit)
	series("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", float64(st.PromptTokens))
	series("sglang:cached_tokens_total", "counter", "Number of cached prompt tokens.", float64(st.CachedTokens))
	series("sglang:num_requests_total", "counter", "Number of requests processed.", float64(st.Requests))
}

// sglangTokenizable reports whether req is SGLang's TokenizeRequest, whose
// prompt (a string or a list of them) is required and whose messages
// are not read; when not, it answers FastAPI's validation error.
func sglangTokenizable(w http.ResponseWriter, req *request) bool {
	if len(req.Prompt) > 0 {
		return true
	}
	writeJSON(w, http.StatusUnprocessableEntity, map[string]any{"detail": []any{map[string]any{
		"type": "missing", "loc": []string{"body", "prompt"}, "msg": "Field required", "input": nil}}})
	return false
}

// How a DP front picked a request's rank (DP.Pinned).
const (
	pinHeader   = iota // the rank header
	pinBody            // the body's rank field
	pinBalanced        // none: the least busy rank
)

// sglangRank returns the rank an SGLang DP front hands r to: its
// X-Data-Parallel-Rank header, else its body's routed_dp_rank, else its
// data_parallel_rank; -1 for none. On a bad one it answers the error and
// returns ok false. r's body is read and put back.
func sglangRank(w http.ResponseWriter, r *http.Request, n int) (rank, by int, ok bool) {
	check := func(v int, what string) bool {
		if v < 0 || v >= n {
			writeError(w, http.StatusBadRequest, "BadRequestError",
				fmt.Sprintf("%s %d is out of range: the engine has data-parallel ranks 0–%d.", what, v, n-1))
			return false
		}
		return true
	}
	if h := r.Header.Values(HeaderSGLangDPRank); len(h) > 0 {
		v, err := strconv.Atoi(strings.TrimSpace(h[0]))
		if err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]any{"detail": fmt.Sprintf(
				"Invalid X-Data-Parallel-Rank header: must be an integer, got '%s'", h[0])})
			return 0, 0, false
		}
		return v, pinHeader, check(v, "X-Data-Parallel-Rank")
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return 0, 0, false
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	var f struct {
		Routed *int `json:"routed_dp_rank"`
		Old    *int `json:"data_parallel_rank"`
	}
	_ = json.Unmarshal(body, &f) // the rank's server answers a malformed body
	switch {
	case f.Routed != nil:
		return *f.Routed, pinBody, check(*f.Routed, "routed_dp_rank")
	case f.Old != nil:
		return *f.Old, pinBody, check(*f.Old, "data_parallel_rank")
	}
	return -1, pinBalanced, true
}
