package frontend

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler/metrics"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/engine"
)

// The coordinator's tests drive a Server's handler directly, with no
// network, over workers whose engines are fakes, and a strategy that
// picks in name order and records what each attempt tells it.

// fakeEngine answers Generate with err, or with a stream of one token and
// its usage; with hold set, the stream's first Recv waits for hold to
// close (or the request's context to end, which it reports on cancelled).
type fakeEngine struct {
	err       error
	hold      chan struct{}
	cancelled chan struct{}
	called    chan struct{} // if set, hears each call (buffer it)

	mu    sync.Mutex
	calls int
}

func (f *fakeEngine) Generate(ctx context.Context, req *engine.Request) (engine.Stream, error) {
	f.mu.Lock()
	f.calls++
	f.mu.Unlock()
	if f.called != nil {
		f.called <- struct{}{}
	}
	if f.err != nil {
		return nil, f.err
	}
	return &fakeStream{ctx: ctx, f: f}, nil
}

func (f *fakeEngine) Check(context.Context) error { return nil }
func (f *fakeEngine) Close() error                { return nil }

func (f *fakeEngine) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

type fakeStream struct {
	ctx context.Context
	f   *fakeEngine
	n   int
}

func (s *fakeStream) Recv() (engine.Event, error) {
	s.n++
	switch s.n {
	case 1:
		if s.f.hold != nil {
			select {
			case <-s.f.hold:
			case <-s.ctx.Done():
				if s.f.cancelled != nil {
					close(s.f.cancelled)
				}
				return engine.Event{}, s.ctx.Err()
			}
		}
		return engine.Event{Text: "hi", Tokens: 1}, nil
	case 2:
		return engine.Event{Final: &engine.Final{FinishReason: "stop", PromptTokens: 3, CompletionTokens: 1}}, nil
	}
	return engine.Event{}, io.EOF
}

func (s *fakeStream) Close() error { return nil }

// orderStrategy picks the first worker by name that is available, not
// tried and under the request's capacity; first, if set, is returned by
// the first Pick whatever the snapshot holds (a decision made on a worker
// that has since left). It records each attempt's feedback in log, and
// signals full each time it finds every worker at capacity.
type orderStrategy struct {
	first *pool.Worker
	full  chan struct{}

	mu  sync.Mutex
	log []string
}

func (o *orderStrategy) Name() string { return "order" }

func (o *orderStrategy) Pick(req *routing.Request, snap *pool.Snapshot) (routing.Decision, error) {
	o.mu.Lock()
	first := o.first
	o.first = nil
	o.mu.Unlock()
	if first != nil {
		return routing.Decision{Worker: first}, nil
	}
	busy := false
	for _, w := range snap.Workers {
		if !w.Available() || slices.Contains(req.Tried, w) {
			continue
		}
		if req.MaxInFlight > 0 && w.InFlight() >= req.MaxInFlight {
			busy = true
			continue
		}
		return routing.Decision{Worker: w}, nil
	}
	if busy {
		if o.full != nil {
			o.full <- struct{}{}
		}
		return routing.Decision{}, routing.ErrFull
	}
	return routing.Decision{}, routing.ErrNoWorker
}

func (o *orderStrategy) record(format string, args ...any) {
	o.mu.Lock()
	o.log = append(o.log, fmt.Sprintf(format, args...))
	o.mu.Unlock()
}

func (o *orderStrategy) Commit(_ *routing.Request, d routing.Decision) {
	o.record("commit %s", d.Worker.Name)
}

func (o *orderStrategy) Done(_ *routing.Request, d routing.Decision, info routing.DoneInfo) {
	if info.Err != nil {
		o.record("done %s error", d.Worker.Name)
		return
	}
	o.record("done %s first token", d.Worker.Name)
}

func (o *orderStrategy) Finish(_ *routing.Request, d routing.Decision, info routing.FinishInfo) {
	o.record("finish %s usage=%t", d.Worker.Name, info.Usage)
}

func (o *orderStrategy) Log() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.log)
}

type coordFixture struct {
	srv      *Server
	pool     *pool.Pool
	strategy *orderStrategy
	workers  map[string]*pool.Worker
}

