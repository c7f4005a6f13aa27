package httpengine

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/workers/engine"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The events of a streamed chat completion exactly as vLLM sends them with
// stream_options.include_usage: a role chunk with empty content, content
// chunks, a chunk with the finish reason, a usage chunk without choices,
// then [DONE].
var vllmChatEvents = []string{
	`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}` + "\n\n",
	`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}` + "\n\n",
	`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}` + "\n\n",
	`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}` + "\n\n",
	`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":40,"total_tokens":43,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}` + "\n\n",
	"data: [DONE]\n\n",
}

// The same for the completions API (choices[].text).
var vllmCompletionEvents = []string{
	`data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null,"stop_reason":null}]}` + "\n\n",
	`data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":"!","logprobs":null,"finish_reason":"length","stop_reason":null}]}` + "\n\n",
	`data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}` + "\n\n",
	"data: [DONE]\n\n",
}

const vllmChatJSON = `{"id":"chatcmpl-2","object":"chat.completion","created":1700000000,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello world","tool_calls":[]},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":40,"total_tokens":50,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":16}},"prompt_logprobs":null}`

// fakeEngine is an OpenAI-compatible engine that answers every request
// with status, contentType and events, flushing after each event.
type fakeEngine struct {
	status      int
	contentType string
	events      []string
	// hold, if set, keeps the response open after the events until the
	// request's context is done, and reports that on done.
	hold bool
	done chan struct{}

	gotBody   atomic.Pointer[[]byte]
	gotHeader atomic.Pointer[http.Header]
}

func (f *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	f.gotBody.Store(&body)
	h := r.Header.Clone()
	f.gotHeader.Store(&h)
	if f.contentType != "" {
		w.Header().Set("Content-Type", f.contentType)
	}
	w.Header().Set("X-Engine", "fake")
	status := f.status
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	for _, ev := range f.events {
		if _, err := io.WriteString(w, ev); err != nil {
			return
		}
		w.(http.Flusher).Flush()
	}
	if f.hold {
		select {
		case <-r.Context().Done():
			close(f.done)
		case <-time.After(5 * time.Second):
		}
	}
}

func startEngine(t *testing.T, h http.Handler) *Client {
	t.Helper()
	srv := httptest.NewServer(h)
	c, err := New(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		srv.Close()
	})
	return c
}

// closedURL returns the URL of a port nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return "http://" + addr
}

// flushRecorder records where in the body each Flush happened.
type flushRecorder struct {
	*httptest.ResponseRecorder
	flushes []int
}

func (r *flushRecorder) Flush() {
	r.flushes = append(r.flushes, r.Body.Len())
	r.ResponseRecorder.Flush()
}

