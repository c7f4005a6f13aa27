package h1serve

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// start serves h on a loopback port and returns its address.
func start(t *testing.T, s *Server) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve returned %v, want http.ErrServerClosed", err)
		}
	})
	return l.Addr().String()
}

// rawConn dials addr and returns the connection and a reader of it.
func rawConn(t *testing.T, addr string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c, bufio.NewReader(c)
}

func readResponse(t *testing.T, br *bufio.Reader, method string) (*http.Response, string) {
	t.Helper()
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("reading a response: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading a response's body: %v", err)
	}
	return resp, string(b)
}

func echo(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.Path, b)
}

// TestKeepAliveWithNetHTTPClient: net/http's client reuses one connection
// for requests with Content-Length, chunked and empty bodies, and reads a
// short body by its Content-Length and a flushed one chunked.
func TestKeepAliveWithNetHTTPClient(t *testing.T) {
	var conns atomic.Int32
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", echo)
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
		}
	})
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(strings.Repeat("b", 10000)))
	})
	addr := start(t, &Server{Handler: mux, ConnState: func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	url := "http://" + addr
	for i, tc := range []struct {
		method, path string
		body         io.Reader
		want         string
		chunked      bool
	}{
		{"POST", "/echo", strings.NewReader("hello"), "POST /echo hello", false},
		{"POST", "/echo", io.MultiReader(strings.NewReader("chun"), strings.NewReader("ked")), "POST /echo chunked", false},
		{"GET", "/echo", nil, "GET /echo ", false},
		{"GET", "/stream", nil, "data: 0\n\ndata: 1\n\ndata: 2\n\n", true},
		{"GET", "/big", nil, strings.Repeat("b", 10000), true},
		{"POST", "/echo", strings.NewReader("again"), "POST /echo again", false},
	} {
		req, _ := http.NewRequest(tc.method, url+tc.path, tc.body)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(b) != tc.want {
			t.Errorf("request %d: body %q (%v), want %q", i, b, err, tc.want)
		}
		if chunked := len(resp.TransferEncoding) > 0; chunked != tc.chunked {
			t.Errorf("request %d: chunked %v, want %v (Content-Length %d)", i, chunked, tc.chunked, resp.ContentLength)
		}
		if resp.Header.Get("Date") == "" {
			t.Errorf("request %d: no Date header", i)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

// TestRefusals: what the server answers itself, as net/http's does.
func TestRefusals(t *testing.T) {
	addr := start(t, &Server{Handler: http.HandlerFunc(echo), MaxHeaderBytes: 1 << 10})
	for _, tc := range []struct {
		name, req string
		status    int
	}{
		{"headers over the limit", "GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + strings.Repeat("p", 8<<10) + "\r\n\r\n", 431},
		{"a malformed request line", "GET\r\n\r\n", 400},
		{"no Host in HTTP/1.1", "GET / HTTP/1.1\r\n\r\n", 400},
		{"two Host headers", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
		{"an Expect other than 100-continue", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: something\r\n\r\nabc", 417},
		{"HTTP/2's preface", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, br := rawConn(t, addr)
			io.WriteString(c, tc.req)
			resp, _ := readResponse(t, br, "GET")
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d", resp.StatusCode, tc.status)
			}
			if !resp.Close {
				t.Errorf("the connection stays open after a %d", resp.StatusCode)
			}
		})
	}
}

// TestExpectContinue: a client that waits for 100 Continue gets it when
// the handler reads the body, and not when the handler answers without
// reading it.
func TestExpectContinue(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", echo)
	mux.HandleFunc("/refuse", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "no", http.StatusForbidden) })
	addr := start(t, &Server{Handler: mux})
	c, br := rawConn(t, addr)
	io.WriteString(c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
		t.Fatalf("first line %q (%v), want 100 Continue", line, err)
	}
	if blank, _ := br.ReadString('\n'); blank != "\r\n" {
		t.Fatalf("after 100 Continue: %q", blank)
	}
	io.WriteString(c, "hello")
	if resp, body := readResponse(t, br, "POST"); resp.StatusCode != 200 || body != "POST /echo hello" {
		t.Errorf("status %d body %q", resp.StatusCode, body)
	}

	c, br = rawConn(t, addr)
	io.WriteString(c, "POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
	resp, _ := readResponse(t, br, "POST")
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("status %d, want 403 without a 100 first", resp.StatusCode)
	}
	if !resp.Close {
		t.Error("the connection stays open though the body it asked to send was never read")
	}
}

// TestHTTP10AndHead: an HTTP/1.0 client's connection closes after a body
// of unknown length, unless it asked to keep it; HEAD gets no body.
func TestHTTP10AndHead(t *testing.T) {
	addr := start(t, &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/flush" {
			io.WriteString(w, "part")
			w.(http.Flusher).Flush()
		}
		io.WriteString(w, "body")
	})})
	c, br := rawConn(t, addr)
	io.WriteString(c, "GET /flush HTTP/1.0\r\n\r\n")
	resp, body := readResponse(t, br, "GET")
	if body != "partbody" || len(resp.TransferEncoding) > 0 || !resp.Close {
		t.Errorf("HTTP/1.0, flushed: body %q, chunked %v, close %v; want partbody, close-delimited", body, resp.TransferEncoding, resp.Close)
	}
	if _, err := br.ReadByte(); err != io.EOF {
		t.Errorf("after a close-delimited body: %v, want EOF", err)
	}

	c, br = rawConn(t, addr)
	io.WriteString(c, "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
	resp, body = readResponse(t, br, "GET")
	if body != "body" || resp.Close || resp.Header.Get("Connection") != "keep-alive" {
		t.Errorf("HTTP/1.0 keep-alive: body %q close %v Connection %q", body, resp.Close, resp.Header.Get("Connection"))
	}
	io.WriteString(c, "HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, body = readResponse(t, br, "HEAD")
	if body != "" || resp.StatusCode != 200 {
		t.Errorf("HEAD: status %d body %q", resp.StatusCode, body)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body = readResponse(t, br, "GET"); body != "body" {
		t.Errorf("GET after HEAD on one connection: body %q", body)
	}
}

// TestUnreadBody: a body the handler leaves is read and dropped when short,
// and the connection closed when long.
func TestUnreadBody(t *testing.T) {
	addr := start(t, &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "ignored")
	})})
	c, br := rawConn(t, addr)
	fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789")
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	for i := range 2 {
		if resp, body := readResponse(t, br, "GET"); body != "ignored" || resp.Close {
			t.Errorf("request %d: body %q close %v", i, body, resp.Close)
		}
	}
	// A long body left unread: the answer says the connection closes, and
	// the client reads it whole though it was still sending (no reset).
	for range 10 {
		c, br = rawConn(t, addr)
		fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 2<<20)
		go c.Write(make([]byte, 2<<20))
		resp, body := readResponse(t, br, "POST")
		if body != "ignored" || !resp.Close {
			t.Errorf("after a 2 MiB body left unread: body %q, close %v; want the answer and the connection closing", body, resp.Close)
		}
		if _, err := io.Copy(io.Discard, br); err != nil {
			t.Errorf("after a 2 MiB body left unread: %v, want the connection closed cleanly", err)
		}
	}
}

