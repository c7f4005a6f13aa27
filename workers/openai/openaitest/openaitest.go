// Package openaitest is what baton's fake engines share of the OpenAI
// wire format: the chat messages they read, their JSON answers, the usage
// object, and the server-sent event stream of completion chunks ending in
// data: [DONE]. Each fake (workers/vllm/vllmtest,
// workers/llamacpp/llamatest, the scheduler's end-to-end fakes) keeps
// what is its engine's own: which fields its chunks carry, where the
// finish reason goes, its errors, its tokenizer.
package openaitest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Message is a chat message as engines read it: content is a string or a
// list of parts, whose text parts they read.
type Message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// Text returns the message's text content: the string, or its text parts
// (type "text", or no type) joined.
func (m Message) Text() string {
	var s string
	if json.Unmarshal(m.Content, &s) == nil {
		return s
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	_ = json.Unmarshal(m.Content, &parts)
	var b strings.Builder
	for _, p := range parts {
		if p.Type == "text" || p.Type == "" {
			b.WriteString(p.Text)
		}
	}
	return b.String()
}

// WriteJSON answers status with v as JSON, under contentType (engines
// differ on the charset parameter).
func WriteJSON(w http.ResponseWriter, status int, contentType string, v any) {
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(status)
	w.Write(append(marshal(v), '\n'))
}

// marshal writes v as the engines' Python servers do: <, > and & as
// they are (a json.RawMessage passed on byte for byte, when compact),
// not escaped as Go's encoding/json does by default.
func marshal(v any) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.Encode(v)
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// Usage is a completion's usage object. details is its
// prompt_tokens_details: Cached(n), or nil, which leaves the field out
// unless keepNull writes it as null (as vLLM does without
// --enable-prompt-tokens-details).
func Usage(prompt, completion int, details any, keepNull bool) map[string]any {
	u := map[string]any{"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
	if details != nil || keepNull {
		u["prompt_tokens_details"] = details
	}
	return u
}

// Cached is the prompt_tokens_details of n cached prompt tokens.
func Cached(n int) map[string]any { return map[string]any{"cached_tokens": n} }

// Object returns the object name of a chat or text completion, whole or
// as a stream's chunk.
func Object(chat, chunk bool) string {
	switch {
	case chat && chunk:
		return "chat.completion.chunk"
	case chat:
		return "chat.completion"
	}
	return "text_completion"
}

// Completion is the envelope of one completion: whole (Body) or the
// chunks of a stream (Stream).
type Completion struct {
	ID      string
	Model   string
	Created int64
	Chat    bool
}

// Body returns the whole completion of choice, with usage and the extra
// top-level fields an engine adds (timings, kv_transfer_params).
func (c Completion) Body(choice map[string]any, usage any, extra map[string]any) map[string]any {
	b := map[string]any{"id": c.ID, "object": Object(c.Chat, false), "created": c.Created, "model": c.Model,
		"choices": []any{choice}, "usage": usage}
	for k, v := range extra {
		b[k] = v
	}
	return b
}

// Choice returns the whole completion's choice 0 of text: a message for a
// chat, text otherwise, with the extra fields an engine adds.
func (c Completion) Choice(text, finish string, extra map[string]any) map[string]any {
	ch := map[string]any{"index": 0, "finish_reason": finish}
	if c.Chat {
		ch["message"] = map[string]any{"role": "assistant", "content": text}
	} else {
		ch["text"] = text
	}
	for k, v := range extra {
		ch[k] = v
	}
	return ch
}

// Stream is a completion streamed as server-sent events: one data line a
// chunk, each flushed, then data: [DONE].
type Stream struct {
	c  Completion
	w  io.Writer
	fl http.Flusher
}

// Stream answers 200 with an event stream under contentType and returns
// it.
func (c Completion) Stream(w http.ResponseWriter, contentType string) *Stream {
	w.Header().Set("Content-Type", contentType)
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	return &Stream{c: c, w: w, fl: fl}
}

// Send writes v as one event and flushes it.
func (s *Stream) Send(v any) {
	fmt.Fprintf(s.w, "data: %s\n\n", marshal(v))
	if s.fl != nil {
		s.fl.Flush()
	}
}

// Chunk returns a chunk of the stream: choice 0 alone, and the extra
// top-level fields an engine adds.
func (s *Stream) Chunk(choice map[string]any, extra map[string]any) map[string]any {
	ch := map[string]any{"id": s.c.ID, "object": Object(s.c.Chat, true), "created": s.c.Created, "model": s.c.Model,
		"choices": []any{choice}}
	for k, v := range extra {
		ch[k] = v
	}
	return ch
}

// Token sends a chunk of one token's text: a delta for a chat, text
// otherwise, finish the finish reason (nil before the last), with the
// extra choice fields an engine adds.
func (s *Stream) Token(text string, finish any, extra map[string]any) {
	ch := map[string]any{"index": 0, "finish_reason": finish}
	if s.c.Chat {
		ch["delta"] = map[string]any{"content": text}
	} else {
		ch["text"] = text
	}
	for k, v := range extra {
		ch[k] = v
	}
	s.Send(s.Chunk(ch, nil))
}

// Usage sends stream_options.include_usage's last chunk: no choice, the
// usage.
func (s *Stream) Usage(usage any) {
	s.Send(map[string]any{"id": s.c.ID, "object": Object(s.c.Chat, true), "created": s.c.Created, "model": s.c.Model,
		"choices": []any{}, "usage": usage})
}

// Done ends the stream.
func (s *Stream) Done() { io.WriteString(s.w, "data: [DONE]\n\n") }

// Models answers GET /v1/models with the model entries data.
func Models(w http.ResponseWriter, contentType string, data ...map[string]any) {
	WriteJSON(w, http.StatusOK, contentType, map[string]any{"object": "list", "data": data})
}
