package pool

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/workers/engine"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClient is an engine.Client whose Check returns a settable error.
type fakeClient struct {
	mu       sync.Mutex
	checkErr error
	checks   int
}

func (c *fakeClient) setCheckErr(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.checkErr = err
}

func (c *fakeClient) Check(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.checks++
	return c.checkErr
}

func (c *fakeClient) Generate(context.Context, *engine.Request) (engine.Stream, error) {
	return nil, io.EOF
}

func (c *fakeClient) Close() error { return nil }

var _ engine.Client = (*fakeClient)(nil)

func newWorker(name string) *Worker {
	return &Worker{Name: name, Addr: name + ":9000", Client: &fakeClient{}}
}

// newPool returns a pool that checks health rarely (tests call CheckNow)
// and is closed when the test ends.
func newPool(t *testing.T, cfg Config, opts ...Option) *Pool {
	t.Helper()
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = time.Hour
	}
	p, err := New(cfg, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func names(s *Snapshot) []string {
	var out []string
	for _, w := range s.Workers {
		out = append(out, w.Name)
	}
	return out
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"zero means defaults", Config{}, ""},
		{"defaults", Default(), ""},
		{"timeout equal to interval", Config{HealthInterval: time.Second, HealthTimeout: time.Second}, ""},
		{"short interval shortens default timeout", Config{HealthInterval: 100 * time.Millisecond}, ""},
		{"negative open timeout", Config{BreakerOpenTimeout: -1}, "breaker_open_timeout: must be positive, got -1ns"},
		{"negative interval", Config{HealthInterval: -time.Second}, "health_interval: must be positive, got -1s"},
		{"negative timeout", Config{HealthTimeout: -time.Second}, "health_timeout: must be positive, got -1s"},
		{"timeout over interval", Config{HealthInterval: time.Second, HealthTimeout: 3 * time.Second}, "health_timeout: must not exceed health_interval (1s), got 3s"},
		{"timeout over default interval", Config{HealthTimeout: 3 * time.Second}, "health_timeout: must not exceed health_interval (2s), got 3s"},
		{"negative unhealthy_after", Config{UnhealthyAfter: -1}, "unhealthy_after: must be at least 1, got -1"},
		{"negative concurrency", Config{HealthConcurrency: -2}, "health_concurrency: must be at least 1, got -2"},
		{"negative vnodes", Config{VirtualNodes: -2}, "virtual_nodes: must be at least 1, got -2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			got := ""
			if err != nil {
				got = err.Error()
			}
			if got != tt.wantErr {
				t.Errorf("Validate() = %q, want %q", got, tt.wantErr)
			}
		})
	}
}

func TestNewRejectsInvalidConfig(t *testing.T) {
	if _, err := New(Config{UnhealthyAfter: -1}); err == nil {
		t.Fatal("New with unhealthy_after -1 succeeded, want error")
	}
}

func TestDefaultsFillZeroFields(t *testing.T) {
	if diff := cmp.Diff(Default(), Config{}.withDefaults()); diff != "" {
		t.Errorf("zero config with defaults (-want +got):\n%s", diff)
	}
}