// TestClientGoneCancels: a client that closes or resets its connection
// while its request runs cancels the request's context, whether the
// server's epoll set follows the connection or the watcher's ticks start
// a read of it.
func TestClientGoneCancels(t *testing.T) {
	for _, tc := range []struct {
		name        string
		tick, reset bool
	}{{"epoll/close", false, false}, {"epoll/reset", false, true}, {"tick/close", true, false}, {"tick/reset", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			started := make(chan struct{})
			cancelled := make(chan error, 1)
			s := &Server{WatchDelay: time.Microsecond, tickWatch: tc.tick, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				close(started)
				select {
				case <-r.Context().Done():
					cancelled <- r.Context().Err()
				case <-time.After(10 * time.Second):
					cancelled <- errors.New("not cancelled within 10s")
				}
			})}
			addr := start(t, s)
			c, _ := rawConn(t, addr)
			io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
			<-started
			if tc.reset {
				c.(*net.TCPConn).SetLinger(0)
			}
			c.Close()
			if err := <-cancelled; !errors.Is(err, context.Canceled) {
				t.Errorf("the request's context: %v, want context.Canceled", err)
			}
			if followed := s.hups != nil; followed == tc.tick {
				t.Errorf("followed by the epoll set: %v, want %v", followed, !tc.tick)
			}
		})
	}
}

