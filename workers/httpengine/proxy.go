package httpengine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sync"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// holdHeaders is how long the relay of an event stream keeps the headers
// back while it waits for the first bytes of the body, so that the two
// leave in one write when the engine sent them together (one write and
// one wake-up of the client fewer), and an engine that sends its headers
// long before its first token still has them relayed at once.
const holdHeaders = 2 * time.Millisecond

// maxUsageBody bounds how much of a non-streamed response is kept to read
// its usage; a larger response is relayed whole but its usage is not read.
const maxUsageBody = 8 << 20

// Proxy posts req.Body to req.Path on the engine and relays the response to
// w, as engine.Proxier specifies; the package comment says which statuses
// are relayed. Only the status and Content-Type are copied, never the
// engine's other (or hop-by-hop) headers.
//
// An event stream (text/event-stream) is relayed line by line and flushed
// after each event (events that arrive together, together), the last with
// the body's end when w can end it early (EndBody); onFirstToken is called once, after the first event
// carrying generated text (choices[].delta.content, .text, reasoning or a
// tool call) has been flushed. Other bodies are copied as they come, and
// onFirstToken is called once the first bytes of a 2xx body are written.
// Usage (and the finish reason) are read from the stream's usage chunk or
// the whole response's usage object.
//
// The model a 2xx response names (each chunk's, or the whole response's)
// is the one the client asked for, req.Model when set, whatever the
// engine answered: llama-server names its base model, or its file, for a
// request for one of its LoRA adapters. A non-streamed response is then
// kept whole (up to 8 MiB) to be rewritten before it is relayed.
//
// Cancelling ctx (the client went away) cancels the engine's request.
func (c *Client) Proxy(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func()) (engine.ProxyResult, error) {
	return c.proxy(ctx, req, w, onFirstToken, nil)
}

// ProxyCached is Proxy for a decode engine after a remote prefill: the
// usage relayed (and returned) reports cached prompt tokens, those the
// prefill engine found in its cache, rather than the decode engine's
// count, which takes the blocks it received for cached. A non-streamed
// response larger than 8 MiB is relayed with its own usage.
func (c *Client) ProxyCached(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func(), cached int) (engine.ProxyResult, error) {
	n := max(cached, 0)
	return c.proxy(ctx, req, w, onFirstToken, func() (int, bool) { return n, true })
}

// ProxyCachedFunc is ProxyCached for a prefill whose count is known late
// (SGLang's prefill answers beside the decode): cached is called, from
// the relay's goroutine, when the decode engine's usage arrives, and may
// block a little; false keeps the decode engine's count.
func (c *Client) ProxyCachedFunc(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func(), cached func() (int, bool)) (engine.ProxyResult, error) {
	return c.proxy(ctx, req, w, onFirstToken, cached)
}

// proxy is Proxy, rewriting the usage's cached tokens to what cached
// returns, unless cached is nil or returns false.
func (c *Client) proxy(ctx context.Context, req *engine.Request, w http.ResponseWriter, onFirstToken func(), cached func() (int, bool)) (engine.ProxyResult, error) {
	var res engine.ProxyResult
	if req == nil {
		return res, fmt.Errorf("proxy: %w: nil request", ErrInvalid)
	}
	resp, err := c.post(ctx, req, req.Body)
	if err != nil {
		return res, fmt.Errorf("proxy: %w", err)
	}
	defer resp.Body.Close()
	res.Status = resp.StatusCode
	if serr := refused(resp); serr != nil {
		return res, fmt.Errorf("proxy: %w", serr)
	}

	ct := resp.ContentType
	if ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.WriteHeader(resp.StatusCode)
	res.Written = true

	ok := resp.StatusCode/100 == 2
	if !ok {
		onFirstToken = nil
	}
	rw := &relayWriter{w: w, rc: http.NewResponseController(w), onFirst: onFirstToken}
	if ok {
		rw.cached, rw.model = cached, req.Model
	}
	var usage usageTracker
	if isEventStream(ct) {
		err = rw.relayEvents(resp.Body, &usage, ok)
	} else {
		err = rw.relayBody(resp.Body, &usage, ok)
	}
	res.Usage = usage.final()
	if res.Usage != nil && rw.rewrote {
		res.Usage.CachedTokens = rw.rewroteTo
	}
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
			err = fmt.Errorf("%w: %w", ctxErr, err)
		}
		return res, fmt.Errorf("proxy: relaying response: %w", err)
	}
	return res, nil
}

