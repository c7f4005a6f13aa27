package httpengine

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/batonllm/baton/workers/engine"
)

// scriptedEngine is an engine on a raw socket: it reads each request with
// http.ReadRequest, records it, and writes the next of its answers byte
// for byte, so that a test chooses every framing an engine's server may
// use. It closes a connection after an answer whose close is set.
type scriptedEngine struct {
	t       *testing.T
	ln      net.Listener
	answers []scripted

	mu    sync.Mutex
	next  int
	conns int
	reqs  []*http.Request
	bods  []string
}

type scripted struct {
	raw   string
	close bool // close the connection after writing raw
}

func startScripted(t *testing.T, answers ...scripted) *scriptedEngine {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &scriptedEngine{t: t, ln: ln, answers: answers}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.conns++
			e.mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				e.serve(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		wg.Wait()
	})
	return e
}

func (e *scriptedEngine) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		r, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		b, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		e.reqs = append(e.reqs, r)
		e.bods = append(e.bods, string(b))
		a := e.answers[e.next%len(e.answers)]
		e.next++
		e.mu.Unlock()
		if _, err := io.WriteString(c, a.raw); err != nil || a.close {
			return
		}
	}
}

func (e *scriptedEngine) url() string { return "http://" + e.ln.Addr().String() }

func (e *scriptedEngine) connCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.conns
}