// TestFollowedRequestsStartNoWatcher: where the epoll set follows the
// connections, requests start no watcher (whose ticks would wake a thread
// a hundred times a second) and no watch's read.
func TestFollowedRequestsStartNoWatcher(t *testing.T) {
	s := &Server{Handler: http.HandlerFunc(echo)}
	s.watchHook = func() { t.Error("a watch read the connection") }
	addr := start(t, s)
	c, br := rawConn(t, addr)
	for range 20 {
		io.WriteString(c, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
		readResponse(t, br, "POST")
	}
	s.watcher.mu.Lock()
	running := s.watcher.running
	s.watcher.mu.Unlock()
	if running || s.hups == nil {
		t.Errorf("watcher running %v, epoll set %v; want no watcher and the set", running, s.hups != nil)
	}
}

// TestPipelinedWhileWatched: a request sent while the previous one runs
// (its connection watched) is served after it, whole.
func TestPipelinedWhileWatched(t *testing.T) {
	for _, tick := range []bool{false, true} {
		t.Run(fmt.Sprintf("tick=%v", tick), func(t *testing.T) {
			release := make(chan struct{})
			var n atomic.Int32
			s := &Server{WatchDelay: time.Microsecond, tickWatch: tick}
			watching := make(chan struct{}, 1)
			s.watchHook = func() { watching <- struct{}{} }
			running := make(chan struct{})
			s.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if n.Add(1) == 1 {
					close(running)
					<-release
				}
				echo(w, r)
			})
			addr := start(t, s)
			c, br := rawConn(t, addr)
			io.WriteString(c, "GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
			<-running
			if tick {
				<-watching
			}
			io.WriteString(c, "GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
			close(release)
			for _, want := range []string{"GET /one ", "GET /two "} {
				if _, body := readResponse(t, br, "GET"); body != want {
					t.Errorf("body %q, want %q", body, want)
				}
			}
		})
	}
}

// TestShutdown: Shutdown closes idle connections at once, lets a running
// request finish (its connection closed after it), and returns ctx's
// error while one runs past it.
func TestShutdown(t *testing.T) {
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	accepted := make(chan struct{}, 8)
	s := &Server{ConnState: func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			accepted <- struct{}{}
		}
	}, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			started <- struct{}{}
			<-release
		}
		io.WriteString(w, "done")
	})}
	addr := start(t, s)
	idle, idleBR := rawConn(t, addr)
	io.WriteString(idle, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	readResponse(t, idleBR, "GET")
	busy, busyBR := rawConn(t, addr)
	io.WriteString(busy, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
	<-started

	fresh, freshBR := rawConn(t, addr) // connected, nothing sent yet
	for range 3 {
		<-accepted
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Shutdown(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Shutdown with a request running and ctx done: %v, want context.Canceled", err)
	}
	if _, err := idleBR.ReadByte(); err != io.EOF {
		t.Errorf("the idle connection: %v, want EOF", err)
	}
	if _, err := net.Dial("tcp", addr); err == nil {
		t.Error("a new connection was accepted after Shutdown")
	}
	// A connection made just before Shutdown still has its request
	// answered, and closes after it.
	io.WriteString(fresh, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp, body := readResponse(t, freshBR, "GET"); body != "done" || !resp.Close {
		t.Errorf("a request on a connection made before Shutdown: body %q close %v, want done and close", body, resp.Close)
	}
	done := make(chan error, 1)
	go func() { done <- s.Shutdown(context.Background()) }()
	close(release)
	resp, body := readResponse(t, busyBR, "GET")
	if body != "done" || !resp.Close {
		t.Errorf("the running request: body %q close %v, want done and close", body, resp.Close)
	}
	if err := <-done; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}

// TestPanicClosesConnection: a handler's panic closes its connection and
// no other.
func TestPanicClosesConnection(t *testing.T) {
	addr := start(t, &Server{ErrorLog: discardLogger(), Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/panic" {
			panic("boom")
		}
		io.WriteString(w, "ok")
	})})
	c, br := rawConn(t, addr)
	io.WriteString(c, "GET /panic HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, err := http.ReadResponse(br, nil); err == nil {
		t.Error("a response after a panic")
	}
	c, br = rawConn(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body := readResponse(t, br, "GET"); body != "ok" {
		t.Errorf("after a panic elsewhere: %q", body)
	}
}

// TestDeadlinesOfOneRequestEnd: read and write deadlines a handler sets
// do not outlive its request on a kept connection.
func TestDeadlinesOfOneRequestEnd(t *testing.T) {
	var n atomic.Int32
	addr := start(t, &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) > 1 {
			io.WriteString(w, "second")
			return
		}
		w.Header().Set("Content-Length", "5")
		io.WriteString(w, "first")
		rc := http.NewResponseController(w)
		rc.Flush()
		// Expired: a connection that kept them could neither read the
		// next request nor answer it.
		if err := rc.SetWriteDeadline(time.Unix(1, 0)); err != nil {
			t.Errorf("SetWriteDeadline: %v", err)
		}
		if err := rc.SetReadDeadline(time.Unix(1, 0)); err != nil {
			t.Errorf("SetReadDeadline: %v", err)
		}
	})})
	c, br := rawConn(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body := readResponse(t, br, "GET"); body != "first" {
		t.Fatalf("the first request's body %q", body)
	}
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if _, body := readResponse(t, br, "GET"); body != "second" {
		t.Errorf("the second request's body %q", body)
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// TestEndBody: a handler that ends its body early (EndBody) has its
// answer, the flushed part and the rest with the body's end, reach the
// client before it returns, and cannot write after it.
func TestEndBody(t *testing.T) {
	for _, flushFirst := range []bool{true, false} {
		answered := make(chan struct{})
		after := make(chan error, 1)
		addr := start(t, &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "data: one\n\n")
			if flushFirst {
				w.(http.Flusher).Flush()
			}
			io.WriteString(w, "data: two\n\n")
			if err := w.(interface{ EndBody() error }).EndBody(); err != nil {
				after <- err
				return
			}
			<-answered // the client has the whole body while the handler runs
			_, err := io.WriteString(w, "more")
			after <- err
		})})
		c, br := rawConn(t, addr)
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, body := readResponse(t, br, http.MethodGet)
		close(answered)
		if body != "data: one\n\ndata: two\n\n" {
			t.Errorf("flushed first %v: body %q", flushFirst, body)
		}
		if chunked := len(resp.TransferEncoding) > 0; chunked != flushFirst {
			t.Errorf("flushed first %v: chunked %v, want %v (a body ended unflushed has a Content-Length)", flushFirst, chunked, flushFirst)
		}
		if err := <-after; !errors.Is(err, ErrBodyEnded) {
			t.Errorf("flushed first %v: a write after EndBody: %v, want ErrBodyEnded", flushFirst, err)
		}
	}
}