func newRecorder() *flushRecorder { return &flushRecorder{ResponseRecorder: httptest.NewRecorder()} }

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`

func TestProxyRelaysEventStream(t *testing.T) {
	fe := &fakeEngine{contentType: "text/event-stream; charset=utf-8", events: vllmChatEvents}
	c := startEngine(t, fe)
	rec := newRecorder()

	var firstCalls int
	var atFirst string
	res, err := c.Proxy(testContext(t), &engine.Request{ID: "req-1", Path: "/v1/chat/completions", Body: []byte(chatBody), Stream: true}, rec, func() {
		firstCalls++
		atFirst = rec.Body.String()
	})
	if err != nil {
		t.Fatalf("Proxy: %v", err)
	}

	want := engine.ProxyResult{Status: 200, Written: true, Usage: &engine.Final{
		FinishReason: "stop", PromptTokens: 40, CachedTokens: 32, CompletionTokens: 3,
	}}
	if diff := cmp.Diff(want, res); diff != "" {
		t.Errorf("result (-want +got):\n%s", diff)
	}
	if got, want := rec.Body.String(), strings.Join(vllmChatEvents, ""); got != want {
		t.Errorf("relayed body differs:\n got %q\nwant %q", got, want)
	}
	if got := rec.Header().Get("Content-Type"); got != "text/event-stream; charset=utf-8" {
		t.Errorf("Content-Type = %q", got)
	}
	if got := rec.Header().Get("X-Engine"); got != "" {
		t.Errorf("engine header X-Engine relayed: %q", got)
	}
	if firstCalls != 1 {
		t.Errorf("onFirstToken called %d times, want 1", firstCalls)
	}
	// Events that arrive together may leave in one flush: the first token
	// is reported once the client has the event carrying it.
	if k := eventsIn(vllmChatEvents, atFirst); k < 2 {
		t.Errorf("at onFirstToken the client had %q, want the role and first content events and any that came with them", atFirst)
	}
	// The last flush is with the last event.
	if n := len(rec.flushes); n == 0 || rec.flushes[n-1] != rec.Body.Len() {
		t.Errorf("flush points %v, want %d last", rec.flushes, rec.Body.Len())
	}

	if got := string(*fe.gotBody.Load()); got != chatBody {
		t.Errorf("engine got body %q, want the client's %q", got, chatBody)
	}
	h := *fe.gotHeader.Load()
	if got := h.Get("Content-Type"); got != "application/json" {
		t.Errorf("engine got Content-Type %q", got)
	}
	if got := h.Get("X-Request-Id"); got != "req-1" {
		t.Errorf("engine got X-Request-Id %q", got)
	}
}

// eventsIn returns how many whole events of events body holds, or -1 if
// it is not a run of whole events.
func eventsIn(events []string, body string) int {
	for k := 0; k <= len(events); k++ {
		if body == strings.Join(events[:k], "") {
			return k
		}
	}
	return -1
}

// segmentReader returns one segment per Read, as a connection delivers
// what arrived together.
type segmentReader struct{ segs []string }

func (r *segmentReader) Read(p []byte) (int, error) {
	if len(r.segs) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.segs[0])
	if r.segs[0] = r.segs[0][n:]; r.segs[0] == "" {
		r.segs = r.segs[1:]
	}
	return n, nil
}

// The relay flushes before each read that may block: events that arrived
// together leave together (the headers with the first ones), and a
// partial event is not held back behind the rest of it.
func TestRelayEventsFlushesBeforeBlocking(t *testing.T) {
	ev := vllmChatEvents
	partial := ev[2][:len(ev[2])-1] // the data line of event 2, not its end
	segs := []string{ev[0] + ev[1], partial, "\n" + ev[3], ev[4] + ev[5]}
	rec := newRecorder()
	var atFirst string
	rw := &relayWriter{w: rec, rc: http.NewResponseController(rec), onFirst: func() { atFirst = rec.Body.String() }}
	var u usageTracker
	if err := rw.relayEvents(&segmentReader{segs: slices.Clone(segs)}, &u, true); err != nil {
		t.Fatalf("relayEvents: %v", err)
	}
	if got, want := rec.Body.String(), strings.Join(ev, ""); got != want {
		t.Errorf("relayed body differs:\n got %q\nwant %q", got, want)
	}
	var want []int
	n := 0
	for _, s := range segs {
		n += len(s)
		want = append(want, n)
	}
	if diff := cmp.Diff(want, rec.flushes); diff != "" {
		t.Errorf("flush points (-want +got):\n%s", diff)
	}
	if want := ev[0] + ev[1]; atFirst != want {
		t.Errorf("at onFirstToken the client had %q, want %q", atFirst, want)
	}
	if got, want := u.final(), (&engine.Final{FinishReason: "stop", PromptTokens: 40, CachedTokens: 32, CompletionTokens: 3}); !cmp.Equal(got, want) {
		t.Errorf("usage = %+v, want %+v", got, want)
	}
}

// blockingReader blocks its first Read until release is closed, then
// reads from r.
type blockingReader struct {
	release chan struct{}
	r       io.Reader
}

func (b *blockingReader) Read(p []byte) (int, error) {
	<-b.release
	return b.r.Read(p)
}

// An engine that sends its headers long before its first event has them
// relayed after holdHeaders, not when the first event comes.
func TestRelayEventsHeadersOfSlowStream(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := newRecorder()
		var mu sync.Mutex // the timer's flush and the test's reads
		rw := &relayWriter{w: rec, rc: http.NewResponseController(lockedFlusher{rec, &mu})}
		body := &blockingReader{release: make(chan struct{}), r: strings.NewReader(strings.Join(vllmChatEvents, ""))}
		done := make(chan error, 1)
		var u usageTracker
		go func() { done <- rw.relayEvents(body, &u, true) }()

		time.Sleep(holdHeaders - time.Microsecond)
		synctest.Wait()
		mu.Lock()
		if len(rec.flushes) != 0 {
			t.Errorf("flushed at %v before holdHeaders passed", rec.flushes)
		}
		mu.Unlock()
		time.Sleep(time.Microsecond)
		synctest.Wait()
		mu.Lock()
		if want := []int{0}; !slices.Equal(rec.flushes, want) {
			t.Errorf("flush points %v after holdHeaders, want %v (the headers)", rec.flushes, want)
		}
		mu.Unlock()
		close(body.release)
		if err := <-done; err != nil {
			t.Fatalf("relayEvents: %v", err)
		}
		if want := []int{0, rec.Body.Len()}; !slices.Equal(rec.flushes, want) {
			t.Errorf("flush points %v, want %v", rec.flushes, want)
		}
	})
}

// lockedFlusher is a flushRecorder whose Flush holds mu.
type lockedFlusher struct {
	*flushRecorder
	mu *sync.Mutex
}

func (l lockedFlusher) Flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.flushRecorder.Flush()
}

func TestPlainString(t *testing.T) {
	tests := []struct {
		data   string
		want   string
		wantOK bool
	}{
		{`{"choices":[{"finish_reason":"stop"}]}`, "stop", true},
		{`{"choices":[{"finish_reason" : "length"}]}`, "length", true},
		{`{"choices":[{"finish_reason":null},{"finish_reason":"stop"}]}`, "stop", true},
		{`{"choices":[{"finish_reason":""},{"finish_reason":"stop"}]}`, "stop", true},
		{`{"choices":[{"finish_reason":"st\u006fp"}]}`, "", false},
		{`{"a":"\"finish_reason\":\"x\"","choices":[{"finish_reason":null}]}`, "", false},
		{`{"choices":[{"finish_reason":null}]}`, "", false},
		{`{"choices":[{"finish_reason":"sto`, "", false},
	}
	for _, tt := range tests {
		got, ok := plainString([]byte(tt.data), `"finish_reason"`)
		if got != tt.want || ok != tt.wantOK {
			t.Errorf("plainString(%s) = %q, %v; want %q, %v", tt.data, got, ok, tt.want, tt.wantOK)
		}
	}
}

func TestProxyCompletionStream(t *testing.T) {
	c := startEngine(t, &fakeEngine{contentType: "text/event-stream", events: vllmCompletionEvents})
	rec := newRecorder()
	var atFirst string
	res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, rec, func() { atFirst = rec.Body.String() })
	if err != nil {
		t.Fatalf("Proxy: %v", err)
	}
	if k := eventsIn(vllmCompletionEvents, atFirst); k < 1 {
		t.Errorf("at onFirstToken the client had %q, want the first event and any that came with it", atFirst)
	}
	want := &engine.Final{FinishReason: "length", PromptTokens: 5, CompletionTokens: 2}
	if diff := cmp.Diff(want, res.Usage); diff != "" {
		t.Errorf("usage (-want +got):\n%s", diff)
	}
	if got, want := rec.Body.String(), strings.Join(vllmCompletionEvents, ""); got != want {
		t.Errorf("relayed body differs:\n got %q\nwant %q", got, want)
	}
}

