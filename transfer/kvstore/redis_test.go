package kvstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// counting is a Store that counts the calls reaching the store it wraps.
type counting struct {
	transfer.Store
	calls atomic.Int64
}

func (c *counting) Put(ctx context.Context, ns transfer.Namespace, bs []transfer.Block) error {
	c.calls.Add(1)
	return c.Store.Put(ctx, ns, bs)
}

func (c *counting) Get(ctx context.Context, ns transfer.Namespace, keys []uint64, size int) ([][]byte, error) {
	c.calls.Add(1)
	return c.Store.Get(ctx, ns, keys, size)
}

func (c *counting) Exists(ctx context.Context, ns transfer.Namespace, keys []uint64) ([]bool, error) {
	c.calls.Add(1)
	return c.Store.Exists(ctx, ns, keys)
}

// transitions records a breaker's state changes.
type transitions struct {
	mu  sync.Mutex
	got []string
}

func (r *transitions) record(_ string, from, to gobreaker.State) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, fmt.Sprintf("%v→%v", from, to))
}

func (r *transitions) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return fmt.Sprint(r.got)
}

// call runs one Get through s and returns its error and duration.
func call(s transfer.Store, ns transfer.Namespace) (time.Duration, error) {
	start := time.Now()
	_, err := s.Get(context.Background(), ns, []uint64{1, 2}, 1024)
	return time.Since(start), err
}

// waitState waits until b is in state want, at most a few seconds.
func waitState(t *testing.T, b *kvstore.Breaker, want gobreaker.State) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(5 * time.Second)
	for b.State() != want {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("the breaker is %v after 5s, want %v", b.State(), want)
		}
	}
}

// TestRedisKilledAndRestarted is the tier's promise: Redis dying mid-run
// costs a few fast failures, then the breaker bypasses it without touching
// the network; once Redis is back the breaker half-opens, its probe
// succeeds, and the tier is used again.
func TestRedisKilledAndRestarted(t *testing.T) {
	srv := redistest.Start(t)
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	inner := &counting{Store: r}
	var tr transitions
	const openTimeout = 300 * time.Millisecond
	b := kvstore.NewBreaker(inner, kvstore.BreakerConfig{Name: "redis", OpenTimeout: openTimeout}, kvstore.OnStateChange(tr.record))
	t.Cleanup(func() { b.Close() })
	ns := transfer.Namespace{Model: "m", Salt: 1}

	mustPut(t, b, ns, blocks(1024, 1, 2))
	checkBlock(t, mustGet(t, b, ns, []uint64{1}, 1024)[0], 1, 1024)

	srv.Stop()
	for i := range kvstore.DefaultBreakerFailures {
		d, err := call(b, ns)
		if err == nil {
			t.Fatalf("call %d with Redis down: no error", i)
		}
		if errors.Is(err, transfer.ErrBypassed) {
			t.Fatalf("call %d with Redis down: bypassed before %d failures: %v", i, kvstore.DefaultBreakerFailures, err)
		}
		if d > 250*time.Millisecond {
			t.Errorf("call %d with Redis down took %v, want it to fail fast", i, d)
		}
	}
	if got := b.State(); got != gobreaker.StateOpen {
		t.Fatalf("after %d failures the breaker is %v, want open", kvstore.DefaultBreakerFailures, got)
	}
	before := inner.calls.Load()
	for range 100 {
		d, err := call(b, ns)
		if !errors.Is(err, transfer.ErrBypassed) {
			t.Fatalf("call with the breaker open: error %v, want ErrBypassed", err)
		}
		// Bypassing touches no network (inner's count, below); the bound
		// only catches a call that waited for a timeout.
		if d > 100*time.Millisecond {
			t.Errorf("bypassed call took %v", d)
		}
	}
	if err := b.Put(context.Background(), ns, blocks(64, 3)); !errors.Is(err, transfer.ErrBypassed) {
		t.Errorf("Put with the breaker open: error %v, want ErrBypassed", err)
	}
	if _, err := b.Exists(context.Background(), ns, []uint64{3}); !errors.Is(err, transfer.ErrBypassed) {
		t.Errorf("Exists with the breaker open: error %v, want ErrBypassed", err)
	}
	if got := inner.calls.Load() - before; got != 0 {
		t.Errorf("the open breaker let %d calls through to Redis", got)
	}

	srv.Restart() // empty: persistence is off
	// gobreaker reads the wall clock, and Redis is a process of its own:
	// the open timeout passes for real.
	waitState(t, b, gobreaker.StateHalfOpen)
	data := mustGet(t, b, ns, []uint64{1}, 1024) // the probe
	if data[0] != nil {
		t.Error("a restarted Redis without persistence returned a block")
	}
	if got := b.State(); got != gobreaker.StateClosed {
		t.Fatalf("after a successful probe the breaker is %v, want closed", got)
	}
	mustPut(t, b, ns, blocks(1024, 1))
	checkBlock(t, mustGet(t, b, ns, []uint64{1}, 1024)[0], 1, 1024)

	if got, want := tr.String(), "[closed→open open→half-open half-open→closed]"; got != want {
		t.Errorf("transitions = %s, want %s", got, want)
	}
}

// TestRedisFrozen: a Redis that accepts connections but never answers
// costs each call at most its read timeout, then the breaker bypasses it.
func TestRedisFrozen(t *testing.T) {
	srv := redistest.Start(t)
	const readTimeout = 100 * time.Millisecond
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr(), ReadTimeout: readTimeout})
	if err != nil {
		t.Fatal(err)
	}
	b := kvstore.NewBreaker(r, kvstore.BreakerConfig{OpenTimeout: time.Minute})
	t.Cleanup(func() { b.Close() })
	ns := transfer.Namespace{Model: "m"}
	mustPut(t, b, ns, blocks(64, 1)) // a pooled connection to freeze

	srv.Freeze()
	t.Cleanup(srv.Thaw) // before Stop: cleanups run last first
	for i := range kvstore.DefaultBreakerFailures {
		d, err := call(b, ns)
		if err == nil {
			t.Fatalf("call %d to a frozen Redis: no error", i)
		}
		if d > readTimeout+300*time.Millisecond {
			t.Errorf("call %d to a frozen Redis took %v, want about the read timeout %v", i, d, readTimeout)
		}
	}
	if _, err := call(b, ns); !errors.Is(err, transfer.ErrBypassed) {
		t.Errorf("call after %d timeouts: error %v, want ErrBypassed", kvstore.DefaultBreakerFailures, err)
	}
}

// TestRedisDownAtStart: a store made while Redis is down is no error, and
// its calls fail fast.
func TestRedisDownAtStart(t *testing.T) {
	srv := redistest.Start(t)
	srv.Stop()
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		t.Fatalf("NewRedis with Redis down: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	if err := r.Ping(context.Background()); err == nil {
		t.Error("Ping with Redis down: no error")
	}
	d, err := call(r, transfer.Namespace{Model: "m"})
	if err == nil {
		t.Fatal("Get with Redis down: no error")
	}
	if d > 250*time.Millisecond {
		t.Errorf("Get with Redis down took %v, want it to fail fast", d)
	}
	srv.Restart()
	if err := r.Ping(context.Background()); err != nil {
		t.Errorf("Ping once Redis is up: %v", err)
	}
}

func TestRedisValidatesConfig(t *testing.T) {
	if _, err := kvstore.NewRedis(kvstore.RedisConfig{}); err == nil {
		t.Error("NewRedis without an address: no error")
	}
}
