package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Outcomes of one request, as the client saw it.
const (
	outOK        = "ok"
	outCut       = "cut"         // the client closed the stream after the first token, on purpose
	outRejected  = "429"         // overloaded, with Retry-After
	outNoWorker  = "503"         // HTTP 503 (no worker, or interrupted before any byte)
	outHTTP      = "http_error"  // any other non-200 status
	outStreamErr = "error_event" // the stream ended with an error event
	outTruncated = "truncated"   // the stream ended without [DONE] nor an error event
	outConn      = "conn_error"  // no response: connection errors on every replica
	outHang      = "hang"        // the client's deadline passed
	outBad       = "bad_body"    // a 200 whose body does not parse
	outWrong     = "wrong_text"  // a completion whose text is not the one the same request gets without the fault
)

// result is one request's end.
type result struct {
	start, end time.Time
	stream     bool
	kind       string // "steady", "cut", "burst"
	outcome    string
	detail     string // error message or code, for the notes
	tries      int    // connection attempts (replicas tried)
	text       string // the completion's text, if the client keeps it
}

func (r *result) latency() time.Duration { return r.end.Sub(r.start) }

// recorder keeps every result; sent counts requests begun, so that a
// request that never ends is visible as sent − len(results).
type recorder struct {
	sent atomic.Int64
	mu   sync.Mutex
	res  []result
}

func (r *recorder) add(res result) {
	r.mu.Lock()
	r.res = append(r.res, res)
	r.mu.Unlock()
}

func (r *recorder) snapshot() []result {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.res)
}

// client sends chat completions to the replicas in turn, moving to the
// next on a connection error (nothing answered): what a client behind a
// load balancer sees. A client of one URL (a load balancer's) tries each
// request once.
type client struct {
	hc       *http.Client
	bases    []string
	model    string
	deadline time.Duration // per request; past it the request is a hang
	next     atomic.Uint64
	rec      *recorder
	// prompts, if positive, is how many distinct prompts the client
	// sends (the question numbers repeat); else every one is new.
	prompts int
	// keepText keeps each completion's text in its result.
	keepText bool
}

func newClient(bases []string, model string, deadline time.Duration, conns int, rec *recorder) *client {
	tr := &http.Transport{
		MaxIdleConnsPerHost: conns, DisableCompression: true,
		DialContext: (&net.Dialer{Timeout: time.Second}).DialContext,
	}
	return &client{hc: &http.Client{Transport: tr}, bases: bases, model: model, deadline: deadline, rec: rec}
}

func (c *client) close() { c.hc.CloseIdleConnections() }

// docs are shared prefixes: 16 documents of about 2,400 characters (600
// tokens at the simulator's 4 a token, over min_remote_prefill_tokens, so
// that prefill runs on a prefill worker and the blocks move).
var docs = func() []string {
	words := strings.Fields("the scheduler routes each request to the worker that holds its prefix so that prefill is cheap and the fleet stays balanced under load while blocks move between tiers")
	out := make([]string, 16)
	for i := range out {
		r := rand.New(rand.NewPCG(uint64(i), 7))
		var b strings.Builder
		fmt.Fprintf(&b, "Document %d. ", i)
		for b.Len() < 2400 {
			b.WriteString(words[r.IntN(len(words))])
			b.WriteByte(' ')
		}
		out[i] = b.String()
	}
	return out
}()

var reqSeq atomic.Uint64

// body is a chat completion over one of docs with a question of its own.
func (c *client) body(r *rand.Rand, stream bool, maxTokens int) []byte {
	n := reqSeq.Add(1)
	if c.prompts > 0 {
		n %= uint64(c.prompts)
	}
	prompt := docs[r.IntN(len(docs))] + fmt.Sprintf("\nQuestion %d: summarize the above in a few words.", n)
	b, _ := json.Marshal(map[string]any{
		"model": c.model, "stream": stream, "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": prompt}},
	})
	return b
}

// freshBody is a chat completion over a document nobody sent before, of
// 2,400 characters (600 tokens, over min_remote_prefill_tokens): no
// worker holds any of it, so its prefill runs on a prefill worker and all
// its blocks are pushed to the decode worker.
func (c *client) freshBody(r *rand.Rand, stream bool, maxTokens int) []byte {
	words := strings.Fields("blocks move from the prefill worker to the decode worker over the link and each one carries a checksum of its own")
	var b strings.Builder
	fmt.Fprintf(&b, "Fresh document %d. ", reqSeq.Add(1))
	for b.Len() < 2400 {
		b.WriteString(words[r.IntN(len(words))])
		b.WriteByte(' ')
	}
	b.WriteString("\nQuestion: what moves?")
	out, _ := json.Marshal(map[string]any{
		"model": c.model, "stream": stream, "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": b.String()}},
	})
	return out
}