func TestProxyLongLineAndCRLF(t *testing.T) {
	long := strings.Repeat("x", 3*readBufSize)
	events := []string{
		": keep-alive comment\r\n\r\n",
		`data: {"choices":[{"index":0,"delta":{"content":"` + long + `"}}]}` + "\r\n\r\n",
		"data: [DONE]\r\n\r\n",
		"trailing bytes without newline",
	}
	c := startEngine(t, &fakeEngine{contentType: "text/event-stream", events: events})
	rec := newRecorder()
	calls := 0
	if _, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}, rec, func() { calls++ }); err != nil {
		t.Fatalf("Proxy: %v", err)
	}
	if got, want := rec.Body.String(), strings.Join(events, ""); got != want {
		t.Errorf("relayed body differs (len %d, want %d)", len(got), len(want))
	}
	if calls != 1 {
		t.Errorf("onFirstToken called %d times, want 1", calls)
	}
}

func TestProxyNonStreamJSON(t *testing.T) {
	c := startEngine(t, &fakeEngine{contentType: "application/json", events: []string{vllmChatJSON[:50], vllmChatJSON[50:]}})
	rec := newRecorder()
	calls := 0
	res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{"model":"m"}`)}, rec, func() { calls++ })
	if err != nil {
		t.Fatalf("Proxy: %v", err)
	}
	want := engine.ProxyResult{Status: 200, Written: true, Usage: &engine.Final{
		FinishReason: "length", PromptTokens: 40, CachedTokens: 16, CompletionTokens: 10,
	}}
	if diff := cmp.Diff(want, res); diff != "" {
		t.Errorf("result (-want +got):\n%s", diff)
	}
	if rec.Body.String() != vllmChatJSON {
		t.Errorf("relayed body = %q, want %q", rec.Body.String(), vllmChatJSON)
	}
	if got := rec.Header().Get("Content-Type"); got != "application/json" {
		t.Errorf("Content-Type = %q", got)
	}
	if calls != 1 {
		t.Errorf("onFirstToken called %d times, want 1", calls)
	}
}

func TestProxyRelaysClientErrors(t *testing.T) {
	const body = `{"object":"error","message":"The model ` + "`x`" + ` does not exist.","type":"NotFoundError","param":null,"code":404}`
	for _, status := range []int{400, 404, 413} {
		c := startEngine(t, &fakeEngine{status: status, contentType: "application/json", events: []string{body}})
		rec := newRecorder()
		res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}, rec, func() {
			t.Errorf("onFirstToken called for a %d", status)
		})
		if err != nil {
			t.Errorf("%d: Proxy error %v, want the response relayed", status, err)
		}
		if diff := cmp.Diff(engine.ProxyResult{Status: status, Written: true}, res); diff != "" {
			t.Errorf("%d: result (-want +got):\n%s", status, diff)
		}
		if rec.Code != status || rec.Body.String() != body {
			t.Errorf("%d: client got %d %q", status, rec.Code, rec.Body.String())
		}
	}
}

func TestProxyRefusedStatuses(t *testing.T) {
	tests := []struct {
		status      int
		unavailable bool
	}{
		{429, true}, {502, true}, {503, true}, {504, true},
		{500, false}, {501, false},
	}
	for _, tt := range tests {
		t.Run(http.StatusText(tt.status), func(t *testing.T) {
			c := startEngine(t, &fakeEngine{status: tt.status, contentType: "application/json", events: []string{`{"error":"busy"}`}})
			rec := newRecorder()
			res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, rec, nil)
			if err == nil {
				t.Fatal("Proxy succeeded, want an error")
			}
			if got := errors.Is(err, engine.ErrUnavailable); got != tt.unavailable {
				t.Errorf("errors.Is(%v, ErrUnavailable) = %v, want %v", err, got, tt.unavailable)
			}
			var se *StatusError
			if !errors.As(err, &se) || se.Status != tt.status || se.Message != `{"error":"busy"}` {
				t.Errorf("error %v: want a *StatusError with status %d and the body", err, tt.status)
			}
			if diff := cmp.Diff(engine.ProxyResult{Status: tt.status}, res); diff != "" {
				t.Errorf("result (-want +got):\n%s", diff)
			}
			if rec.Body.Len() != 0 || len(rec.Header()) != 0 || rec.flushes != nil {
				t.Errorf("something was written to the client: %d %v %q", rec.Code, rec.Header(), rec.Body.String())
			}
		})
	}
}

func TestProxyConnectionRefused(t *testing.T) {
	c, err := New(closedURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rec := newRecorder()
	res, err := c.Proxy(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, rec, nil)
	if !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Proxy error = %v, want ErrUnavailable", err)
	}
	if res.Written || rec.Body.Len() != 0 {
		t.Errorf("Written = %v, body %q; want nothing written", res.Written, rec.Body.String())
	}
}

func TestProxyClientCancelCancelsEngine(t *testing.T) {
	fe := &fakeEngine{contentType: "text/event-stream", events: vllmChatEvents[:2], hold: true, done: make(chan struct{})}
	c := startEngine(t, fe)
	ctx, cancel := context.WithCancel(testContext(t))
	defer cancel()
	rec := newRecorder()
	// The client goes away as soon as it has its first token.
	res, err := c.Proxy(ctx, &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}, rec, cancel)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Proxy error = %v, want context.Canceled", err)
	}
	if !res.Written {
		t.Error("Written = false after relaying events")
	}
	select {
	case <-fe.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the engine's request context was never done")
	}
}

func TestGenerateEvents(t *testing.T) {
	fe := &fakeEngine{contentType: "text/event-stream", events: vllmChatEvents}
	c := startEngine(t, fe)
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"stream_options":{"continuous_usage_stats":false}}`
	s, err := c.Generate(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(body)})
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer s.Close()
	got := recvAll(t, s)
	want := []engine.Event{
		{Text: "Hello", Tokens: 1},
		{Text: " world", Tokens: 1},
		{Final: &engine.Final{FinishReason: "stop", PromptTokens: 40, CachedTokens: 32, CompletionTokens: 3}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}

	var sent map[string]any
	if err := json.Unmarshal(*fe.gotBody.Load(), &sent); err != nil {
		t.Fatalf("engine got invalid JSON: %v", err)
	}
	wantSent := map[string]any{
		"model":          "m",
		"messages":       []any{map[string]any{"role": "user", "content": "hi"}},
		"stream":         true,
		"stream_options": map[string]any{"continuous_usage_stats": false, "include_usage": true},
	}
	if diff := cmp.Diff(wantSent, sent); diff != "" {
		t.Errorf("body sent (-want +got):\n%s", diff)
	}
}

