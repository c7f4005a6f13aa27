package scheduler_test

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/ssestream"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/sim"
)

// drainScale runs the simulated clock slowly enough that a stream of a
// few dozen tokens lasts seconds: long enough to drain around it.
const drainScale = 0.05

// drainFleet starts one slow worker behind a scheduler with cfg's drain
// settings and returns the scheduler, its address and its log.
func drainFleet(t *testing.T, drain func(*scheduler.Config)) (*scheduler.Scheduler, string, *logRecorder) {
	t.Helper()
	_, wcs := startWorkers(t, 1, drainScale)
	cfg := scheduler.Config{Workers: wcs}
	drain(&cfg)
	logs := &logRecorder{level: slog.LevelInfo}
	s, addr := startSchedulerLog(t, cfg, slog.New(logs))
	return s, addr, logs
}

// startDrain drains s in the background; the returned channel is closed
// when Drain has returned.
func startDrain(s *scheduler.Scheduler) <-chan struct{} {
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		s.Drain()
	}()
	return drained
}

// TestDrainFinishesStreamsInFlight: a stream running when the drain starts
// ends with its whole text; meanwhile /readyz answers 503, and once the
// drain delay is over a new request is refused before any worker sees it.
func TestDrainFinishesStreamsInFlight(t *testing.T) {
	// The text a worker generates depends only on the prompt: a fast
	// fleet gives the reference.
	_, fast := startWorkers(t, 1, fastScale)
	_, fastAddr := startScheduler(t, scheduler.Config{Workers: fast})
	p := chatParams(text("drain in flight", 400), 40)
	want := chat(t, oaClient(t, fastAddr), p).content

	s, addr, logs := drainFleet(t, func(c *scheduler.Config) {
		c.DrainTimeout = time.Minute
		c.DrainDelay = 500 * time.Millisecond
	})
	hc := httpClient(t)
	if r := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil); r.status != http.StatusOK {
		t.Fatalf("GET /readyz before the drain: status %d, want 200", r.status)
	}

	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	c := oaClient(t, addr)
	stream := c.Chat.Completions.NewStreaming(ctxT(t, time.Minute), p)
	defer stream.Close()
	var acc openai.ChatCompletionAccumulator
	if !stream.Next() {
		t.Fatalf("stream ended before its first chunk: %v", stream.Err())
	}
	acc.AddChunk(stream.Current())

	drained := startDrain(s)
	// Ready no more, at once, while the listener still accepts.
	eventually(t, 10*time.Second, func() error {
		r := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil)
		if r.status != http.StatusServiceUnavailable {
			return fmt.Errorf("GET /readyz during the drain: status %d, want 503", r.status)
		}
		return nil
	})
	// Past the delay, new requests find no listener.
	eventually(t, 10*time.Second, func() error {
		_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("a request during the drain", 5))
		if !errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("a new request during the drain: got %v, want connection refused", err)
		}
		return nil
	})
	select {
	case <-drained:
		t.Fatal("Drain returned while a stream was in flight")
	default:
	}

	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream in flight during the drain: %v", err)
	}
	if len(acc.Choices) != 1 {
		t.Fatalf("stream accumulated %d choices, want 1", len(acc.Choices))
	}
	if got := acc.Choices[0].Message.Content; got != want {
		t.Errorf("stream in flight during the drain got text %q, want %q", got, want)
	}
	select {
	case <-drained:
	case <-time.After(30 * time.Second):
		t.Fatal("Drain did not return after the last stream ended")
	}
	msgs := strings.Join(logs.messages(), "\n")
	for _, m := range []string{"draining", "drained"} {
		if !strings.Contains(msgs, m) {
			t.Errorf("log lacks %q:\n%s", m, msgs)
		}
	}
	if strings.Contains(msgs, "drain timed out") {
		t.Errorf("log says the drain timed out, want it not to:\n%s", msgs)
	}
}

