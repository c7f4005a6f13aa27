package httpengine

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// countingServer is an engine that answers every POST with its body
// echoed as a chunked, flushed stream, counting the connections it accepts.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: %s\n\n", b)
		w.(http.Flusher).Flush()
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

func h1Client(t *testing.T) (*http.Client, *h1Transport) {
	t.Helper()
	tr := newH1Transport(0, http.DefaultTransport)
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}, tr
}

func h1Post(t *testing.T, ctx context.Context, hc *http.Client, url, body string) string {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the body: %v", err)
	}
	return string(b)
}

func TestH1ReusesConnections(t *testing.T) {
	srv, conns := countingServer(t)
	hc, _ := h1Client(t)
	for i := range 5 {
		body := fmt.Sprintf(`{"n":%d}`, i)
		if got, want := h1Post(t, t.Context(), hc, srv.URL+"/v1/completions", body), "data: "+body+"\n\ndata: [DONE]\n\n"; got != want {
			t.Fatalf("answer %d = %q, want %q", i, got, want)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("5 sequential requests opened %d connections, want 1", n)
	}
}

func TestH1ConcurrentRequests(t *testing.T) {
	srv, conns := countingServer(t)
	hc, _ := h1Client(t)
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 20 {
				body := fmt.Sprintf(`{"g":%d,"i":%d}`, g, i)
				if got := h1Post(t, t.Context(), hc, srv.URL+"/x", body); !strings.HasPrefix(got, "data: "+body+"\n\n") {
					t.Errorf("answer to %s = %q", body, got)
				}
			}
		})
	}
	wg.Wait()
	if n := conns.Load(); n > 16 {
		t.Errorf("16 concurrent clients opened %d connections, want at most 16", n)
	}
}

// An idle pooled connection the engine closed is seen closed, past
// peekAfter, and not used again.
func TestH1SkipsConnectionClosedWhileIdle(t *testing.T) {
	srv, conns := countingServer(t)
	hc, tr := h1Client(t)
	var skew atomic.Int64
	tr.now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
	h1Post(t, t.Context(), hc, srv.URL+"/x", "1")
	srv.CloseClientConnections()
	skew.Store(int64(2 * peekAfter))
	if got := h1Post(t, t.Context(), hc, srv.URL+"/x", "2"); got != "data: 2\n\ndata: [DONE]\n\n" {
		t.Fatalf("answer after the engine closed the idle connection = %q", got)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("connections = %d, want 2", n)
	}
}

// rawEngine accepts connections and hands each to serve.
func rawEngine(t *testing.T, serve func(n int, c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for n := 0; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { defer c.Close(); serve(n, c) })
		}
	})
	return "http://" + ln.Addr().String()
}

// answerOne reads one request from br and writes a keep-alive answer echoing
// its body.
func answerOne(br *bufio.Reader, c net.Conn) error {
	req, err := http.ReadRequest(br)
	if err != nil {
		return err
	}
	b, _ := io.ReadAll(req.Body)
	_, err = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(b), b)
	return err
}

// The engine closes a kept-alive connection as the next request arrives
// (its idle timer fired): the request goes again, whole, on a new one.
func TestH1RetriesRequestTheEngineDroppedOnIdleConnection(t *testing.T) {
	url := rawEngine(t, func(n int, c net.Conn) {
		br := bufio.NewReader(c)
		if answerOne(br, c) != nil || n > 0 {
			for answerOne(br, c) == nil {
			}
			return
		}
		// First connection: read the second request's bytes, then close.
		_, _ = http.ReadRequest(br)
	})
	hc, _ := h1Client(t)
	if got := h1Post(t, t.Context(), hc, url, "first"); got != "first" {
		t.Fatalf("first answer %q", got)
	}
	if got := h1Post(t, t.Context(), hc, url, "second body"); got != "second body" {
		t.Fatalf("answer after the dropped request = %q, want the body echoed", got)
	}
}

// A new connection the engine closes without answering is an error, not
// sent again.
func TestH1NoRetryOnNewConnection(t *testing.T) {
	var accepted atomic.Int64
	url := rawEngine(t, func(_ int, c net.Conn) {
		accepted.Add(1)
		_, _ = http.ReadRequest(bufio.NewReader(c))
	})
	hc, _ := h1Client(t)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader("x"))
	if _, err := hc.Do(req); err == nil {
		t.Fatal("no error from an engine that closed without answering")
	}
	if n := accepted.Load(); n != 1 {
		t.Errorf("engine accepted %d connections, want 1", n)
	}
}

// Ending the request's context unblocks a read of its body at once, and
// the connection is not pooled.
func TestH1CancelUnblocksBodyRead(t *testing.T) {
	release := make(chan struct{})
	var accepted atomic.Int64
	url := rawEngine(t, func(n int, c net.Conn) {
		accepted.Add(1)
		br := bufio.NewReader(c)
		if n > 0 {
			for answerOne(br, c) == nil {
			}
			return
		}
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		fmt.Fprint(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
		<-release
	})
	defer close(release)
	hc, _ := h1Client(t)
	ctx, cancel := context.WithCancel(t.Context())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader("x"))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("first chunk %q, %v", buf, err)
	}
	done := make(chan error, 1)
	go func() { _, err := resp.Body.Read(buf); done <- err }()
	cancel()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("read after cancel returned no error")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("cancel did not unblock the body read")
	}
	resp.Body.Close()
	if got := h1Post(t, t.Context(), hc, url, "again"); got != "again" {
		t.Fatalf("next answer %q", got)
	}
	if n := accepted.Load(); n != 2 {
		t.Errorf("accepted %d connections, want 2 (the cancelled one not reused)", n)
	}
}

// A body closed before its end closes its connection.
func TestH1BodyClosedEarlyIsNotPooled(t *testing.T) {
	srv, conns := countingServer(t)
	hc, _ := h1Client(t)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader("abc"))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := resp.Body.Read(make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	h1Post(t, t.Context(), hc, srv.URL, "def")
	if n := conns.Load(); n != 2 {
		t.Errorf("connections = %d, want 2", n)
	}
}

func TestH1HeaderTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	url := rawEngine(t, func(_ int, c net.Conn) {
		_, _ = http.ReadRequest(bufio.NewReader(c))
		<-release
	})
	tr := newH1Transport(20*time.Millisecond, http.DefaultTransport)
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader("x"))
	_, err := (&http.Client{Transport: tr}).Do(req)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("err = %v, want a timeout", err)
	}
}

func TestH1ResponseWithoutBody(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	hc, tr := h1Client(t)
	for range 3 {
		resp, err := hc.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	if n := len(tr.idle[canonicalAddr(mustURL(t, srv.URL))]); n != 1 {
		t.Errorf("pooled connections = %d, want 1", n)
	}
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}