func TestGenerateFromPrompt(t *testing.T) {
	fe := &fakeEngine{contentType: "text/event-stream", events: vllmCompletionEvents}
	c := startEngine(t, fe)
	s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "say hi", MaxTokens: 2, Stop: []string{"\n"}})
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer s.Close()
	got := recvAll(t, s)
	want := []engine.Event{
		{Text: "Hi", Tokens: 1},
		{Text: "!", Tokens: 1},
		{Final: &engine.Final{FinishReason: "length", PromptTokens: 5, CompletionTokens: 2}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	var sent map[string]any
	if err := json.Unmarshal(*fe.gotBody.Load(), &sent); err != nil {
		t.Fatal(err)
	}
	wantSent := map[string]any{
		"model": "m", "prompt": "say hi", "max_tokens": 2.0, "stop": []any{"\n"},
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	}
	if diff := cmp.Diff(wantSent, sent); diff != "" {
		t.Errorf("body sent (-want +got):\n%s", diff)
	}
}

func recvAll(t *testing.T, s engine.Stream) []engine.Event {
	t.Helper()
	var got []engine.Event
	for {
		ev, err := s.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		got = append(got, ev)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Errorf("Recv after EOF = %v, want io.EOF", err)
	}
	return got
}

func TestGenerateErrors(t *testing.T) {
	tests := []struct {
		name   string
		engine *fakeEngine // nil: nothing listens
		req    engine.Request
		want   error
		status int
	}{
		{"unavailable", &fakeEngine{status: 503}, engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, engine.ErrUnavailable, 503},
		{"bad request", &fakeEngine{status: 400}, engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, engine.ErrInvalid, 400},
		{"unknown model", &fakeEngine{status: 404}, engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, engine.ErrUnknownModel, 404},
		{"engine failure", &fakeEngine{status: 500}, engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, nil, 500},
		{"connection refused", nil, engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, engine.ErrUnavailable, 0},
		{"body not an object", &fakeEngine{}, engine.Request{Path: "/v1/completions", Body: []byte(`[1]`)}, ErrInvalid, 0},
		{"stream_options not an object", &fakeEngine{}, engine.Request{Path: "/v1/completions", Body: []byte(`{"stream_options":1}`)}, ErrInvalid, 0},
		{"no path", &fakeEngine{}, engine.Request{Body: []byte(`{}`)}, ErrInvalid, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var c *Client
			if tt.engine != nil {
				c = startEngine(t, tt.engine)
			} else {
				var err error
				if c, err = New(closedURL(t)); err != nil {
					t.Fatal(err)
				}
				defer c.Close()
			}
			s, err := c.Generate(testContext(t), &tt.req)
			if err == nil {
				s.Close()
				t.Fatal("Generate succeeded, want an error")
			}
			if tt.want != nil && !errors.Is(err, tt.want) {
				t.Errorf("Generate error = %v, want it to wrap %v", err, tt.want)
			}
			if tt.want == nil {
				for _, e := range []error{engine.ErrUnavailable, engine.ErrInvalid, engine.ErrUnknownModel} {
					if errors.Is(err, e) {
						t.Errorf("Generate error = %v wraps %v", err, e)
					}
				}
			}
			var se *StatusError
			if tt.status != 0 && (!errors.As(err, &se) || se.Status != tt.status) {
				t.Errorf("Generate error = %v, want a *StatusError with status %d", err, tt.status)
			}
		})
	}
}