// TestHeaderOfOneRequestEnds: the header map a connection's requests share
// starts empty for each, so a header set for one response is not sent
// with the next.
func TestHeaderOfOneRequestEnds(t *testing.T) {
	var n atomic.Int32
	addr := start(t, &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(w.Header()) != 0 {
			t.Errorf("request %d: the header starts with %v", n.Load()+1, w.Header())
		}
		if n.Add(1) == 1 {
			w.Header().Set("X-First", "1")
		}
		io.WriteString(w, "ok")
	})})
	c, br := rawConn(t, addr)
	for i := range 2 {
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, _ := readResponse(t, br, "GET")
		if got, want := resp.Header.Get("X-First"), map[int]string{0: "1", 1: ""}[i]; got != want {
			t.Errorf("response %d: X-First %q, want %q", i, got, want)
		}
	}
}

// TestRequestTimeout: with RequestTimeout set, each request's context
// ends that long after its head was read, with DeadlineExceeded.
func TestRequestTimeout(t *testing.T) {
	const d = time.Hour
	addr := start(t, &Server{RequestTimeout: d, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		dl, ok := r.Context().Deadline()
		if left := time.Until(dl); !ok || left > d || left < d-time.Minute {
			t.Errorf("request context deadline %v (set %v), want about %v from now", dl, ok, d)
		}
		io.WriteString(w, "ok")
	})})
	c, br := rawConn(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	readResponse(t, br, "GET")

	done := make(chan error, 1)
	addr = start(t, &Server{RequestTimeout: time.Millisecond, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done()
		done <- r.Context().Err()
	})})
	c, br = rawConn(t, addr)
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	readResponse(t, br, "GET")
	if err := <-done; !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("the context ended with %v, want DeadlineExceeded", err)
	}
}
