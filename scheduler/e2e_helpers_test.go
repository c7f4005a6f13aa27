package scheduler_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"go.uber.org/goleak"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/sim"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket, of the fake engines' KV event publishers, never
	// stops its writer goroutine on Close.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// net/http lingers half a second on a connection it refused
		// (431), so the client reads the answer; Close does not cut it.
		goleak.IgnoreAnyFunction("net/http.(*conn).closeWriteAndWait"))
}

// model is the simulated workers' default model.
const model = "llama-3.1-8b"

// fastScale runs the simulated clock fast enough that a completion takes
// milliseconds.
const fastScale = 500

// fastPool checks health often and reopens breakers quickly, so tests that
// watch health and breakers finish in seconds.
func fastPool() pool.Config {
	return pool.Config{
		BreakerFailures:    2,
		BreakerOpenTimeout: 300 * time.Millisecond,
		HealthInterval:     100 * time.Millisecond,
		HealthTimeout:      100 * time.Millisecond,
	}
}

// startWorker starts a simulated worker named name on grpcAddr
// ("127.0.0.1:0" for any port), with its own OpenAI endpoint if withHTTP,
// and closes it when the test ends.
func startWorker(t testing.TB, name string, scale float64, grpcAddr string, withHTTP bool) *sim.Worker {
	t.Helper()
	httpListen := ""
	if withHTTP {
		httpListen = "127.0.0.1:0"
	}
	var f *simfleet.Fleet
	// A worker restarted at its address may find it taken meanwhile, as
	// the local port of another process's connection (the address was a
	// free one when it first started): it is tried again until freed.
	eventually(t, 20*time.Second, func() error {
		var err error
		f, err = simfleet.StartWorkers(simfleet.Spec{
			Workers: 1,
			Name:    func(string, int) string { return name },
			Config:  func(string, string) sim.Config { return sim.Config{TimeScale: scale} },
			Listen:  func(string, string) (string, string) { return grpcAddr, httpListen },
		})
		if err != nil && !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("sim.Start(%s): %v", name, err)
		}
		return err
	})
	t.Cleanup(func() { f.Close() })
	return f.Workers[0]
}

// shortName names workers w0, w1, ... (colocated) or p0…, d0…
// (disaggregated).
func shortName(role string, i int) string {
	if role == sim.RoleBoth {
		return fmt.Sprintf("w%d", i)
	}
	return fmt.Sprintf("%c%d", role[0], i)
}

// startWorkers starts n gRPC workers named w0, w1, ... and returns them
// with their scheduler configuration.
func startWorkers(t testing.TB, n int, scale float64) ([]*sim.Worker, []scheduler.WorkerConfig) {
	t.Helper()
	f, err := simfleet.StartWorkers(simfleet.Spec{
		Workers: n,
		Name:    shortName,
		Config:  func(string, string) sim.Config { return sim.Config{TimeScale: scale} },
	})
	if err != nil {
		t.Fatalf("start workers: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	return f.Workers, f.Configs
}

// startScheduler builds a scheduler from cfg, serves it on a free loopback
// port and returns it with its address. The test's cleanup closes it and
// checks that Serve returned nil.
func startScheduler(t testing.TB, cfg scheduler.Config) (*scheduler.Scheduler, string) {
	t.Helper()
	return startSchedulerLog(t, cfg, nil)
}

// startSchedulerLog is startScheduler with the scheduler logging to log.
func startSchedulerLog(t testing.TB, cfg scheduler.Config, log *slog.Logger) (*scheduler.Scheduler, string) {
	t.Helper()
	f := startFleetSpec(t, simfleet.Spec{Scheduler: cfg, Log: log})
	waitDescribed(t, f.Scheduler)
	return f.Scheduler, f.Addr
}

// waitDescribed waits until s knows every worker's description. A worker
// whose Describe timed out at start (a loaded machine) joins its pool at a
// later health check; until then it serves nothing, which would skew a
// test that counts where requests went.
func waitDescribed(t testing.TB, s *scheduler.Scheduler) {
	t.Helper()
	eventually(t, 20*time.Second, func() error {
		if p := s.Pending(); len(p) > 0 {
			return fmt.Errorf("workers %v still not described", p)
		}
		return nil
	})
}

// startFleetSpec starts spec's fleet without waiting for it to be ready
// (some tests start a scheduler whose workers are down). The test's
// cleanup closes it and checks that Serve returned nil.
func startFleetSpec(t testing.TB, spec simfleet.Spec) *simfleet.Fleet {
	t.Helper()
	spec.ReadyTimeout = -1
	f, err := simfleet.Start(spec)
	if err != nil {
		t.Fatalf("start fleet: %v", err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("Serve returned %v after Close, want nil", err)
		}
	})
	return f
}

// httpClient returns a client with its own transport, whose idle
// connections are closed when the test ends.
func httpClient(t testing.TB) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// oaClient returns an OpenAI client of the server at addr that does not
// retry.
func oaClient(t testing.TB, addr string) openai.Client {
	return openai.NewClient(
		option.WithBaseURL("http://"+addr+"/v1"),
		option.WithAPIKey("x"),
		option.WithMaxRetries(0),
		option.WithHTTPClient(httpClient(t)),
	)
}

// logRecorder is a slog handler that keeps the records at or above a
// level, as "LEVEL message key=value ...".
type logRecorder struct {
	level slog.Level
	mu    sync.Mutex
	msgs  []string
}

func (r *logRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= r.level }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	msg := rec.Level.String() + " " + rec.Message
	rec.Attrs(func(a slog.Attr) bool {
		msg += " " + a.String()
		return true
	})
	r.msgs = append(r.msgs, msg)
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

// messages returns the records kept so far.
func (r *logRecorder) messages() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.msgs...)
}