func TestGenerateStreamErrors(t *testing.T) {
	tests := []struct {
		name   string
		events []string
		want   string
	}{
		{"error event", []string{vllmChatEvents[1], `data: {"error":{"object":"error","message":"engine died","type":"InternalServerError","code":500}}` + "\n\n"}, "engine died"},
		{"flat error event", []string{vllmChatEvents[1], `data: {"object":"error","message":"engine died","code":500}` + "\n\n"}, "engine died"},
		{"cut short", []string{vllmChatEvents[1]}, io.ErrUnexpectedEOF.Error()},
		{"bad json", []string{vllmChatEvents[1], "data: {nope\n\n"}, "decoding chunk"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := startEngine(t, &fakeEngine{contentType: "text/event-stream", events: tt.events})
			s, err := c.Generate(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)})
			if err != nil {
				t.Fatalf("Generate: %v", err)
			}
			defer s.Close()
			if ev, err := s.Recv(); err != nil || ev.Text != "Hello" {
				t.Fatalf("first Recv = %+v, %v", ev, err)
			}
			_, err = s.Recv()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Recv error = %v, want one mentioning %q", err, tt.want)
			}
		})
	}
}

func TestGenerateCancelCancelsEngine(t *testing.T) {
	for _, how := range []string{"context", "close"} {
		t.Run(how, func(t *testing.T) {
			fe := &fakeEngine{contentType: "text/event-stream", events: vllmChatEvents[:2], hold: true, done: make(chan struct{})}
			c := startEngine(t, fe)
			ctx, cancel := context.WithCancel(testContext(t))
			defer cancel()
			s, err := c.Generate(ctx, &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)})
			if err != nil {
				t.Fatalf("Generate: %v", err)
			}
			defer s.Close()
			if ev, err := s.Recv(); err != nil || ev.Text != "Hello" {
				t.Fatalf("Recv = %+v, %v", ev, err)
			}
			if how == "context" {
				cancel()
				if _, err := s.Recv(); !errors.Is(err, context.Canceled) {
					t.Errorf("Recv after cancel = %v, want context.Canceled", err)
				}
			} else {
				s.Close()
			}
			select {
			case <-fe.done:
			case <-time.After(5 * time.Second):
				t.Fatal("the engine's request context was never done")
			}
		})
	}
}

