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

	"github.com/batonllm/baton/workers/httpengine"
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
	tr  interface{ CloseIdleConnections() }
}

// NewTokenizer returns a Tokenizer of the engine at baseURL (as
// http://10.0.0.7:8000), tokenizing at path (DefaultTokenizePath when
// empty). Close it.
func NewTokenizer(baseURL, path string, opts ...HTTPOption) (*Tokenizer, error) {
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
	for _, opt := range opts {
		opt(tr)
	}
	rt := httpengine.PlainHTTP(tr)
	return &Tokenizer{url: u.String(), hc: &http.Client{Transport: rt}, tr: rt}, nil
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
	// A call that got no answer, or a 5xx from the engine or a proxy in
	// front of it, is made once more while ctx allows: /tokenize changes
	// nothing, and a failed call keys the request by its text.
	toks, retry, err := t.call(ctx, body)
	if err != nil && retry && ctx.Err() == nil {
		toks, _, err = t.call(ctx, body)
	}
	return toks, err
}

// call posts body to the endpoint once; with an error, retry reports
// whether another call may succeed.
func (t *Tokenizer) call(ctx context.Context, body []byte) (toks []uint32, retry bool, err error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, t.url, bytes.NewReader(body))
	if err != nil {
		return nil, false, err
	}
	hr.Header.Set("Content-Type", "application/json")
	// /tokenize changes nothing, so the transport may send it again on a
	// fresh connection when a kept-alive one was closed as it went out
	// (uvicorn closes idle connections after 5 s): otherwise that race
	// fails the call, and the request is keyed by its text. A nil value
	// marks it idempotent without sending the header.
	hr.Header["Idempotency-Key"] = nil
	resp, err := t.hc.Do(hr)
	if err != nil {
		return nil, true, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10))
		return nil, resp.StatusCode >= 500, fmt.Errorf("POST %s: status %d", t.url, resp.StatusCode)
	}
	buf := bufs.Get().(*bytes.Buffer)
	defer bufs.Put(buf)
	buf.Reset()
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, maxTokenizeBytes)); err != nil {
		return nil, true, fmt.Errorf("POST %s: reading: %w", t.url, err)
	}
	out, err := parseTokenizeResponse(buf.Bytes())
	if err != nil {
		return nil, false, fmt.Errorf("POST %s: %w", t.url, err)
	}
	if out.Count != len(out.Tokens) {
		return nil, false, fmt.Errorf("POST %s: count %d, but %d tokens", t.url, out.Count, len(out.Tokens))
	}
	return out.Tokens, false, nil
}

// tokenizeBody builds the /tokenize request for req; nil if there is none.
// The values it takes from the client's body (which the front end parsed)
// are read in one pass (rawFields) and go out as they came: decoding and
// marshalling them with encoding/json scanned a long prompt's messages
// four times, most of what a routing decision spent on a prompt not yet
// tokenized.
func tokenizeBody(req *engine.Request) ([]byte, error) {
	var in struct {
		Messages json.RawMessage `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	var ok bool
	if in.Messages, in.Tools, in.Prompt, ok = rawFields(req.Body); !ok {
		if err := json.Unmarshal(req.Body, &in); err != nil {
			return nil, fmt.Errorf("reading the request: %w", err)
		}
	}
	chat := req.Path == chatPath
	if !chat && (len(in.Prompt) == 0 || in.Prompt[0] != '"') {
		// vLLM tokenizes one string; a list of prompts is a batch of
		// requests, each cached on its own.
		return nil, nil
	}
	model, err := json.Marshal(req.Model)
	if err != nil {
		return nil, err
	}
	b := make([]byte, 0, len(model)+len(in.Messages)+len(in.Tools)+len(in.Prompt)+64)
	b = append(append(b, `{"model":`...), model...)
	if !chat {
		b = append(append(b, `,"prompt":`...), in.Prompt...)
		return append(b, '}'), nil
	}
	if !isNull(in.Messages) {
		b = append(append(b, `,"messages":`...), in.Messages...)
	}
	if !isNull(in.Tools) {
		b = append(append(b, `,"tools":`...), in.Tools...)
	}
	return append(b, `,"add_generation_prompt":true}`...), nil
}

// rawFields returns the values of the keys messages, tools and prompt of
// body, a JSON object the front end already parsed, as json.RawMessage
// fields would hold them, in one pass; false when it cannot read body so
// (the caller decodes it with encoding/json), as for keys with escapes or
// in another case, which encoding/json matches too.
func rawFields(body []byte) (messages, tools, prompt []byte, ok bool) {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return nil, nil, nil, false
	}
	i = skipSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		return nil, nil, nil, true
	}
	for {
		end, escaped := stringEnd(body, i)
		if end < 0 || escaped {
			return nil, nil, nil, false
		}
		key := body[i+1 : end-1]
		i = skipSpace(body, end)
		if i >= len(body) || body[i] != ':' {
			return nil, nil, nil, false
		}
		i = skipSpace(body, i+1)
		end = valueEnd(body, i)
		if end < 0 {
			return nil, nil, nil, false
		}
		v := body[i:end:end]
		switch {
		case string(key) == "messages":
			messages = v
		case string(key) == "tools":
			tools = v
		case string(key) == "prompt":
			prompt = v
		case bytes.EqualFold(key, []byte("messages")), bytes.EqualFold(key, []byte("tools")), bytes.EqualFold(key, []byte("prompt")):
			return nil, nil, nil, false
		}
		i = skipSpace(body, end)
		switch {
		case i >= len(body):
			return nil, nil, nil, false
		case body[i] == '}':
			return messages, tools, prompt, skipSpace(body, i+1) == len(body)
		case body[i] != ',':
			return nil, nil, nil, false
		}
		i = skipSpace(body, i+1)
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index past the string starting at b[i], and
// whether it has escapes; -1 if there is none.
func stringEnd(b []byte, i int) (int, bool) {
	if i >= len(b) || b[i] != '"' {
		return -1, false
	}
	escaped := false
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			escaped = true
			j++
		case '"':
			return j + 1, escaped
		}
	}
	return -1, false
}

// valueEnd returns the index past the value starting at b[i]; -1 if it
// does not end.
func valueEnd(b []byte, i int) int {
	if i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		end, _ := stringEnd(b, i)
		return end
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, _ := stringEnd(b, j)
				if end < 0 {
					return -1
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return -1
	}
	j := i
	for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\t' && b[j] != '\n' && b[j] != '\r' {
		j++
	}
	if j == i {
		return -1
	}
	return j
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || string(raw) == "null"
}

// Close releases the tokenizer's idle connections.
func (t *Tokenizer) Close() error {
	t.tr.CloseIdleConnections()
	return nil
}
