package scheduler_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
)

// TestConnectionTimeouts: a client that stalls mid-body, or keeps an idle
// connection, does not hold it for ever; short read, write and idle
// timeouts do not cut a stream that lasts longer than all of them.
func TestConnectionTimeouts(t *testing.T) {
	const short = 300 * time.Millisecond
	// Slow workers: the stream below takes over a second.
	_, workers := startWorkers(t, 1, 0.5)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "random", Workers: workers, Pool: fastPool(),
		Config: frontend.Config{ReadTimeout: short, WriteTimeout: short, IdleTimeout: short}})

	dial := func(t *testing.T) (net.Conn, *bufio.Reader) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		conn.SetReadDeadline(time.Now().Add(10 * time.Second)) // the test's own bound
		return conn, bufio.NewReader(conn)
	}

	t.Run("stalled body", func(t *testing.T) {
		conn, br := dial(t)
		fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("no answer to a stalled body: %v", err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestTimeout {
			t.Errorf("stalled body: status %d, want 408", resp.StatusCode)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Errorf("connection still open after a stalled body (read: %v)", err)
		}
	})

	t.Run("idle connection", func(t *testing.T) {
		conn, br := dial(t)
		fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		start := time.Now()
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("idle connection not closed (read: %v)", err)
		}
		t.Logf("idle connection closed after %v", time.Since(start))
	})

	t.Run("long stream", func(t *testing.T) {
		conn, br := dial(t)
		body := `{"model":"` + model + `","stream":true,"max_tokens":300,"messages":[{"role":"user","content":"Tell me a long story."}]}`
		start := time.Now()
		fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("stream cut after %v: %v", time.Since(start), err)
		}
		if !strings.Contains(string(b), "data: [DONE]") {
			t.Fatalf("stream of %v ended without [DONE]: ...%s", time.Since(start), b[max(0, len(b)-300):])
		}
		if d := time.Since(start); d < 2*short {
			t.Errorf("the stream took %v, not longer than the timeouts: the test shows nothing", d)
		}
	})
}