func TestCheck(t *testing.T) {
	var status atomic.Int32
	status.Store(200)
	var path atomic.Value
	c := startEngine(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		path.Store(r.Method + " " + r.URL.Path)
		w.WriteHeader(int(status.Load()))
	}))
	ctx := testContext(t)
	if err := c.Check(ctx); err != nil {
		t.Errorf("Check on 200 = %v, want nil", err)
	}
	if got := path.Load(); got != "GET /health" {
		t.Errorf("Check requested %q, want GET /health", got)
	}
	status.Store(503) // llama-server while loading its model
	if err := c.Check(ctx); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Check on 503 = %v, want ErrUnavailable", err)
	}

	refused, err := New(closedURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer refused.Close()
	if err := refused.Check(ctx); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Check with nothing listening = %v, want ErrUnavailable", err)
	}
}

func TestNew(t *testing.T) {
	tests := []struct {
		url     string
		wantErr bool
		base    string
	}{
		{"http://127.0.0.1:8000", false, "http://127.0.0.1:8000"},
		{"http://127.0.0.1:8000/", false, "http://127.0.0.1:8000"},
		{"https://engine.internal/prefix/", false, "https://engine.internal/prefix"},
		{"", true, ""},
		{"127.0.0.1:8000", true, ""},
		{"ftp://host", true, ""},
		{"http://", true, ""},
		{"http://host/?q=1", true, ""},
		{"http://user:pw@host", true, ""},
		{"http://host:8000/%zz", true, ""},
	}
	for _, tt := range tests {
		c, err := New(tt.url)
		if (err != nil) != tt.wantErr {
			t.Errorf("New(%q) error = %v, want error %v", tt.url, err, tt.wantErr)
			continue
		}
		if err == nil {
			if c.base != tt.base {
				t.Errorf("New(%q).base = %q, want %q", tt.url, c.base, tt.base)
			}
			c.Close()
		}
	}
}

