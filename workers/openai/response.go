package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/batonllm/baton/workers/engine"
)

// NewID returns a fresh response id in OpenAI's style for kind k.
func NewID(k Kind) string {
	prefix := "chatcmpl-"
	if k == Completion {
		prefix = "cmpl-"
	}
	return fmt.Sprintf("%s%016x%08x", prefix, rand.Uint64(), rand.Uint32())
}

// Observer hears about a response as it is written. Nil fields are skipped.
// Its functions run on the writing goroutine.
type Observer struct {
	// FirstToken is called when the first generated text is received.
	FirstToken func()
	// Token is called for every later event carrying text, with its token
	// count (inter-token latency).
	Token func(tokens int)
}

// Write renders stream s as the response to r: server-sent events ending in
// `data: [DONE]` when r.Stream, one JSON object otherwise. It returns the
// final usage when the stream completed.
//
// On a stream error, Write reports whether it had written anything: if not,
// the caller writes an error of its own (or retries elsewhere); if it had,
// Write has already ended the event stream with an error event the client
// sees.
func Write(w http.ResponseWriter, r *Request, id string, s engine.Stream, obs *Observer) (final *engine.Final, written bool, err error) {
	if obs == nil {
		obs = &Observer{}
	}
	if r.Stream {
		return writeStream(w, r, id, s, obs)
	}
	return writeJSON(w, r, id, s, obs)
}

func writeJSON(w http.ResponseWriter, r *Request, id string, s engine.Stream, obs *Observer) (*engine.Final, bool, error) {
	var text strings.Builder
	first := true
	for {
		ev, err := s.Recv()
		if err == io.EOF {
			return nil, false, errors.New("stream ended without final usage")
		}
		if err != nil {
			return nil, false, err
		}
		if ev.Text != "" {
			if first {
				first = false
				if obs.FirstToken != nil {
					obs.FirstToken()
				}
			} else if obs.Token != nil {
				obs.Token(ev.Tokens)
			}
			text.WriteString(ev.Text)
		}
		if ev.Final != nil {
			resp := completionBody(r, id, text.String(), ev.Final)
			w.Header().Set("Content-Type", "application/json")
			b, err := json.Marshal(resp)
			if err != nil {
				return nil, false, err
			}
			if _, err := w.Write(append(b, '\n')); err != nil {
				return ev.Final, true, clientGone(err)
			}
			return ev.Final, true, nil
		}
	}
}

type usageBody struct {
	PromptTokens        int                `json:"prompt_tokens"`
	CompletionTokens    int                `json:"completion_tokens"`
	TotalTokens         int                `json:"total_tokens"`
	PromptTokensDetails promptTokenDetails `json:"prompt_tokens_details"`
}

type promptTokenDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func usageOf(f *engine.Final) usageBody {
	return usageBody{
		PromptTokens:        f.PromptTokens,
		CompletionTokens:    f.CompletionTokens,
		TotalTokens:         f.PromptTokens + f.CompletionTokens,
		PromptTokensDetails: promptTokenDetails{CachedTokens: f.CachedTokens},
	}
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type choiceBody struct {
	Index        int          `json:"index"`
	Message      *chatMessage `json:"message,omitempty"`
	Text         *string      `json:"text,omitempty"`
	Logprobs     any          `json:"logprobs"`
	FinishReason string       `json:"finish_reason"`
}

type completionResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []choiceBody `json:"choices"`
	Usage   usageBody    `json:"usage"`
}

func completionBody(r *Request, id, text string, f *engine.Final) completionResponse {
	c := choiceBody{FinishReason: f.FinishReason}
	object := "chat.completion"
	if r.Kind == Chat {
		c.Message = &chatMessage{Role: "assistant", Content: text}
	} else {
		object = "text_completion"
		c.Text = &text
	}
	return completionResponse{
		ID: id, Object: object, Created: time.Now().Unix(), Model: r.Model,
		Choices: []choiceBody{c}, Usage: usageOf(f),
	}
}

// chunkWriter renders stream chunks by appending into one reused buffer.
type chunkWriter struct {
	w      http.ResponseWriter
	rc     *http.ResponseController
	r      *Request
	head   []byte // `data: {"id":...,"choices":[{"index":0,`
	buf    []byte
	object string
}