// ctxT returns a context that ends with the test or after d.
func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// text returns a deterministic prompt of at least n characters, distinct
// for each seed.
func text(seed string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s word %d; ", seed, i)
	}
	return b.String()
}

// chatParams is a one-message chat request.
func chatParams(prompt string, maxTokens int64) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{
		Model:     model,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
		MaxTokens: openai.Int(maxTokens),
	}
}

// chatResult is what a test reads of one non-streaming chat completion.
type chatResult struct {
	worker, route string
	prefill       string // X-Baton-Prefill-Worker
	content       string
	finish        string
	model         string // the response's model
	prompt        int64
	cached        int64
}

// chat sends a non-streaming chat completion and fails the test on error.
func chat(t testing.TB, c openai.Client, p openai.ChatCompletionNewParams, opts ...option.RequestOption) chatResult {
	t.Helper()
	var resp *http.Response
	opts = append(opts, option.WithResponseInto(&resp))
	got, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), p, opts...)
	if err != nil {
		t.Fatalf("chat completion: %v", err)
	}
	if len(got.Choices) != 1 {
		t.Fatalf("chat completion: got %d choices, want 1", len(got.Choices))
	}
	return chatResult{
		worker:  resp.Header.Get("X-Baton-Worker"),
		route:   resp.Header.Get("X-Baton-Route"),
		prefill: resp.Header.Get("X-Baton-Prefill-Worker"),
		content: got.Choices[0].Message.Content,
		finish:  got.Choices[0].FinishReason,
		model:   got.Model,
		prompt:  got.Usage.PromptTokens,
		cached:  got.Usage.PromptTokensDetails.CachedTokens,
	}
}

// concurrentChats streams n chats at once, the i-th with params(i), and
// returns the results of those that succeeded, in the order they ended;
// each failure is a test error.
func concurrentChats(t testing.TB, c openai.Client, n int, params func(i int) openai.ChatCompletionNewParams) []chatResult {
	t.Helper()
	var mu sync.Mutex
	var results []chatResult
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := streamChat(t, c, params(i))
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return results
}