func isEventStream(contentType string) bool {
	switch contentType {
	case "text/event-stream", "text/event-stream; charset=utf-8":
		return true
	case "application/json", "":
		return false
	}
	mt, _, err := mime.ParseMediaType(contentType)
	return err == nil && mt == "text/event-stream"
}

// relayWriter writes to the client and calls onFirst at most once.
type relayWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	onFirst func()
	// cached, if set, gives what replaces the usage's cached tokens
	// (false: nothing); rewrote says whether a usage was rewritten, to
	// rewroteTo.
	cached    func() (int, bool)
	rewrote   bool
	rewroteTo int
	// model, if set, is the model every chunk or response names.
	model string
}

// rewrite returns the data of a chunk or response with its model and its
// usage's cached tokens replaced, when the relay does that.
func (rw *relayWriter) rewrite(data []byte) ([]byte, bool) {
	data, named := rw.nameModel(data)
	out, counted := rw.rewriteCached(data)
	return out, named || counted
}

// nameModel returns data with its model replaced by rw.model, when it
// names another.
func (rw *relayWriter) nameModel(data []byte) ([]byte, bool) {
	if rw.model == "" || valueStart(data, `"model"`) == 0 {
		return data, false
	}
	if m, ok := plainString(data, `"model"`); ok && m == rw.model {
		return data, false
	}
	return withModel(data, rw.model)
}

// rewriteCached returns data with its usage's cached tokens replaced,
// when the relay does that.
func (rw *relayWriter) rewriteCached(data []byte) ([]byte, bool) {
	if rw.cached == nil || valueStart(data, `"usage"`) != '{' {
		return data, false
	}
	n, ok := rw.cached()
	if !ok {
		return data, false
	}
	out, ok := withCachedTokens(data, n)
	if ok {
		rw.rewrote, rw.rewroteTo = true, n
	}
	return out, ok
}

func (rw *relayWriter) write(b []byte) error {
	if _, err := rw.w.Write(b); err != nil {
		return fmt.Errorf("writing to client: %w: %w", engine.ErrClientGone, err)
	}
	return nil
}

func (rw *relayWriter) flush() error {
	if err := rw.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return fmt.Errorf("flushing to client: %w: %w", engine.ErrClientGone, err)
	}
	return nil
}

// end sends what was written and the end of the body, when the client's
// ResponseWriter can end a body before its handler returns (EndBody, as
// baton's HTTP/1.1 server's): the last events and the body's end leave in
// one write. Other writers are flushed when dirty (something was written
// since the last flush); their body ends with the handler.
func (rw *relayWriter) end(dirty bool) error {
	w := rw.w
	for {
		switch t := w.(type) {
		case interface{ EndBody() error }:
			if err := t.EndBody(); err != nil {
				return fmt.Errorf("ending the response to the client: %w: %w", engine.ErrClientGone, err)
			}
			return nil
		case interface{ Unwrap() http.ResponseWriter }:
			w = t.Unwrap()
			continue
		}
		if !dirty {
			return nil
		}
		return rw.flush()
	}
}

// flushAfter flushes what was written to the client after d, unless the
// returned stop is called first. stop reports whether the flush happened,
// and its error; once it returns, the timer no longer touches the client.
func (rw *relayWriter) flushAfter(d time.Duration) (stop func() (bool, error)) {
	var (
		mu      sync.Mutex
		stopped bool
		flushed bool
		err     error
	)
	t := time.AfterFunc(d, func() {
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			flushed, err = true, rw.flush()
		}
	})
	return func() (bool, error) {
		t.Stop()
		mu.Lock()
		defer mu.Unlock()
		stopped = true
		return flushed, err
	}
}

func (rw *relayWriter) firstToken() {
	if f := rw.onFirst; f != nil {
		rw.onFirst = nil
		f()
	}
}