func TestMembership(t *testing.T) {
	p := newPool(t, Config{})
	if got := len(p.Snapshot().Workers); got != 0 {
		t.Fatalf("new pool has %d workers, want 0", got)
	}
	if got := p.Snapshot().Ring.Len(); got != 0 {
		t.Fatalf("new pool's ring has %d members, want 0", got)
	}

	b, a, c := newWorker("b"), newWorker("a"), newWorker("c")
	for _, w := range []*Worker{b, a, c} {
		if err := p.Add(w); err != nil {
			t.Fatalf("Add(%s): %v", w.Name, err)
		}
	}
	s1 := p.Snapshot()
	if diff := cmp.Diff([]string{"a", "b", "c"}, names(s1)); diff != "" {
		t.Errorf("workers after Add (-want +got):\n%s", diff)
	}
	for i, w := range s1.Workers {
		if got := s1.Ring.Member(i); got != w.Name {
			t.Errorf("ring member %d = %s, want %s", i, got, w.Name)
		}
	}
	if got := s1.Worker("b"); got != b {
		t.Errorf("Snapshot.Worker(b) = %v, want worker b", got)
	}
	if got := s1.Worker("zz"); got != nil {
		t.Errorf("Snapshot.Worker(zz) = %v, want nil", got)
	}

	if got := p.Remove("b"); got != b {
		t.Errorf("Remove(b) = %v, want worker b", got)
	}
	if got := p.Remove("b"); got != nil {
		t.Errorf("second Remove(b) = %v, want nil", got)
	}
	s2 := p.Snapshot()
	if diff := cmp.Diff([]string{"a", "c"}, names(s2)); diff != "" {
		t.Errorf("workers after Remove (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"a", "b", "c"}, names(s1)); diff != "" {
		t.Errorf("earlier snapshot changed (-want +got):\n%s", diff)
	}

	// Set keeps the same *Worker, with its in-flight count.
	done, err := a.Acquire()
	if err != nil {
		t.Fatal(err)
	}
	d := newWorker("d")
	if err := p.Set([]*Worker{d, a}); err != nil {
		t.Fatalf("Set: %v", err)
	}
	s3 := p.Snapshot()
	if diff := cmp.Diff([]string{"a", "d"}, names(s3)); diff != "" {
		t.Errorf("workers after Set (-want +got):\n%s", diff)
	}
	if got := s3.Worker("a").InFlight(); got != 1 {
		t.Errorf("a's in-flight after Set = %d, want 1 (shared across snapshots)", got)
	}
	done(nil)
	if got := s1.Worker("a").InFlight(); got != 0 {
		t.Errorf("a's in-flight in first snapshot after done = %d, want 0", got)
	}
}

func TestAddReplacesSameName(t *testing.T) {
	p := newPool(t, Config{})
	old, repl := newWorker("a"), newWorker("a")
	if err := p.Add(old); err != nil {
		t.Fatal(err)
	}
	if err := p.Add(repl); err != nil {
		t.Fatal(err)
	}
	if got := p.Snapshot().Workers; len(got) != 1 || got[0] != repl {
		t.Errorf("workers after replacing a = %v, want the replacement only", names(p.Snapshot()))
	}
}

func TestInvalidMembership(t *testing.T) {
	p := newPool(t, Config{})
	other := newPool(t, Config{})
	taken := newWorker("taken")
	if err := other.Add(taken); err != nil {
		t.Fatal(err)
	}
	if err := p.Add(newWorker("keep")); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		change  func() error
		wantErr string
	}{
		{"add nil", func() error { return p.Add(nil) }, "nil worker"},
		{"add empty name", func() error { return p.Add(&Worker{Client: &fakeClient{}}) }, "worker with empty name"},
		{"add nil client", func() error { return p.Add(&Worker{Name: "x"}) }, `worker "x": nil client`},
		{"add other pool's worker", func() error { return p.Add(taken) }, `worker "taken": belongs to another pool`},
		{"set duplicate", func() error { return p.Set([]*Worker{newWorker("x"), newWorker("x")}) }, `worker "x": name given twice`},
		{"set nil", func() error { return p.Set([]*Worker{newWorker("x"), nil}) }, "nil worker"},
		{"set other pool's worker", func() error { return p.Set([]*Worker{newWorker("x"), taken}) }, `worker "taken": belongs to another pool`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.change()
			if err == nil || err.Error() != tt.wantErr {
				t.Fatalf("error = %v, want %q", err, tt.wantErr)
			}
			if diff := cmp.Diff([]string{"keep"}, names(p.Snapshot())); diff != "" {
				t.Errorf("membership changed by a failed change (-want +got):\n%s", diff)
			}
		})
	}
}

func TestServes(t *testing.T) {
	tests := []struct {
		models []string
		model  string
		want   bool
	}{
		{nil, "llama", true},
		{[]string{"llama", "qwen"}, "qwen", true},
		{[]string{"llama"}, "qwen", false},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v/%s", tt.models, tt.model), func(t *testing.T) {
			w := &Worker{Models: tt.models}
			if got := w.Serves(tt.model); got != tt.want {
				t.Errorf("Serves(%q) = %t, want %t", tt.model, got, tt.want)
			}
		})
	}
}

func TestInFlight(t *testing.T) {
	p := newPool(t, Config{})
	w := newWorker("a")
	if err := p.Add(w); err != nil {
		t.Fatal(err)
	}
	var dones []func(error)
	for i := 1; i <= 3; i++ {
		done, err := w.Acquire()
		if err != nil {
			t.Fatalf("Acquire %d: %v", i, err)
		}
		dones = append(dones, done)
		if got := w.InFlight(); got != i {
			t.Errorf("in-flight after %d acquires = %d, want %d", i, got, i)
		}
	}
	dones[0](nil)
	dones[0](nil) // ignored
	if got := w.InFlight(); got != 2 {
		t.Errorf("in-flight after one done called twice = %d, want 2", got)
	}
	dones[1](nil)
	dones[2](errors.New("boom"))
	if got := w.InFlight(); got != 0 {
		t.Errorf("in-flight after every done = %d, want 0", got)
	}
}