// do sends body and reads the answer to its end (cut: to the first
// token), recording the result.
func (c *client) do(ctx context.Context, kind string, body []byte, stream, cut bool) result {
	return c.doCheck(ctx, kind, body, stream, cut, nil)
}

// doCheck is do for a request whose completion must be *want, if want is
// not nil: another text is a wrong outcome (outWrong).
func (c *client) doCheck(ctx context.Context, kind string, body []byte, stream, cut bool, want *string) result {
	c.rec.sent.Add(1)
	res := result{start: time.Now(), stream: stream, kind: kind}
	ctx, cancel := context.WithTimeout(ctx, c.deadline)
	defer cancel()
	c.send(ctx, body, stream, cut, c.keepText || want != nil, &res)
	res.end = time.Now()
	if res.outcome != outOK && res.outcome != outCut && ctx.Err() == context.DeadlineExceeded {
		res.outcome, res.detail = outHang, "no end within "+c.deadline.String()+" ("+res.detail+")"
	}
	if want != nil && res.outcome == outOK && res.text != *want {
		res.outcome, res.detail = outWrong, fmt.Sprintf("%q, where the same request gave %q", clip(res.text, 40), clip(*want, 40))
	}
	c.rec.add(res)
	return res
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

func (c *client) send(ctx context.Context, body []byte, stream, cut, keep bool, res *result) {
	var resp *http.Response
	first := c.next.Add(1)
	tries := 2 * len(c.bases)
	if len(c.bases) == 1 {
		tries = 1
	}
	for try := range tries {
		res.tries = try + 1
		base := c.bases[(int(first)+try)%len(c.bases)]
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
		if err != nil {
			res.outcome, res.detail = outConn, err.Error()
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err = c.hc.Do(req)
		if err == nil {
			break
		}
		res.outcome, res.detail = outConn, err.Error()
		if ctx.Err() != nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	if resp == nil {
		return
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusTooManyRequests:
		res.outcome, res.detail = outRejected, errorMessage(resp.Body)
		return
	case http.StatusServiceUnavailable:
		res.outcome, res.detail = outNoWorker, errorMessage(resp.Body)
		return
	default:
		res.outcome, res.detail = outHTTP, fmt.Sprintf("HTTP %d: %s", resp.StatusCode, errorMessage(resp.Body))
		return
	}
	if !stream {
		var v struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			res.outcome, res.detail = outBad, err.Error()
			if ctx.Err() != nil {
				res.outcome = outTruncated
			}
			return
		}
		if len(v.Choices) == 0 || v.Choices[0].Message.Content == "" {
			res.outcome, res.detail = outBad, "no content"
			return
		}
		if keep {
			res.text = v.Choices[0].Message.Content
		}
		res.outcome = outOK
		return
	}
	var text strings.Builder
	br := bufio.NewReader(resp.Body)
	tokens := 0
	for {
		line, err := br.ReadBytes('\n')
		if err != nil {
			res.outcome, res.detail = outTruncated, fmt.Sprintf("after %d chunks: %v", tokens, err)
			return
		}
		data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			if tokens == 0 {
				res.outcome, res.detail = outBad, "[DONE] without content"
				return
			}
			if keep {
				res.text = text.String()
			}
			res.outcome = outOK
			return
		}
		var ev struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Error *struct {
				Message string `json:"message"`
				Code    any    `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			res.outcome, res.detail = outBad, err.Error()
			return
		}
		if ev.Error != nil {
			res.outcome, res.detail = outStreamErr, fmt.Sprintf("%v: %s", ev.Error.Code, ev.Error.Message)
			return
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
			tokens++
			if keep {
				text.WriteString(ev.Choices[0].Delta.Content)
			}
			if cut {
				res.outcome = outCut
				return // the deferred Close cuts the stream
			}
		}
	}
}

// errorMessage reads an OpenAI error body's message (or its first bytes).
func errorMessage(r io.Reader) string {
	b, _ := io.ReadAll(io.LimitReader(r, 2048))
	var v struct {
		Error struct {
			Message string `json:"message"`
			Code    any    `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &v) == nil && v.Error.Message != "" {
		if v.Error.Code != nil {
			return fmt.Sprintf("%v: %s", v.Error.Code, v.Error.Message)
		}
		return v.Error.Message
	}
	return string(bytes.TrimSpace(b))
}

// loop sends requests one after another until ctx ends: half streamed,
// max_tokens 16–64.
func (c *client) loop(ctx context.Context, seed uint64, kind string, wg *sync.WaitGroup) {
	defer wg.Done()
	r := rand.New(rand.NewPCG(seed, 1))
	for ctx.Err() == nil {
		stream := r.IntN(2) == 0
		// A request started is finished even when ctx ends: cutting it
		// would count as the client's own failure.
		c.do(context.WithoutCancel(ctx), kind, c.body(r, stream, 16+r.IntN(49)), stream, false)
	}
}
