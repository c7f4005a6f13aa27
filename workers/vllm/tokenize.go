package vllm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// DefaultTokenizePath is where vLLM (and SGLang) serve tokenization.
const DefaultTokenizePath = "/tokenize"

// maxTokenizeBytes bounds a /tokenize response: 1M tokens of 7 digits.
const maxTokenizeBytes = 8 << 20

// chatPath is the OpenAI chat completions path, whose requests are
// tokenized through the engine's chat template.
const chatPath = "/v1/chat/completions"

// Tokenizer asks an engine's POST /tokenize for a request's prompt tokens:
// for a chat request, vLLM's TokenizeChatRequest ({"model", "messages",
// "tools", "add_generation_prompt": true}), which applies the chat template
// as the chat completion will; for a completion, its
// TokenizeCompletionRequest ({"model", "prompt"}). The answer is
// {"count", "max_model_len", "tokens"}. Its methods are safe for
// concurrent use.
type Tokenizer struct {
	url string
	hc  *http.Client
	tr  *http.Transport
}

// NewTokenizer returns a Tokenizer of the engine at baseURL (as
// http://10.0.0.7:8000), tokenizing at path (DefaultTokenizePath when
// empty). Close it.
func NewTokenizer(baseURL, path string) (*Tokenizer, error) {
	if path == "" {
		path = DefaultTokenizePath
	}
	u, err := endpointURL(baseURL, path, "tokenize")
	if err != nil {
		return nil, err
	}
	// Requests arrive concurrently: keep a few connections warm.
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     time.Minute,
	}
	return &Tokenizer{url: u.String(), hc: &http.Client{Transport: tr}, tr: tr}, nil
}

// URL returns the endpoint asked.
func (t *Tokenizer) URL() string { return t.url }

// tokenizeRequest is vLLM's TokenizeChatRequest or TokenizeCompletionRequest.
type tokenizeRequest struct {
	Model               string          `json:"model"`
	Messages            json.RawMessage `json:"messages,omitempty"`
	Tools               json.RawMessage `json:"tools,omitempty"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt,omitempty"`
	Prompt              json.RawMessage `json:"prompt,omitempty"`
}

// tokenizeResponse is vLLM's TokenizeResponse.
type tokenizeResponse struct {
	Count  int      `json:"count"`
	Tokens []uint32 `json:"tokens"`
}

var bufs = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// Tokenize returns the tokens the engine computes for req's prompt; ctx
// bounds the call. It reads req.Model, req.Path and req.Body (the client's
// request, as the engine will receive it). A request the endpoint cannot
// take (a completion whose prompt is a list) has no tokens and no error.
func (t *Tokenizer) Tokenize(ctx context.Context, req *engine.Request) ([]uint32, error) {
	body, err := tokenizeBody(req)
	if body == nil || err != nil {
		return nil, err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := t.hc.Do(hr)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return nil, fmt.Errorf("POST %s: status %d", t.url, resp.StatusCode)
	}
	buf := bufs.Get().(*bytes.Buffer)
	defer bufs.Put(buf)
	buf.Reset()
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, maxTokenizeBytes)); err != nil {
		return nil, fmt.Errorf("POST %s: reading: %w", t.url, err)
	}
	out, err := parseTokenizeResponse(buf.Bytes())
	if err != nil {
		return nil, fmt.Errorf("POST %s: %w", t.url, err)
	}
	if out.Count != len(out.Tokens) {
		return nil, fmt.Errorf("POST %s: count %d, but %d tokens", t.url, out.Count, len(out.Tokens))
	}
	return out.Tokens, nil
}

// tokenizeBody builds the /tokenize request for req; nil if there is none.
func tokenizeBody(req *engine.Request) ([]byte, error) {
	var in struct {
		Messages json.RawMessage `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(req.Body, &in); err != nil {
		return nil, fmt.Errorf("reading the request: %w", err)
	}
	tr := tokenizeRequest{Model: req.Model}
	if req.Path == chatPath {
		yes := true
		tr.Messages, tr.Tools, tr.AddGenerationPrompt = in.Messages, in.Tools, &yes
		if isNull(tr.Tools) {
			tr.Tools = nil
		}
	} else {
		// vLLM tokenizes one string; a list of prompts is a batch of
		// requests, each cached on its own.
		if len(in.Prompt) == 0 || in.Prompt[0] != '"' {
			return nil, nil
		}
		tr.Prompt = in.Prompt
	}
	return json.Marshal(tr)
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

// Close releases the tokenizer's idle connections.
func (t *Tokenizer) Close() error {
	t.tr.CloseIdleConnections()
	return nil
}