func TestIsWorkerFault(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"canceled", context.Canceled, false},
		{"wrapped canceled", fmt.Errorf("stream: %w", context.Canceled), false},
		{"client error", ClientError(errors.New("bad request")), false},
		{"wrapped client error", fmt.Errorf("generate: %w", ClientError(errors.New("bad request"))), false},
		{"invalid request", fmt.Errorf("generate: %w", engine.ErrInvalid), false},
		{"unknown model", fmt.Errorf("generate: %w", engine.ErrUnknownModel), false},
		{"too large", fmt.Errorf("generate: %w", engine.ErrTooLarge), false},
		{"client gone", fmt.Errorf("writing: %w: broken pipe", engine.ErrClientGone), false},
		{"deadline", context.DeadlineExceeded, true},
		{"unavailable", fmt.Errorf("dial: %w", engine.ErrUnavailable), true},
		{"other", errors.New("boom"), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := IsWorkerFault(tt.err); got != tt.want {
				t.Errorf("IsWorkerFault(%v) = %t, want %t", tt.err, got, tt.want)
			}
		})
	}
	if ClientError(nil) != nil {
		t.Error("ClientError(nil) != nil")
	}
}

type transition struct {
	Worker   string
	From, To gobreaker.State
}

type recorder struct {
	mu     sync.Mutex
	events []transition
	health []string
}

func (r *recorder) breaker(worker string, from, to gobreaker.State) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, transition{worker, from, to})
}

func (r *recorder) healthChange(worker string, healthy bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.health = append(r.health, fmt.Sprintf("%s healthy=%t", worker, healthy))
}

func (r *recorder) transitions() []transition {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]transition(nil), r.events...)
}

func (r *recorder) healthChanges() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.health...)
}

func fail(t *testing.T, w *Worker, err error) {
	t.Helper()
	done, aerr := w.Acquire()
	if aerr != nil {
		t.Fatalf("Acquire: %v", aerr)
	}
	done(err)
}

// On synctest's fake clock: sleeps past the open timeout take no time.
func TestBreaker(t *testing.T) { synctest.Test(t, testBreaker) }

func testBreaker(t *testing.T) {
	const timeout = 50 * time.Millisecond
	rec := &recorder{}
	p := newPool(t, Config{BreakerFailures: 3, BreakerOpenTimeout: timeout}, OnBreakerChange(rec.breaker))
	w := newWorker("a")
	if err := p.Add(w); err != nil {
		t.Fatal(err)
	}

	// Errors that are not the worker's fault never trip it, and a success
	// resets the run of failures.
	for range 5 {
		fail(t, w, context.Canceled)
		fail(t, w, ClientError(errors.New("bad request")))
	}
	fail(t, w, errors.New("boom"))
	fail(t, w, errors.New("boom"))
	fail(t, w, nil)
	fail(t, w, errors.New("boom"))
	fail(t, w, errors.New("boom"))
	if got := w.BreakerState(); got != gobreaker.StateClosed {
		t.Fatalf("state after two runs of 2 failures = %v, want closed", got)
	}

	fail(t, w, errors.New("boom")) // third consecutive failure
	if got := w.BreakerState(); got != gobreaker.StateOpen {
		t.Fatalf("state after 3 consecutive failures = %v, want open", got)
	}
	if w.Available() {
		t.Error("Available() with open breaker = true, want false")
	}
	if _, err := w.Acquire(); !errors.Is(err, ErrBreakerOpen) || !errors.Is(err, gobreaker.ErrOpenState) {
		t.Errorf("Acquire on open breaker: error %v, want ErrBreakerOpen and gobreaker.ErrOpenState", err)
	}
	if got := w.InFlight(); got != 0 {
		t.Errorf("in-flight after refused Acquire = %d, want 0", got)
	}

	time.Sleep(timeout + 10*time.Millisecond)
	if !w.Available() {
		t.Error("Available() after the open timeout = false, want true (half-open)")
	}
	probe, err := w.Acquire()
	if err != nil {
		t.Fatalf("Acquire on half-open breaker: %v", err)
	}
	if got := w.BreakerState(); got != gobreaker.StateHalfOpen {
		t.Errorf("state during probe = %v, want half-open", got)
	}
	if _, err := w.Acquire(); !errors.Is(err, ErrBreakerOpen) || !errors.Is(err, gobreaker.ErrTooManyRequests) {
		t.Errorf("second Acquire on half-open breaker: error %v, want ErrBreakerOpen and gobreaker.ErrTooManyRequests", err)
	}
	probe(nil)
	if got := w.BreakerState(); got != gobreaker.StateClosed {
		t.Errorf("state after successful probe = %v, want closed", got)
	}

	// A failed probe reopens it.
	for range 3 {
		fail(t, w, errors.New("boom"))
	}
	time.Sleep(timeout + 10*time.Millisecond)
	fail(t, w, errors.New("boom"))
	if got := w.BreakerState(); got != gobreaker.StateOpen {
		t.Errorf("state after failed probe = %v, want open", got)
	}
	if w.Available() {
		t.Error("Available() after failed probe = true, want false")
	}

	closed, half, open := gobreaker.StateClosed, gobreaker.StateHalfOpen, gobreaker.StateOpen
	want := []transition{
		{"a", closed, open}, {"a", open, half}, {"a", half, closed},
		{"a", closed, open}, {"a", open, half}, {"a", half, open},
	}
	if diff := cmp.Diff(want, rec.transitions()); diff != "" {
		t.Errorf("breaker transitions (-want +got):\n%s", diff)
	}
}

