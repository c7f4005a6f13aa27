package kvstore_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
)

var errDown = errors.New("store down")

// fakeStore fails every call while err is set.
type fakeStore struct {
	mu     sync.Mutex
	err    error
	calls  int
	closed int
}

func (f *fakeStore) result() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	return f.err
}

func (f *fakeStore) set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

func (f *fakeStore) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

func (f *fakeStore) Put(context.Context, transfer.Namespace, []transfer.Block) error {
	return f.result()
}

func (f *fakeStore) Get(_ context.Context, _ transfer.Namespace, keys []uint64, _ int) ([][]byte, error) {
	if err := f.result(); err != nil {
		return nil, err
	}
	return make([][]byte, len(keys)), nil
}

func (f *fakeStore) Exists(_ context.Context, _ transfer.Namespace, keys []uint64) ([]bool, error) {
	if err := f.result(); err != nil {
		return nil, err
	}
	return make([]bool, len(keys)), nil
}

func (f *fakeStore) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed++
	return nil
}

func TestBreakerOpensAfterConsecutiveFailures(t *testing.T) {
	f := &fakeStore{err: errDown}
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 2, OpenTimeout: time.Minute})
	ns := transfer.Namespace{Model: "m"}
	for i := range 2 {
		if _, err := b.Get(context.Background(), ns, []uint64{1}, 64); !errors.Is(err, errDown) {
			t.Fatalf("call %d: error %v, want the store's", i, err)
		}
	}
	_, err := b.Get(context.Background(), ns, []uint64{1}, 64)
	if !errors.Is(err, transfer.ErrBypassed) || !errors.Is(err, gobreaker.ErrOpenState) {
		t.Fatalf("third call: error %v, want ErrBypassed and gobreaker.ErrOpenState", err)
	}
	if got := f.count(); got != 2 {
		t.Errorf("store saw %d calls, want 2", got)
	}
}

func TestBreakerSuccessResetsFailures(t *testing.T) {
	f := &fakeStore{}
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{OpenTimeout: time.Minute})
	ns := transfer.Namespace{Model: "m"}
	for range 5 { // 2 failures, 1 success, …: never 3 in a row
		f.set(errDown)
		b.Exists(context.Background(), ns, []uint64{1})
		b.Exists(context.Background(), ns, []uint64{1})
		f.set(nil)
		if _, err := b.Exists(context.Background(), ns, []uint64{1}); err != nil {
			t.Fatalf("Exists: %v", err)
		}
	}
	if got := b.State(); got != gobreaker.StateClosed {
		t.Errorf("state %v, want closed", got)
	}
}

func TestBreakerCancelledCallsDoNotCount(t *testing.T) {
	f := &fakeStore{err: context.Canceled}
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 1})
	for range 5 {
		b.Put(context.Background(), transfer.Namespace{Model: "m"}, nil)
	}
	if got := b.State(); got != gobreaker.StateClosed {
		t.Errorf("after cancelled calls the breaker is %v, want closed", got)
	}
}

// On synctest's fake clock: sleeps past the open timeout take no time.
func TestBreakerHalfOpen(t *testing.T) { synctest.Test(t, testBreakerHalfOpen) }

func testBreakerHalfOpen(t *testing.T) {
	const timeout = 50 * time.Millisecond
	f := &fakeStore{err: errDown}
	var tr transitions
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Name: "tier", Failures: 1, OpenTimeout: timeout},
		kvstore.OnStateChange(tr.record))
	ns := transfer.Namespace{Model: "m"}
	ctx := context.Background()

	b.Get(ctx, ns, []uint64{1}, 64) // opens
	time.Sleep(timeout + 20*time.Millisecond)
	if _, err := b.Get(ctx, ns, []uint64{1}, 64); !errors.Is(err, errDown) {
		t.Fatalf("failed probe: error %v, want the store's", err)
	}
	if got := b.State(); got != gobreaker.StateOpen {
		t.Fatalf("after a failed probe the breaker is %v, want open", got)
	}

	f.set(nil)
	time.Sleep(timeout + 20*time.Millisecond)
	if _, err := b.Get(ctx, ns, []uint64{1}, 64); err != nil {
		t.Fatalf("probe: %v", err)
	}
	if got := b.State(); got != gobreaker.StateClosed {
		t.Fatalf("after a good probe the breaker is %v, want closed", got)
	}
	want := "[closed→open open→half-open half-open→open open→half-open half-open→closed]"
	if got := tr.String(); got != want {
		t.Errorf("transitions = %s, want %s", got, want)
	}
	if got := b.Name(); got != "tier" {
		t.Errorf("Name = %q, want tier", got)
	}
}