// TestDrainInterruptsStreamsPastTimeout: a stream longer than the drain
// timeout ends with the stream_interrupted error event, and counts once,
// as interrupted.
func TestDrainInterruptsStreamsPastTimeout(t *testing.T) {
	s, addr, logs := drainFleet(t, func(c *scheduler.Config) { c.DrainTimeout = 200 * time.Millisecond })
	hc := httpClient(t)
	// A stream of about a hundred tokens lasts far longer than 200ms.
	p := chatParams(text("drain past the timeout", 400), 250)
	c := oaClient(t, addr)
	stream := c.Chat.Completions.NewStreaming(ctxT(t, time.Minute), p)
	defer stream.Close()
	if !stream.Next() {
		t.Fatalf("stream ended before its first chunk: %v", stream.Err())
	}
	// The counters are read before the drain closes /metrics.
	before := scrape(t, hc, addr)
	drained := startDrain(s)
	for stream.Next() {
	}
	err := stream.Err()
	if err == nil || !strings.Contains(err.Error(), "stream_interrupted") {
		t.Fatalf("stream past the drain timeout ended with %v, want a stream_interrupted error event", err)
	}
	select {
	case <-drained:
	case <-time.After(30 * time.Second):
		t.Fatal("Drain did not return")
	}
	after, _ := metric(gather(t, s), "baton_requests_failed_total", `outcome="interrupted"`)
	was, _ := metric(before, "baton_requests_failed_total", `outcome="interrupted"`)
	if after-was != 1 {
		t.Errorf("requests failed as interrupted: %v, want 1", after-was)
	}
	acc, _ := metric(gather(t, s), "baton_requests_accepted_total")
	done, _ := metric(gather(t, s), "baton_requests_completed_total")
	failed, _ := metric(gather(t, s), "baton_requests_failed_total")
	if acc != done+failed {
		t.Errorf("accepted %v != completed %v + failed %v", acc, done, failed)
	}
	if d, _ := metric(gather(t, s), "baton_draining"); d != 1 {
		t.Errorf("baton_draining = %v, want 1", d)
	}
	if msgs := strings.Join(logs.messages(), "\n"); !strings.Contains(msgs, "drain timed out") {
		t.Errorf("log lacks the timed-out drain:\n%s", msgs)
	}
}

// gather returns s's metrics in the text format, read from its handler
// (the listener is closed after a drain).
func gather(t *testing.T, s *scheduler.Scheduler) string {
	t.Helper()
	rec := httptest.NewRecorder()
	s.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	return rec.Body.String()
}

// TestDrainingWorkerRequestsGoElsewhere: a worker that drains refuses new
// requests with Unavailable before their first token; the scheduler, whose
// health checks have not noticed yet, retries them on another worker and
// the client sees no error. The drained worker's running stream finishes.
func TestDrainingWorkerRequestsGoElsewhere(t *testing.T) {
	slow := startWorker(t, "w0", drainScale, "127.0.0.1:0", false)
	fast := startWorker(t, "w1", fastScale, "127.0.0.1:0", false)
	// Health checks too rare to notice the drain during the test: every
	// request routed to w0 reaches it and is refused.
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "round_robin",
		Pool:     pool.Config{HealthInterval: time.Hour},
		Workers:  []scheduler.WorkerConfig{{Name: "w0", Address: slow.GRPCAddr}, {Name: "w1", Address: fast.GRPCAddr}},
	})
	c := oaClient(t, addr)

	// A stream on w0, running when it starts to drain.
	var stream *ssestream.Stream[openai.ChatCompletionChunk]
	var resp *http.Response
	for range 2 { // round robin: one of two requests lands on w0
		stream = c.Chat.Completions.NewStreaming(ctxT(t, time.Minute), chatParams(text("on the draining worker", 400), 40), option.WithResponseInto(&resp))
		if !stream.Next() {
			t.Fatalf("stream ended before its first chunk: %v", stream.Err())
		}
		if resp.Header.Get("X-Baton-Worker") == "w0" {
			break
		}
		for stream.Next() {
		}
		stream.Close()
	}
	defer stream.Close()
	if got := resp.Header.Get("X-Baton-Worker"); got != "w0" {
		t.Fatalf("no stream landed on w0 (last on %q)", got)
	}
	drained := make(chan sim.DrainResult, 1)
	go func() { drained <- slow.Drain(ctxT(t, time.Minute)) }()
	hc0, err := grpcworker.Dial(slow.GRPCAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer hc0.Close()
	eventually(t, 10*time.Second, func() error { // the drain has begun
		if err := hc0.Check(ctxT(t, time.Second)); !errors.Is(err, engine.ErrUnavailable) {
			return fmt.Errorf("w0's health during its drain: %v, want NOT_SERVING", err)
		}
		return nil
	})

	hc := httpClient(t)
	retriesBefore, _ := metric(scrape(t, hc, addr), "baton_retries_total")
	for i := range 4 {
		got := chat(t, c, chatParams(fmt.Sprintf("during the drain %d", i), 5))
		if got.worker != "w1" {
			t.Errorf("request %d during w0's drain served by %q, want w1", i, got.worker)
		}
	}
	m := scrapeSettled(t, hc, addr)
	if retries, _ := metric(m, "baton_retries_total"); retries-retriesBefore < 1 {
		t.Errorf("retries during w0's drain: %v, want at least 1 (round robin sends it every other request)", retries-retriesBefore)
	}

	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the stream on the draining worker: %v", err)
	}
	if len(acc.Choices) != 1 || acc.Choices[0].FinishReason == "" {
		t.Errorf("the stream on the draining worker did not finish: %+v", acc.Choices)
	}
	select {
	case res := <-drained:
		if res.Left != 0 {
			t.Errorf("w0's drain left %d calls running", res.Left)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("w0's drain did not end")
	}
}