// streamChat sends a streaming chat completion with usage, accumulates it
// and fails the test on error.
func streamChat(t testing.TB, c openai.Client, p openai.ChatCompletionNewParams, opts ...option.RequestOption) (chatResult, error) {
	t.Helper()
	var resp *http.Response
	opts = append(opts, option.WithResponseInto(&resp))
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := c.Chat.Completions.NewStreaming(ctxT(t, 30*time.Second), p, opts...)
	defer stream.Close()
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		return chatResult{}, err
	}
	r := chatResult{
		worker:  resp.Header.Get("X-Baton-Worker"),
		route:   resp.Header.Get("X-Baton-Route"),
		prefill: resp.Header.Get("X-Baton-Prefill-Worker"),
		model:   acc.Model,
		prompt:  acc.Usage.PromptTokens,
		cached:  acc.Usage.PromptTokensDetails.CachedTokens,
	}
	if len(acc.Choices) != 1 {
		return r, fmt.Errorf("stream accumulated %d choices, want 1", len(acc.Choices))
	}
	r.content, r.finish = acc.Choices[0].Message.Content, acc.Choices[0].FinishReason
	return r, nil
}

// rawResult is one raw HTTP exchange.
type rawResult struct {
	status int
	header http.Header
	body   []byte
}

// do sends a request with body (nil for none) and headers and returns the
// whole response.
func do(t testing.TB, hc *http.Client, method, url, body string, hdr map[string]string) rawResult {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctxT(t, 30*time.Second), method, url, r)
	if err != nil {
		t.Fatalf("new request: %v", err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header[k] = []string{v}
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, url, err)
	}
	return rawResult{status: resp.StatusCode, header: resp.Header, body: b}
}

// apiError is the OpenAI error shape; pointers tell null from "".
type apiError struct {
	Error *struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// decodeError parses an OpenAI error body, failing the test if it is not
// one.
func decodeError(t testing.TB, b []byte) (typ, param, code, msg string) {
	t.Helper()
	var e apiError
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil {
		t.Fatalf("body %q is not an OpenAI error (%v)", b, err)
	}
	if e.Error.Param != nil {
		param = *e.Error.Param
	}
	if e.Error.Code != nil {
		code = *e.Error.Code
	}
	return e.Error.Type, param, code, e.Error.Message
}

// scrape returns the scheduler's /metrics text.
func scrape(t testing.TB, hc *http.Client, addr string) string {
	t.Helper()
	r := do(t, hc, http.MethodGet, "http://"+addr+"/metrics", "", nil)
	if r.status != http.StatusOK {
		t.Fatalf("GET /metrics: status %d", r.status)
	}
	return string(r.body)
}

// scrapeSettled returns the scheduler's /metrics text once every accepted
// request has been counted as completed or failed. A client sees the end
// of its response before the scheduler counts it, so a test that reads
// request counters right after its responses waits on this, not on time.
func scrapeSettled(t testing.TB, hc *http.Client, addr string) string {
	t.Helper()
	var m string
	eventually(t, 10*time.Second, func() error {
		m = scrape(t, hc, addr)
		acc, _ := metric(m, "baton_requests_accepted_total")
		done, _ := metric(m, "baton_requests_completed_total")
		failed, _ := metric(m, "baton_requests_failed_total")
		if acc != done+failed {
			return fmt.Errorf("accepted %v != completed %v + failed %v: requests still in flight", acc, done, failed)
		}
		return nil
	})
	return m
}

// metric sums the samples of the metric called name whose labels include
// every label="value" pair in labels (e.g. `worker="w0"`). It reports
// whether any sample matched.
func metric(text, name string, labels ...string) (float64, bool) {
	var sum float64
	found := false
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") || !strings.HasPrefix(line, name) {
			continue
		}
		rest := line[len(name):]
		var lbl string
		switch {
		case strings.HasPrefix(rest, "{"):
			end := strings.Index(rest, "}")
			if end < 0 {
				continue
			}
			lbl, rest = rest[1:end], rest[end+1:]
		case strings.HasPrefix(rest, " "):
		default:
			continue // a longer name
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(","+lbl+",", ","+l+",") {
				ok = false
			}
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.Fields(rest)[0], 64)
		if err != nil {
			continue
		}
		sum += v
		found = true
	}
	return sum, found
}

// eventually calls cond every 10 ms until it returns nil, failing the test
// with cond's last error if that takes longer than d: for a state that
// processes and sockets reach in their own time.
func eventually(t testing.TB, d time.Duration, cond func() error) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(d)
	for {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("after %v: %v", d, err)
		}
	}
}