// A half-open breaker lets one probe through; calls during it are
// bypassed.
// On synctest's fake clock: sleeps past the open timeout take no time.
func TestBreakerHalfOpenLetsOneProbe(t *testing.T) { synctest.Test(t, testBreakerHalfOpenLetsOneProbe) }

func testBreakerHalfOpenLetsOneProbe(t *testing.T) {
	const timeout = 50 * time.Millisecond
	block := make(chan struct{})
	f := &slowStore{fakeStore: fakeStore{err: errDown}, block: block}
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 1, OpenTimeout: timeout})
	ns := transfer.Namespace{Model: "m"}
	ctx := context.Background()
	b.Exists(ctx, ns, nil) // opens
	f.set(nil)
	f.slow = true
	time.Sleep(timeout + 20*time.Millisecond)

	done := make(chan error)
	go func() { _, err := b.Exists(ctx, ns, nil); done <- err }()
	synctest.Wait() // the probe is inside the store, blocked
	if n := f.count(); n != 2 {
		t.Fatalf("%d calls reached the store, want 2 (the one that opened it, the probe)", n)
	}
	if _, err := b.Exists(ctx, ns, nil); !errors.Is(err, transfer.ErrBypassed) || !errors.Is(err, gobreaker.ErrTooManyRequests) {
		t.Errorf("call during the probe: error %v, want ErrBypassed and gobreaker.ErrTooManyRequests", err)
	}
	close(block)
	if err := <-done; err != nil {
		t.Errorf("probe: %v", err)
	}
}

type slowStore struct {
	fakeStore
	slow  bool
	block chan struct{}
}

func (s *slowStore) Exists(ctx context.Context, ns transfer.Namespace, keys []uint64) ([]bool, error) {
	ok, err := s.fakeStore.Exists(ctx, ns, keys)
	if s.slow {
		<-s.block
	}
	return ok, err
}

func TestBreakerClosesStore(t *testing.T) {
	f := &fakeStore{err: errDown}
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 1})
	b.Put(context.Background(), transfer.Namespace{}, nil) // open: Close still reaches the store
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if f.closed != 1 {
		t.Errorf("store closed %d times, want 1", f.closed)
	}
}

// OnError sees the store's errors and the breaker's refusals, by
// operation, and not cancelled calls.
func TestBreakerOnError(t *testing.T) {
	f := &fakeStore{err: errDown}
	type report struct {
		op       kvstore.Op
		bypassed bool
	}
	var got []report
	b := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 2, OpenTimeout: time.Minute},
		kvstore.OnError(func(op kvstore.Op, err error) {
			got = append(got, report{op, errors.Is(err, transfer.ErrBypassed)})
		}))
	ctx := context.Background()
	ns := transfer.Namespace{Model: "m"}
	b.Put(ctx, ns, nil)
	b.Exists(ctx, ns, nil) // opens
	b.Get(ctx, ns, nil, 64)
	want := []report{{kvstore.OpPut, false}, {kvstore.OpExists, false}, {kvstore.OpGet, true}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(report{})); diff != "" {
		t.Errorf("reports (-want +got):\n%s", diff)
	}

	got = nil
	f.set(context.Canceled)
	c := kvstore.NewBreaker(f, kvstore.BreakerConfig{}, kvstore.OnError(func(op kvstore.Op, err error) {
		got = append(got, report{op, false})
	}))
	c.Put(ctx, ns, nil)
	if len(got) != 0 {
		t.Errorf("cancelled call reported: %v", got)
	}
}