// TestPostFramings relays answers in every framing an HTTP/1.x engine may
// use, twice each, and checks the body, the status and whether the
// connection was kept: reused when the framing ends the body before the
// connection, not when the connection's end is the body's.
func TestPostFramings(t *testing.T) {
	const events = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"
	for _, tc := range []struct {
		name     string
		answer   scripted
		status   int
		body     string
		reused   bool
		errMatch string // Proxy fails with this in its error
	}{
		{name: "chunked", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
				chunk(events[:20]) + chunk(events[20:]) + "0\r\n\r\n"}},
		{name: "chunked with trailers and extensions", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: Chunked\r\n\r\n" +
				strings.Replace(chunk(events), "\r\n", ";ext=1\r\n", 1) + "0\r\nX-Trailer: a\r\nX-Other: b\r\n\r\n"}},
		{name: "content-length", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: " + itoa(len(events)) + "\r\n\r\n" + events}},
		{name: "LF line ends, no reason", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 200\nContent-Type: text/event-stream\nContent-Length: " + itoa(len(events)) + "\n\n" + events}},
		{name: "interim answers first", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" +
				"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: " + itoa(len(events)) + "\r\n\r\n" + events}},
		{name: "HTTP/1.0 to the close", status: 200, body: events, reused: false,
			answer: scripted{raw: "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + events, close: true}},
		{name: "HTTP/1.0 keep-alive", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Type: text/event-stream\r\nContent-Length: " + itoa(len(events)) + "\r\n\r\n" + events}},
		{name: "Connection: close", status: 200, body: events, reused: false,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: text/event-stream\r\nContent-Length: " + itoa(len(events)) + "\r\n\r\n" + events, close: true}},
		{name: "no framing on 1.1: to the close", status: 200, body: events, reused: false,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + events, close: true}},
		{name: "chunked overrides Content-Length", status: 200, body: events, reused: true,
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n" + chunk(events) + "0\r\n\r\n"}},
		{name: "client error relayed", status: 400, body: `{"error":{"message":"bad"}}`, reused: true,
			answer: scripted{raw: "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 27\r\n\r\n{\"error\":{\"message\":\"bad\"}}"}},
		{name: "malformed status line", errMatch: "malformed",
			answer: scripted{raw: "HTTP/2 200 OK\r\n\r\n", close: true}},
		{name: "unsupported transfer coding", errMatch: "Transfer-Encoding",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", close: true}},
		{name: "conflicting lengths", errMatch: "Content-Length",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", close: true}},
		{name: "folded header", errMatch: "malformed",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n folded\r\n\r\n", close: true}},
		{name: "head cut short", errMatch: "unexpected EOF",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Ty", close: true}},
		{name: "body cut short", status: 200, errMatch: "unexpected EOF",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\":", close: true}},
		{name: "chunked body cut short", status: 200, errMatch: "unexpected EOF",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(events), close: true}},
		{name: "endless interim answers", errMatch: "interim",
			answer: scripted{raw: strings.Repeat("HTTP/1.1 100 Continue\r\n\r\n", 10), close: true}},
		{name: "head too large", errMatch: "too large",
			answer: scripted{raw: "HTTP/1.1 200 OK\r\nX-Big: " + strings.Repeat("a", 20<<10) + "\r\n\r\n", close: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := startScripted(t, tc.answer)
			c, err := New(e.url())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if c.target == nil {
				t.Fatal("an http engine is not reached by post")
			}
			for i := range 2 {
				rec := newRecorder()
				res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{"stream":true}`)}, rec, nil)
				if tc.errMatch != "" {
					if err == nil || !strings.Contains(err.Error(), tc.errMatch) {
						t.Fatalf("request %d: Proxy error = %v, want one naming %q", i, err, tc.errMatch)
					}
					if !res.Written && !errors.Is(err, engine.ErrUnavailable) {
						t.Errorf("request %d: an unanswered request's error %v is not ErrUnavailable", i, err)
					}
					if tc.status != 0 && res.Status != tc.status {
						t.Errorf("request %d: status %d, want %d", i, res.Status, tc.status)
					}
					continue
				}
				if err != nil {
					t.Fatalf("request %d: Proxy: %v", i, err)
				}
				if res.Status != tc.status || rec.Code != tc.status {
					t.Errorf("request %d: status %d (relayed %d), want %d", i, res.Status, rec.Code, tc.status)
				}
				if got := rec.Body.String(); got != tc.body {
					t.Errorf("request %d: body %q, want %q", i, got, tc.body)
				}
			}
			if tc.errMatch != "" {
				return
			}
			want := 2
			if tc.reused {
				want = 1
			}
			if got := e.connCount(); got != want {
				t.Errorf("two requests took %d connections, want %d", got, want)
			}
		})
	}
}

// TestPostRequestHead checks what an engine receives: the base URL's path
// before the request's, the JSON body with its length, and the headers a
// request carries (its id, the API key, the data-parallel rank), a
// request id with line breaks unable to add a header.
func TestPostRequestHead(t *testing.T) {
	e := startScripted(t, scripted{raw: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"})
	c, err := New(e.url()+"/engine/", WithAPIKey("sk-1"), WithDataParallelRank(3))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"model":"m","messages":[]}`
	for _, id := range []string{"req-1", "req-2\r\nX-Injected: 1"} {
		if _, err := c.Proxy(testContext(t), &engine.Request{ID: id, Path: "/v1/chat/completions", Body: []byte(body)}, newRecorder(), nil); err != nil {
			t.Fatal(err)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.reqs) != 2 {
		t.Fatalf("engine got %d requests, want 2", len(e.reqs))
	}
	for i, r := range e.reqs {
		if r.Method != http.MethodPost || r.RequestURI != "/engine/v1/chat/completions" || r.Proto != "HTTP/1.1" {
			t.Errorf("request %d: %s %s %s", i, r.Method, r.RequestURI, r.Proto)
		}
		if r.Host != e.ln.Addr().String() {
			t.Errorf("request %d: Host %q, want %q", i, r.Host, e.ln.Addr().String())
		}
		if e.bods[i] != body || r.ContentLength != int64(len(body)) {
			t.Errorf("request %d: body %q of length %d", i, e.bods[i], r.ContentLength)
		}
		for k, v := range map[string]string{
			"Content-Type":  "application/json",
			"Authorization": "Bearer sk-1",
			HeaderDPRank:    "3",
		} {
			if got := r.Header.Get(k); got != v {
				t.Errorf("request %d: %s %q, want %q", i, k, got, v)
			}
		}
		if got := r.Header.Get("X-Injected"); got != "" {
			t.Errorf("request %d: a request id added a header X-Injected: %q", i, got)
		}
	}
	if got := e.reqs[0].Header.Get("X-Request-Id"); got != "req-1" {
		t.Errorf("X-Request-Id %q", got)
	}
	if _, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/chat completions", Body: []byte(body)}, newRecorder(), nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("a path with a space: %v, want ErrInvalid", err)
	}
}

// FuzzResponseHead feeds arbitrary bytes to the response head reader: it
// never panics, and where net/http reads the same head as a response with
// a body it agrees on the status and the Content-Type.
func FuzzResponseHead(f *testing.F) {
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"))
	f.Add([]byte("HTTP/1.0 503 Service Unavailable\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nbusy!"))
	f.Add([]byte("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200\nContent-Length: 0\n\n"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		var h responseHead
		err := h.read(bufio.NewReaderSize(bytes.NewReader(raw), 4096))
		if err != nil {
			return
		}
		if h.status < 100 || h.status > 999 {
			t.Fatalf("status %d accepted", h.status)
		}
		if h.chunked && h.length != -1 {
			t.Fatalf("chunked with a length %d", h.length)
		}
		resp, nerr := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
		if nerr != nil || resp.StatusCode < 200 {
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != h.status {
			t.Fatalf("status %d, net/http read %d", h.status, resp.StatusCode)
		}
		if ct := resp.Header.Get("Content-Type"); ct != h.contentType && !strings.ContainsAny(ct, " \t") {
			t.Fatalf("Content-Type %q, net/http read %q", h.contentType, ct)
		}
	})
}

func chunk(s string) string { return strconv.FormatInt(int64(len(s)), 16) + "\r\n" + s + "\r\n" }

func itoa(n int) string { return strconv.Itoa(n) }