func newChunkWriter(w http.ResponseWriter, r *Request, id string) *chunkWriter {
	cw := &chunkWriter{w: w, rc: http.NewResponseController(w), r: r, buf: make([]byte, 0, 512)}
	cw.object = "chat.completion.chunk"
	if r.Kind == Completion {
		cw.object = "text_completion"
	}
	h := []byte(`data: {"id":`)
	h = appendJSONString(h, id)
	h = append(h, `,"object":"`...)
	h = append(h, cw.object...)
	h = append(h, `","created":`...)
	h = strconv.AppendInt(h, time.Now().Unix(), 10)
	h = append(h, `,"model":`...)
	h = appendJSONString(h, r.Model)
	cw.head = h
	return cw
}

// text writes a chunk carrying generated text.
func (cw *chunkWriter) text(s string, first bool) error {
	b := append(cw.buf[:0], cw.head...)
	b = append(b, `,"choices":[{"index":0,`...)
	if cw.r.Kind == Chat {
		if first {
			b = append(b, `"delta":{"role":"assistant","content":`...)
		} else {
			b = append(b, `"delta":{"content":`...)
		}
		b = appendJSONString(b, s)
		b = append(b, '}')
	} else {
		b = append(b, `"text":`...)
		b = appendJSONString(b, s)
	}
	b = append(b, `,"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
	cw.buf = b
	return cw.flush(b)
}

// finish writes the chunk with the finish reason and, if asked, the usage
// chunk, then [DONE].
func (cw *chunkWriter) finish(f *engine.Final) error {
	b := append(cw.buf[:0], cw.head...)
	b = append(b, `,"choices":[{"index":0,`...)
	if cw.r.Kind == Chat {
		b = append(b, `"delta":{}`...)
	} else {
		b = append(b, `"text":""`...)
	}
	b = append(b, `,"logprobs":null,"finish_reason":`...)
	b = appendJSONString(b, f.FinishReason)
	b = append(b, "}]}\n\n"...)
	if cw.r.IncludeUsage {
		u, _ := json.Marshal(usageOf(f))
		b = append(b, cw.head...)
		b = append(b, `,"choices":[],"usage":`...)
		b = append(b, u...)
		b = append(b, "}\n\n"...)
	}
	b = append(b, "data: [DONE]\n\n"...)
	cw.buf = b
	return cw.flush(b)
}

// fail ends the stream with an error event the client sees.
func (cw *chunkWriter) fail(e *Error) error {
	b, _ := json.Marshal(e.body())
	out := append([]byte("data: "), b...)
	out = append(out, "\n\n"...)
	return cw.flush(out)
}

func (cw *chunkWriter) flush(b []byte) error {
	if _, err := cw.w.Write(b); err != nil {
		return clientGone(err)
	}
	if err := cw.rc.Flush(); err != nil {
		return clientGone(err)
	}
	return nil
}

// clientGone marks an error writing to the client as the client's doing.
func clientGone(err error) error {
	return fmt.Errorf("writing to the client: %w: %w", engine.ErrClientGone, err)
}

func writeStream(w http.ResponseWriter, r *Request, id string, s engine.Stream, obs *Observer) (*engine.Final, bool, error) {
	cw := newChunkWriter(w, r, id)
	written := false
	start := func() {
		if written {
			return
		}
		written = true
		h := w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Accel-Buffering", "no")
		w.WriteHeader(http.StatusOK)
	}
	first := true
	for {
		ev, err := s.Recv()
		if err == io.EOF {
			err = errors.New("stream ended without final usage")
		}
		if err != nil {
			if written {
				cw.fail(streamError(err))
			}
			return nil, written, err
		}
		if ev.Text != "" {
			start()
			if first {
				if obs.FirstToken != nil {
					obs.FirstToken()
				}
			} else if obs.Token != nil {
				obs.Token(ev.Tokens)
			}
			if err := cw.text(ev.Text, first); err != nil {
				return nil, true, err
			}
			first = false
		}
		if ev.Final != nil {
			start()
			return ev.Final, true, cw.finish(ev.Final)
		}
	}
}

// streamError is the error event sent when a stream breaks after its first
// token.
func streamError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: "stream_interrupted", Message: "the worker stream ended early: " + err.Error()}
}

// appendJSONString appends s as a JSON string literal.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 || r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			if r == utf8.RuneError {
				b = append(b, `\ufffd`...)
			} else {
				b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			}
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