func TestHealthChecks(t *testing.T) {
	rec := &recorder{}
	p := newPool(t, Config{UnhealthyAfter: 2}, OnHealthChange(rec.healthChange))
	w, other := newWorker("a"), newWorker("b")
	if err := p.Set([]*Worker{w, other}); err != nil {
		t.Fatal(err)
	}
	c := w.Client.(*fakeClient)
	ctx := context.Background()

	steps := []struct {
		checkErr    error
		wantHealthy bool
	}{
		{nil, true},
		{errors.New("down"), true}, // one failure is not enough
		{errors.New("down"), false},
		{errors.New("down"), false},
		{nil, true}, // one success is
		{errors.New("down"), true},
		{nil, true}, // and resets the count
		{errors.New("down"), true},
	}
	for i, s := range steps {
		c.setCheckErr(s.checkErr)
		p.CheckNow(ctx)
		if got := w.Healthy(); got != s.wantHealthy {
			t.Fatalf("step %d (check error %v): Healthy() = %t, want %t", i, s.checkErr, got, s.wantHealthy)
		}
		if got := w.Available(); got != s.wantHealthy {
			t.Errorf("step %d: Available() = %t, want %t", i, got, s.wantHealthy)
		}
		if !other.Healthy() {
			t.Errorf("step %d: other worker unhealthy", i)
		}
	}
	want := []string{"a healthy=false", "a healthy=true"}
	if diff := cmp.Diff(want, rec.healthChanges()); diff != "" {
		t.Errorf("health changes (-want +got):\n%s", diff)
	}
}

func TestHealthCheckTimeout(t *testing.T) {
	p := newPool(t, Config{UnhealthyAfter: 1, HealthTimeout: 10 * time.Millisecond})
	w := &Worker{Name: "slow", Client: &blockingClient{}}
	if err := p.Add(w); err != nil {
		t.Fatal(err)
	}
	p.CheckNow(context.Background())
	if w.Healthy() {
		t.Error("worker whose check outlives health_timeout is healthy, want unhealthy")
	}
}

// blockingClient's Check waits for its context.
type blockingClient struct{ fakeClient }

func (*blockingClient) Check(ctx context.Context) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestHealthLoop: on synctest's fake clock, the loop checks every
// HealthInterval; a worker turns unhealthy at its UnhealthyAfter'th failed
// round in a row and healthy again at the first good one.
func TestHealthLoop(t *testing.T) { synctest.Test(t, testHealthLoop) }