func TestValueStart(t *testing.T) {
	tests := []struct {
		data, key string
		want      byte
	}{
		{`{"usage":{"prompt_tokens":1}}`, `"usage"`, '{'},
		{`{"usage": null}`, `"usage"`, 'n'},
		{`{"a":"\"usage\": {"}`, `"usage"`, 0},
		{`{"a":"usage","usage" : {}}`, `"usage"`, '{'},
		{`{"finish_reason":null}`, `"finish_reason"`, 'n'},
		{`{"finish_reason":"stop"}`, `"finish_reason"`, '"'},
		{`{}`, `"usage"`, 0},
	}
	for _, tt := range tests {
		if got := valueStart([]byte(tt.data), tt.key); got != tt.want {
			t.Errorf("valueStart(%s, %s) = %q, want %q", tt.data, tt.key, got, tt.want)
		}
	}
}

// discardWriter is a ResponseWriter that keeps nothing, for benchmarks.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

// BenchmarkRelayEvents measures relaying a 256-token vLLM stream; once the
// first token is seen, token chunks should cost no allocation.
func BenchmarkRelayEvents(b *testing.B) {
	var sb strings.Builder
	sb.WriteString(vllmChatEvents[0])
	for range 256 {
		sb.WriteString(vllmChatEvents[1])
	}
	for _, ev := range vllmChatEvents[3:] {
		sb.WriteString(ev)
	}
	stream := sb.String()
	w := &discardWriter{h: http.Header{}}
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		rw := &relayWriter{w: w, rc: http.NewResponseController(w), onFirst: func() {}}
		var u usageTracker
		if err := rw.relayEvents(strings.NewReader(stream), &u, true); err != nil {
			b.Fatal(err)
		}
		if u.usage == nil {
			b.Fatal("no usage")
		}
	}
}

// bufferedBody is a response body that has all of itself buffered, as an
// engine's short answer that arrived with its header: as net/http's
// chunked reader, it tells its end with its last bytes.
type bufferedBody struct{ *strings.Reader }

func (b bufferedBody) Buffered() int { return b.Len() }

func (b bufferedBody) Read(p []byte) (int, error) {
	n, err := b.Reader.Read(p)
	if err == nil && b.Len() == 0 {
		err = io.EOF
	}
	return n, err
}

// endRecorder is a flushRecorder that can end its body early, as baton's
// HTTP/1.1 server's ResponseWriter.
type endRecorder struct {
	*flushRecorder
	ends []int
}

func (r *endRecorder) EndBody() error {
	r.ends = append(r.ends, r.Body.Len())
	return nil
}

// A stream that arrived whole is relayed in one write: its events and
// the body's end together, the first token reported after it.
func TestRelayEventsEndsBodyInOneWrite(t *testing.T) {
	all := strings.Join(vllmChatEvents, "")
	rec := &endRecorder{flushRecorder: newRecorder()}
	var atFirst []int
	rw := &relayWriter{w: rec, rc: http.NewResponseController(rec.flushRecorder)}
	rw.onFirst = func() { atFirst = slices.Clone(rec.ends) }
	var u usageTracker
	if err := rw.relayEvents(bufferedBody{strings.NewReader(all)}, &u, true); err != nil {
		t.Fatalf("relayEvents: %v", err)
	}
	if rec.Body.String() != all {
		t.Errorf("relayed %q, want %q", rec.Body.String(), all)
	}
	if len(rec.flushes) != 0 {
		t.Errorf("flushed at %v; want no flush before the body's end", rec.flushes)
	}
	if want := []int{len(all)}; !slices.Equal(rec.ends, want) {
		t.Errorf("body ended at %v, want %v", rec.ends, want)
	}
	if want := []int{len(all)}; !slices.Equal(atFirst, want) {
		t.Errorf("first token reported when the ends were %v, want %v (after the body left)", atFirst, want)
	}
}
