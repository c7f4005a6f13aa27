package httpengine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/batonllm/baton/workers/engine"
)

// Generate starts req as a streamed completion and returns its events, for
// callers that want events rather than the engine's bytes.
//
// The body sent is req.Body (a JSON object) with "stream": true and
// "stream_options": {"include_usage": true} forced, posted to req.Path.
// Without a body, a completion request is built from req.Model, Prompt,
// MaxTokens and Stop and posted to req.Path, or "/v1/completions".
//
// Generate returns once the engine's response headers arrive: an error
// from Generate means nothing was generated (connection refused:
// engine.ErrUnavailable; a status that is not 2xx: *StatusError, which
// wraps engine.ErrUnavailable, ErrUnknownModel or ErrInvalid as its
// Unwrap says).
//
// Events carry choice 0's text (delta.content, or text for completions;
// reasoning is not part of it), one event per chunk with Tokens 1 (engines
// stream one chunk per decoding step). The last event carries Final, from
// the finish reason and the usage chunk, when the engine sends [DONE].
func (c *Client) Generate(ctx context.Context, req *engine.Request) (engine.Stream, error) {
	if req == nil {
		return nil, fmt.Errorf("generate: %w: nil request", ErrInvalid)
	}
	r := *req
	if len(r.Body) == 0 && r.Path == "" {
		r.Path = "/v1/completions"
	}
	body, err := streamingBody(&r)
	if err != nil {
		return nil, fmt.Errorf("generate: %w", err)
	}
	ctx, cancel := context.WithCancel(ctx)
	resp, err := c.post(ctx, &r, body)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("generate: %w", err)
	}
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		resp.Body.Close()
		cancel()
		return nil, fmt.Errorf("generate: %w", &StatusError{Status: resp.StatusCode, Message: string(msg)})
	}
	return &stream{body: resp.Body, lines: newLineReader(resp.Body), ctx: ctx, cancel: cancel}, nil
}

// streamingBody returns the body Generate sends for r.
func streamingBody(r *engine.Request) ([]byte, error) {
	m := map[string]json.RawMessage{}
	if len(r.Body) > 0 {
		if err := json.Unmarshal(r.Body, &m); err != nil || m == nil {
			return nil, fmt.Errorf("%w: body is not a JSON object", ErrInvalid)
		}
	} else {
		set := func(k string, v any) {
			b, _ := json.Marshal(v) // strings, ints and []string always marshal
			m[k] = b
		}
		set("model", r.Model)
		set("prompt", r.Prompt)
		if r.MaxTokens > 0 {
			set("max_tokens", r.MaxTokens)
		}
		if len(r.Stop) > 0 {
			set("stop", r.Stop)
		}
	}
	opts := map[string]json.RawMessage{}
	if raw, ok := m["stream_options"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &opts); err != nil || opts == nil {
			return nil, fmt.Errorf("%w: stream_options is not a JSON object", ErrInvalid)
		}
	}
	opts["include_usage"] = json.RawMessage("true")
	so, err := json.Marshal(opts)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	m["stream_options"] = so
	m["stream"] = json.RawMessage("true")
	return json.Marshal(m)
}

// stream is a streamed completion being read.
type stream struct {
	body   io.ReadCloser
	lines  *lineReader
	ctx    context.Context
	cancel context.CancelFunc

	usage    usageTracker
	finished bool // Final returned: Recv returns io.EOF

	closeOnce sync.Once
	closed    atomic.Bool
}

// Recv returns the next event: io.EOF after the one carrying Final.
func (s *stream) Recv() (engine.Event, error) {
	if s.finished {
		s.drain()
		return engine.Event{}, io.EOF
	}
	for {
		line, rerr := s.lines.next()
		// A line cut short by a read error is not decoded.
		if data, ok := dataPayload(line); ok && (rerr == nil || rerr == io.EOF) {
			if string(data) == string(doneMarker) {
				return s.final(), nil
			}
			var c chunkJSON
			if err := json.Unmarshal(data, &c); err != nil {
				s.Close()
				return engine.Event{}, fmt.Errorf("generate: decoding chunk: %w", err)
			}
			if msg := c.errorMessage(); msg != "" {
				s.Close()
				return engine.Event{}, fmt.Errorf("generate: engine error: %s", msg)
			}
			s.usage.take(&c)
			if text := choiceText(&c); text != "" {
				return engine.Event{Text: text, Tokens: 1}, nil
			}
		}
		if rerr == io.EOF {
			// Some engines end the stream without [DONE]; a finish reason
			// or usage says the generation did end.
			if s.usage.finish != "" || s.usage.usage != nil {
				return s.final(), nil
			}
			s.Close()
			return engine.Event{}, fmt.Errorf("generate: stream ended before the generation did: %w", io.ErrUnexpectedEOF)
		}
		if rerr != nil {
			s.Close()
			if err := s.ctx.Err(); err != nil && !errors.Is(rerr, err) {
				rerr = fmt.Errorf("%w: %w", err, rerr)
			}
			return engine.Event{}, fmt.Errorf("generate: reading stream: %w", rerr)
		}
	}
}

func (s *stream) final() engine.Event {
	s.finished = true
	return engine.Event{Final: toFinal(s.usage.usage, s.usage.finish)}
}

// drain reads what little follows [DONE] (the end of the chunked body) so
// the connection returns to the pool, then releases the stream.
func (s *stream) drain() {
	if !s.closed.Load() {
		// A concurrent Close cancels the request, which ends this read.
		_, _ = io.Copy(io.Discard, io.LimitReader(s.body, 4<<10))
	}
	s.Close()
}

// Close cancels the request if it is still running. It is idempotent and
// may be called from another goroutine than Recv's.
func (s *stream) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		s.cancel()
		s.body.Close()
	})
	return nil
}

// choiceText returns the text choice 0 of a chunk adds.
func choiceText(c *chunkJSON) string {
	for _, ch := range c.Choices {
		if ch.Index != 0 {
			continue
		}
		if ch.Delta != nil && ch.Delta.Content != "" {
			return ch.Delta.Content
		}
		return ch.Text
	}
	return ""
}

var _ engine.Client = (*Client)(nil)
var _ engine.Stream = (*stream)(nil)
var _ engine.Describer = (*Client)(nil)
