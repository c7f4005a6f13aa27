package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// syncBuffer is a bytes.Buffer safe for one writer and one reader, who
// can wait for what the writer writes.
type syncBuffer struct {
	mu    sync.Mutex
	b     bytes.Buffer
	wrote chan struct{} // closed at the next Write; nil until waited on
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.wrote != nil {
		close(s.wrote)
		s.wrote = nil
	}
	return s.b.Write(p)
}

// waitMatch waits until the buffer holds a match of re and returns its
// submatches. It fails t after 20 s, or when the command writing it ends
// first (done receives its result, which waitMatch puts back).
func (s *syncBuffer) waitMatch(t *testing.T, re string, done chan error) []string {
	t.Helper()
	rx := regexp.MustCompile(re)
	timeout := time.After(20 * time.Second)
	for {
		s.mu.Lock()
		m := rx.FindStringSubmatch(s.b.String())
		if s.wrote == nil {
			s.wrote = make(chan struct{})
		}
		wrote := s.wrote
		s.mu.Unlock()
		if m != nil {
			return m
		}
		select {
		case <-wrote:
		case err := <-done:
			done <- err
			t.Fatalf("ended with %v before logging %s:\n%s", err, re, s.String())
		case <-timeout:
			t.Fatalf("no %s after 20s:\n%s", re, s.String())
		}
	}
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestVersionAndUsage(t *testing.T) {
	var out bytes.Buffer
	if err := run(context.Background(), []string{"version"}, &out, io.Discard); err != nil || !strings.HasPrefix(out.String(), "baton ") {
		t.Errorf("version: %q, %v", out.String(), err)
	}
	if err := run(context.Background(), nil, io.Discard, io.Discard); err == nil {
		t.Error("no command accepted")
	}
	if err := run(context.Background(), []string{"frobnicate"}, io.Discard, io.Discard); err == nil {
		t.Error("unknown command accepted")
	}
}

func TestServeRejectsBadConfig(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"serve"}, "--worker:"},
		{[]string{"serve", "--worker", "127.0.0.1:1", "--strategy", "fastest"}, "--strategy:"},
		{[]string{"serve", "--worker", "127.0.0.1:1", "--concurrency-threshold", "0"}, "--concurrency-threshold:"},
		{[]string{"serve", "--worker", "127.0.0.1:1", "--prefix-length", "10"}, "--prefix-length:"},
		{[]string{"serve", "--config", "/nonexistent.yaml"}, "--config: open /nonexistent.yaml"},
		{[]string{"demo", "--workers", "-1"}, "--workers:"},
		{[]string{"demo", "--decode-workers", "0"}, "--decode-workers:"},
		{[]string{"worker", "--warmup-top-k", "-1"}, "--warmup-top-k:"},
		{[]string{"worker", "--redis", "redis://:secret@"}, "--redis:"},
		{[]string{"worker", "--role", "verifier", "--listen", "127.0.0.1:0"}, "--role:"},
		{[]string{"worker", "--store-policy", "sometimes", "--listen", "127.0.0.1:0"}, "--store-policy:"},
	}
	for _, c := range cases {
		err := run(context.Background(), c.args, io.Discard, io.Discard)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v, want an error starting %q", c.args, err, c.want)
		}
	}
}

// The demo, as a newcomer runs it: it prints a URL, and the curl line it
// prints works against that URL.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"demo", "--listen", "127.0.0.1:0", "--workers", "2", "--time-scale", "100", "--log-level", "warn"}, &out, io.Discard)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("demo ended with %v", err)
		}
	})
	m := out.waitMatch(t, `curl -sN (\S+) .*\\\n\s+-d '(.*)'`, done)
	url, body := m[1], m[2]
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Worker") == "" {
		t.Fatalf("status %d, worker %q", resp.StatusCode, resp.Header.Get("X-Baton-Worker"))
	}
	sc := bufio.NewScanner(resp.Body)
	var text strings.Builder
	sawDone := false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			sawDone = true
			break
		}
		var chunk struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		for _, c := range chunk.Choices {
			text.WriteString(c.Delta.Content)
		}
	}
	if !sawDone || text.Len() == 0 {
		t.Errorf("stream: [DONE] %v, text %q", sawDone, text.String())
	}
}

func TestRedisErrorsHideThePassword(t *testing.T) {
	err := run(context.Background(), []string{"worker", "--redis", "redis://:hunter2@"}, io.Discard, io.Discard)
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("got %v: want an error that does not show the password", err)
	}
}