// newCoordinator serves engines (by worker name) with cfg.
func newCoordinator(t *testing.T, cfg Config, engines map[string]*fakeEngine) *coordFixture {
	t.Helper()
	p, err := pool.New(pool.Config{HealthInterval: time.Hour, BreakerFailures: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	f := &coordFixture{pool: p, strategy: &orderStrategy{}, workers: map[string]*pool.Worker{}}
	for name, e := range engines {
		w := &pool.Worker{Name: name, Client: e}
		if err := p.Add(w); err != nil {
			t.Fatal(err)
		}
		f.workers[name] = w
	}
	f.srv, err = New(cfg, p, f.strategy, metrics.New(p.Snapshot), nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":4}`

// do serves one chat completion request with ctx.
func (f *coordFixture) do(ctx context.Context, body string) *httptest.ResponseRecorder {
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	f.srv.ServeHTTP(w, r)
	return w
}

func (f *coordFixture) inFlight() int {
	n := 0
	for _, w := range f.workers {
		n += w.InFlight()
	}
	return n
}

func TestCoordinatorRetriesOnAnotherWorker(t *testing.T) {
	a := &fakeEngine{err: fmt.Errorf("%w: dial tcp 10.0.0.7:8000: connection refused", engine.ErrUnavailable)}
	b := &fakeEngine{}
	f := newCoordinator(t, Config{}, map[string]*fakeEngine{"a": a, "b": b})
	w := f.do(t.Context(), chatBody)
	if w.Code != http.StatusOK || w.Header().Get(HeaderWorker) != "b" || !strings.Contains(w.Body.String(), `"hi"`) {
		t.Fatalf("status %d, worker %q, body %s", w.Code, w.Header().Get(HeaderWorker), w.Body)
	}
	want := []string{"commit a", "done a error", "finish a usage=false", "commit b", "done b first token", "finish b usage=true"}
	if got := f.strategy.Log(); !slices.Equal(got, want) {
		t.Errorf("the strategy heard %q, want %q", got, want)
	}
	if n := f.inFlight(); n != 0 {
		t.Errorf("%d calls still in flight", n)
	}
}

func TestCoordinatorAllWorkersFail(t *testing.T) {
	down := func() *fakeEngine {
		return &fakeEngine{err: fmt.Errorf("%w: dial tcp 10.0.0.7:8000: connection refused", engine.ErrUnavailable)}
	}
	f := newCoordinator(t, Config{}, map[string]*fakeEngine{"a": down(), "b": down(), "c": down()})
	w := f.do(t.Context(), chatBody)
	if w.Code != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want 503: %s", w.Code, w.Body)
	}
	if strings.Contains(w.Body.String(), "10.0.0.7") {
		t.Errorf("the client's error names the engine's address: %s", w.Body)
	}
	if got := len(f.strategy.Log()); got != 9 {
		t.Errorf("the strategy heard %d reports, want 3 per worker: %q", got, f.strategy.Log())
	}
}

// An error the request caused is the client's answer, tried nowhere else,
// and never opens the worker's breaker.
func TestCoordinatorRequestFaultIsNotTheWorkers(t *testing.T) {
	a := &fakeEngine{err: fmt.Errorf("%w: max_tokens too large", engine.ErrInvalid)}
	b := &fakeEngine{}
	f := newCoordinator(t, Config{}, map[string]*fakeEngine{"a": a, "b": b})
	for i := range 5 {
		if w := f.do(t.Context(), chatBody); w.Code != http.StatusBadRequest {
			t.Fatalf("request %d: status %d, want 400: %s", i, w.Code, w.Body)
		}
	}
	if b.Calls() != 0 {
		t.Errorf("a request the worker rejected was tried on another %d times", b.Calls())
	}
	if !f.workers["a"].Available() {
		t.Error("requests' own errors opened the worker's breaker")
	}
}

// A decision whose worker refuses the call (it left the pool since the
// pick) is picked again, with nothing committed for it.
func TestCoordinatorPicksAgainWhenTheCallIsRefused(t *testing.T) {
	gone := &pool.Worker{Name: "gone", Client: &fakeEngine{}}
	b := &fakeEngine{}
	f := newCoordinator(t, Config{}, map[string]*fakeEngine{"b": b})
	if err := f.pool.Add(gone); err != nil {
		t.Fatal(err)
	}
	f.pool.Remove("gone")
	f.strategy.first = gone
	w := f.do(t.Context(), chatBody)
	if w.Code != http.StatusOK || w.Header().Get(HeaderWorker) != "b" {
		t.Fatalf("status %d, worker %q: %s", w.Code, w.Header().Get(HeaderWorker), w.Body)
	}
	want := []string{"commit b", "done b first token", "finish b usage=true"}
	if got := f.strategy.Log(); !slices.Equal(got, want) {
		t.Errorf("the strategy heard %q, want %q", got, want)
	}
}

// With every worker at capacity a request waits in the queue and is
// served when one frees up; past the queue's bound it gets a 429.
func TestCoordinatorQueue(t *testing.T) {
	a := &fakeEngine{hold: make(chan struct{}), called: make(chan struct{}, 8)}
	f := newCoordinator(t, Config{MaxInFlight: 1, MaxQueue: 1}, map[string]*fakeEngine{"a": a})
	f.strategy.full = make(chan struct{}, 16)
	first := make(chan *httptest.ResponseRecorder)
	go func() { first <- f.do(t.Context(), chatBody) }()
	<-a.called // the first request holds the worker
	second := make(chan *httptest.ResponseRecorder)
	go func() { second <- f.do(t.Context(), chatBody) }()
	// The second request finds the worker full, takes the queue's one
	// slot, and finds it full again before it waits.
	<-f.strategy.full
	<-f.strategy.full
	if w := f.do(t.Context(), chatBody); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") == "" {
		t.Fatalf("third request with the queue full: status %d, Retry-After %q: %s", w.Code, w.Header().Get("Retry-After"), w.Body)
	}
	<-f.strategy.full // the third's pick
	close(a.hold)
	for _, ch := range []chan *httptest.ResponseRecorder{first, second} {
		if w := <-ch; w.Code != http.StatusOK {
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
	if n := f.inFlight(); n != 0 {
		t.Errorf("%d calls still in flight", n)
	}
}

// A client that goes away cancels its engine's work, and the attempt
// ends: the slot is released and the strategy hears of it once.
func TestCoordinatorClientGoneCancelsTheEngine(t *testing.T) {
	a := &fakeEngine{hold: make(chan struct{}), cancelled: make(chan struct{}), called: make(chan struct{}, 1)}
	f := newCoordinator(t, Config{}, map[string]*fakeEngine{"a": a})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { f.do(ctx, chatBody); close(done) }()
	<-a.called
	cancel()
	<-a.cancelled
	<-done
	want := []string{"commit a", "done a error", "finish a usage=false"}
	if got := f.strategy.Log(); !slices.Equal(got, want) {
		t.Errorf("the strategy heard %q, want %q", got, want)
	}
	if n := f.inFlight(); n != 0 {
		t.Errorf("%d calls still in flight", n)
	}
	if !f.workers["a"].Available() {
		t.Error("a client's cancel counted against the worker")
	}
	if a.Calls() != 1 {
		t.Errorf("engine called %d times, want 1", a.Calls())
	}
}