// relayEvents copies an event stream line by line. It flushes before any
// read that may block while something is unflushed (whatever was written
// since the last flush; a read of what the engine's connection holds
// already does not block): events that arrived together leave in one
// write, the stream's last with its end, as a plain proxy would relay
// them, and none waits for the next. The
// headers wait for the first bytes of the body, holdHeaders at most.
// Data lines of a 2xx stream are inspected for the first generated text
// and for usage; a chunk is only decoded while no text has been seen, or
// when it carries usage or a finish reason, so the hot path of token
// chunks does not allocate.
func (rw *relayWriter) relayEvents(body io.Reader, usage *usageTracker, inspect bool) error {
	lr := pooledLineReader(body)
	defer lr.release()
	dirty := true         // the headers are not flushed yet
	firstPending := false // an unflushed event carries the first text
	firstSeen := false    // the first text has been seen
	buffered, _ := body.(interface{ Buffered() int })
	if buffered != nil && buffered.Buffered() > 0 {
		// The body came with the header (a short answer, a fast engine):
		// no wait, so no timer to flush the header meanwhile.
		lr.fill()
	} else {
		stop := rw.flushAfter(holdHeaders)
		lr.fill() // a read error comes again from next
		if flushed, err := stop(); err != nil {
			return err
		} else if flushed {
			dirty = false
		}
	}
	for {
		if dirty && !lr.lineBuffered() && !lr.ended() && (buffered == nil || buffered.Buffered() == 0) {
			if err := rw.flush(); err != nil {
				return err
			}
			dirty = false
			if firstPending {
				firstPending = false
				rw.firstToken()
			}
		}
		line, rerr := lr.next()
		if len(line) > 0 {
			if inspect {
				if data, ok := dataPayload(line); ok && !bytes.Equal(data, doneMarker) {
					if rw.onFirst != nil && !firstSeen {
						firstSeen = usage.firstChunk(data)
					} else {
						usage.observe(data)
					}
					if patched, ok := rw.rewrite(data); ok {
						line = append(append([]byte("data: "), patched...), '\n')
					}
				}
			}
			if err := rw.write(line); err != nil {
				return err
			}
			dirty = true
			if isBlank(line) && firstSeen && rw.onFirst != nil {
				firstPending = true
			}
		}
		if rerr == io.EOF {
			if err := rw.end(dirty); err != nil {
				return err
			}
			if firstSeen {
				rw.firstToken()
			}
			return nil
		}
		if rerr != nil {
			return fmt.Errorf("reading engine response: %w", rerr)
		}
	}
}

// relayBody copies a whole (non-streamed) response as it comes, keeping up
// to maxUsageBody of a 2xx body to read its usage at the end.
func (rw *relayWriter) relayBody(body io.Reader, usage *usageTracker, inspect bool) error {
	if inspect && (rw.cached != nil || rw.model != "") {
		// The usage comes last, the model anywhere: keep the response
		// (sent whole once generated anyway) to rewrite it.
		b, err := io.ReadAll(io.LimitReader(body, maxUsageBody+1))
		if err != nil {
			return fmt.Errorf("reading engine response: %w", err)
		}
		if len(b) <= maxUsageBody {
			var c chunkJSON
			if json.Unmarshal(b, &c) == nil {
				usage.take(&c)
			}
			b, _ = rw.rewrite(b)
			if err := rw.write(b); err != nil {
				return err
			}
			rw.firstToken()
			return rw.end(true)
		}
		body = io.MultiReader(bytes.NewReader(b), body)
		inspect = false
	}
	var kept bytes.Buffer
	buf := make([]byte, 32<<10)
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if err := rw.write(buf[:n]); err != nil {
				return err
			}
			rw.firstToken()
			if inspect && kept.Len()+n <= maxUsageBody {
				kept.Write(buf[:n])
			} else {
				inspect = false
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return fmt.Errorf("reading engine response: %w", rerr)
		}
	}
	if err := rw.end(true); err != nil {
		return err
	}
	if inspect {
		var c chunkJSON
		if json.Unmarshal(kept.Bytes(), &c) == nil {
			usage.take(&c)
		}
	}
	return nil
}

var _ engine.Proxier = (*Client)(nil)

// withModel returns data, a JSON object, with the value of its top-level
// "model" key replaced by model, and the rest of its bytes as they were;
// false if data is not an object or has no such key.
func withModel(data []byte, model string) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return data, false
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return data, false
		}
		afterKey := int(dec.InputOffset())
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return data, false
		}
		if key, _ := t.(string); key != "model" {
			continue
		}
		end := int(dec.InputOffset())
		start := afterKey + skipSpace(data[afterKey:])
		if start >= end || data[start] != ':' {
			return data, false
		}
		start++
		start += skipSpace(data[start:end])
		name, err := json.Marshal(model)
		if err != nil {
			return data, false
		}
		out := make([]byte, 0, len(data)-(end-start)+len(name))
		out = append(out, data[:start]...)
		out = append(out, name...)
		return append(out, data[end:]...), true
	}
	return data, false
}