func testHealthLoop(t *testing.T) {
	const interval = 10 * time.Millisecond
	p := newPool(t, Config{HealthInterval: interval, HealthTimeout: interval, UnhealthyAfter: 2})
	w := newWorker("a")
	if err := p.Add(w); err != nil {
		t.Fatal(err)
	}
	c := w.Client.(*fakeClient)
	c.setCheckErr(errors.New("down"))
	// Half an interval off the ticks, so that each step sees whole rounds.
	time.Sleep(interval / 2)
	for i, want := range []bool{true, false, false} {
		time.Sleep(interval)
		synctest.Wait()
		if got := w.Healthy(); got != want {
			t.Fatalf("after %d failed rounds Healthy() = %v, want %v", i+1, got, want)
		}
	}
	c.setCheckErr(nil)
	time.Sleep(interval)
	synctest.Wait()
	if !w.Healthy() {
		t.Error("after a good round Healthy() = false, want true")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.checks != 4 {
		t.Errorf("%d checks in 4 intervals, want 4", c.checks)
	}
}

// TestCloseIdempotent: Close returns with a check in flight, and again.
func TestCloseIdempotent(t *testing.T) { synctest.Test(t, testCloseIdempotent) }

func testCloseIdempotent(t *testing.T) {
	const interval = 10 * time.Millisecond
	p, err := New(Config{HealthInterval: interval, HealthTimeout: interval})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Add(&Worker{Name: "slow", Client: &blockingClient{}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(interval + interval/2)
	synctest.Wait() // the first round's check waits for its timeout
	for range 3 {
		if err := p.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
}

// TestConcurrentUse runs membership changes, health rounds, snapshots and
// calls at once; run it with -race.
func TestConcurrentUse(t *testing.T) {
	p := newPool(t, Config{BreakerFailures: 2, BreakerOpenTimeout: time.Millisecond})
	ws := []*Worker{newWorker("a"), newWorker("b"), newWorker("c")}
	if err := p.Set(ws); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				s := p.Snapshot()
				if len(s.Workers) == 0 {
					continue
				}
				w := s.Workers[s.Ring.Lookup(uint64(i*7919+g))]
				_ = w.Available()
				done, err := w.Acquire()
				if err != nil {
					continue
				}
				if i%3 == 0 {
					done(errors.New("boom"))
				} else {
					done(nil)
				}
			}
		})
	}
	wg.Go(func() {
		for i := range 100 {
			if i%2 == 0 {
				p.Remove("b")
			} else if err := p.Add(ws[1]); err != nil {
				t.Error(err)
			}
		}
	})
	wg.Go(func() {
		for range 20 {
			p.CheckNow(context.Background())
		}
	})
	wg.Wait()
	for _, w := range ws {
		if got := w.InFlight(); got != 0 {
			t.Errorf("%s in-flight after all calls ended = %d, want 0", w.Name, got)
		}
	}
}

// TestRemoveDrains: a removed worker finishes the calls it has, refuses
// new ones, and says when the last has ended.
func TestRemoveDrains(t *testing.T) {
	p := newPool(t, Config{})
	w := newWorker("a")
	if err := p.Add(w); err != nil {
		t.Fatal(err)
	}
	done1, err := w.Acquire()
	if err != nil {
		t.Fatal(err)
	}
	done2, err := w.Acquire()
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Remove("a"); got != w {
		t.Fatalf("Remove returned %v, want the worker", got)
	}
	if !w.Removed() {
		t.Error("Removed() = false after Remove")
	}
	if _, err := w.Acquire(); !errors.Is(err, ErrRemoved) {
		t.Errorf("Acquire after Remove: %v, want ErrRemoved", err)
	}
	drained := func() bool {
		select {
		case <-w.Drained():
			return true
		default:
			return false
		}
	}
	done1(nil)
	if drained() {
		t.Fatal("drained with a call in flight")
	}
	done2(nil)
	if !drained() {
		t.Fatal("not drained once its calls ended")
	}
	if got := w.InFlight(); got != 0 {
		t.Errorf("InFlight() = %d, want 0", got)
	}
}

// TestSetRemovesLeftOut: Set retires the workers it leaves out, and keeps
// those it is given again.
func TestSetRemovesLeftOut(t *testing.T) {
	p := newPool(t, Config{})
	a, b := newWorker("a"), newWorker("b")
	if err := p.Set([]*Worker{a, b}); err != nil {
		t.Fatal(err)
	}
	if err := p.Set([]*Worker{a}); err != nil {
		t.Fatal(err)
	}
	if a.Removed() || !b.Removed() {
		t.Errorf("Removed(): a %t, b %t; want false, true", a.Removed(), b.Removed())
	}
	select {
	case <-b.Drained():
	default:
		t.Error("b, idle and removed, is not drained")
	}
}

// TestRemoveRacesAcquire: calls acquired while the worker is removed either
// are refused or hold Drained back until they end; none is acquired once
// it is drained.
func TestRemoveRacesAcquire(t *testing.T) {
	for range 50 {
		p := newPool(t, Config{})
		w := newWorker("a")
		if err := p.Add(w); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var afterDrain atomic.Int64
		for range 4 {
			wg.Go(func() {
				for {
					done, err := w.Acquire()
					if errors.Is(err, ErrRemoved) {
						return
					}
					if err != nil {
						t.Errorf("Acquire: %v", err)
						return
					}
					select {
					case <-w.Drained():
						afterDrain.Add(1) // drained with this call in flight
					default:
					}
					done(nil)
				}
			})
		}
		p.Remove("a")
		<-w.Drained()
		wg.Wait()
		if n := afterDrain.Load(); n > 0 {
			t.Fatalf("%d calls in flight after Drained closed", n)
		}
		if got := w.InFlight(); got != 0 {
			t.Fatalf("InFlight() = %d after every call ended", got)
		}
	}
}

// A snapshot's methods by position read each worker's own status, as the
// Worker's methods do, whatever changes: calls in flight, health, an
// open breaker, models; and the statuses of a worker added, removed or
// replaced follow it into later snapshots.
func TestSnapshotByPosition(t *testing.T) {
	p := newPool(t, Config{BreakerFailures: 1, BreakerOpenTimeout: time.Hour, UnhealthyAfter: 1})
	ws := make([]*Worker, 5)
	for i := range ws {
		ws[i] = newWorker(fmt.Sprint("w", i))
	}
	ws[2].Models = []string{"m"}
	if err := p.Set(ws); err != nil {
		t.Fatal(err)
	}
	check := func(step string) {
		t.Helper()
		s := p.Snapshot()
		for i, w := range s.Workers {
			if got, want := s.Name(i), w.Name; got != want {
				t.Errorf("%s: Name(%d) = %s, want %s", step, i, got, want)
			}
			if got, want := s.Available(i), w.Available(); got != want {
				t.Errorf("%s: Available(%d) = %v, %s's %v", step, i, got, w.Name, want)
			}
			if got, want := s.InFlight(i), w.InFlight(); got != want {
				t.Errorf("%s: InFlight(%d) = %d, %s's %d", step, i, got, w.Name, want)
			}
			for _, m := range []string{"m", "other"} {
				if got, want := s.Serves(i, m), w.Serves(m); got != want {
					t.Errorf("%s: Serves(%d, %s) = %v, %s's %v", step, i, m, got, w.Name, want)
				}
			}
		}
	}
	check("joined")
	done := make([]func(error), 0, 3)
	for range 3 {
		d, err := ws[1].Acquire()
		if err != nil {
			t.Fatal(err)
		}
		done = append(done, d)
	}
	d, err := ws[3].Acquire()
	if err != nil {
		t.Fatal(err)
	}
	d(errors.New("worker fault")) // opens w3's breaker
	ws[4].Client.(*fakeClient).setCheckErr(errors.New("down"))
	p.CheckNow(context.Background())
	ws[0].SetModels([]string{"other"})
	check("changed")
	if p.Snapshot().Available(3) || p.Snapshot().Available(4) || p.Snapshot().InFlight(1) != 3 {
		t.Fatal("the changes did not show")
	}
	for _, d := range done {
		d(nil)
	}
	p.Remove("w1")
	if err := p.Add(newWorker("w1")); err != nil { // a new w1, none in flight
		t.Fatal(err)
	}
	if err := p.Add(newWorker("a")); err != nil { // before every other
		t.Fatal(err)
	}
	check("membership changed")
}

// The statuses of the workers a pool adopts sit side by side, a page's
// worth to a chunk.
func TestStatusesSideBySide(t *testing.T) {
	if got := int(unsafe.Sizeof(status{})); got*statusChunk > 4096 || (got+1)*statusChunk <= 4096 {
		t.Errorf("status: %d bytes, %d to a chunk of 4096", got, statusChunk)
	}
	p := newPool(t, Config{})
	ws := make([]*Worker, 10)
	for i := range ws {
		ws[i] = newWorker(fmt.Sprint("w", i))
	}
	if err := p.Set(ws); err != nil {
		t.Fatal(err)
	}
	for i := 1; i < len(ws); i++ {
		a, b := uintptr(unsafe.Pointer(ws[i-1].status())), uintptr(unsafe.Pointer(ws[i].status()))
		if b-a != unsafe.Sizeof(status{}) {
			t.Errorf("%s's status at %#x, %s's at %#x: not side by side", ws[i-1].Name, a, ws[i].Name, b)
		}
	}
}
