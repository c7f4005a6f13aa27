package replica

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"
)

// fakeStream is the Redis of one stream, in memory, for tests in a
// synctest bubble: a message is readable as soon as XADD reaches it, and
// the reply takes rtt to come back.
type fakeStream struct {
	redis.UniversalClient // nil: the Sharer calls only the methods below
	rtt                   time.Duration

	mu     sync.Mutex
	msgs   []redis.XMessage
	added  []time.Time   // when each message reached the stream
	notify chan struct{} // closed and replaced at each XADD
}

func newFakeStream(rtt time.Duration) *fakeStream {
	return &fakeStream{rtt: rtt, notify: make(chan struct{})}
}

func (f *fakeStream) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	vals := a.Values.([]any)
	m := redis.XMessage{Values: map[string]any{}}
	for i := 0; i+1 < len(vals); i += 2 {
		v := vals[i+1]
		if b, ok := v.([]byte); ok {
			v = string(b) // the sender reuses its buffer
		}
		m.Values[vals[i].(string)] = fmt.Sprint(v)
	}
	f.mu.Lock()
	m.ID = fmt.Sprintf("%d-0", len(f.msgs)+1)
	f.msgs = append(f.msgs, m)
	f.added = append(f.added, time.Now())
	close(f.notify)
	f.notify = make(chan struct{})
	f.mu.Unlock()
	select {
	case <-time.After(f.rtt):
	case <-ctx.Done():
		return redis.NewStringResult("", ctx.Err())
	}
	return redis.NewStringResult(m.ID, nil)
}

func (f *fakeStream) XRead(ctx context.Context, a *redis.XReadArgs) *redis.XStreamSliceCmd {
	f.mu.Lock()
	after := len(f.msgs)
	if last := a.Streams[1]; last != "$" {
		after, _ = strconv.Atoi(strings.TrimSuffix(last, "-0"))
	}
	for len(f.msgs) <= after {
		ch := f.notify
		f.mu.Unlock()
		select {
		case <-ch:
		case <-time.After(a.Block):
			return redis.NewXStreamSliceCmdResult(nil, redis.Nil)
		case <-ctx.Done():
			return redis.NewXStreamSliceCmdResult(nil, ctx.Err())
		}
		f.mu.Lock()
	}
	msgs := append([]redis.XMessage(nil), f.msgs[after:]...)
	f.mu.Unlock()
	return redis.NewXStreamSliceCmdResult([]redis.XStream{{Stream: a.Streams[0], Messages: msgs}}, nil)
}

// lags records the lag of each message received.
type lags struct {
	nopObserver
	mu  sync.Mutex
	got []time.Duration
}

func (l *lags) Received(_ string, _, _ int, lag time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, lag)
}

// A decision committed while the sender is idle goes to Redis at once,
// without waiting for others to batch with it; those committed while its
// XADD is on its way go together in the next message, as soon as the
// first returns. The receiver's lag runs from each message's first commit.
func TestSendWithoutWaiting(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const rtt = time.Millisecond
		f := newFakeStream(rtt)
		a, err := New(Config{Client: f, ID: "a", Replay: -1, Apply: func(Entry) {}})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		var mu sync.Mutex
		var applied []Entry
		obs := &lags{}
		b, err := New(Config{Client: f, ID: "b", Replay: -1, Observer: obs, Apply: func(e Entry) {
			mu.Lock()
			defer mu.Unlock()
			applied = append(applied, e)
		}})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		synctest.Wait() // b follows the stream

		start := time.Now()
		e1 := Entry{Worker: "w0", Keys: []uint64{1, 2}}
		e2 := Entry{Worker: "w1", Keys: []uint64{3}}
		e3 := Entry{Worker: "w2", Keys: []uint64{4, 5, 6}}
		a.Publish(e1)
		synctest.Wait() // e1's XADD is on its way back
		a.Publish(e2)
		a.Publish(e3)
		time.Sleep(10 * rtt)
		synctest.Wait()

		f.mu.Lock()
		var at []time.Duration
		for _, t := range f.added {
			at = append(at, t.Sub(start))
		}
		f.mu.Unlock()
		if diff := cmp.Diff([]time.Duration{0, rtt}, at); diff != "" {
			t.Errorf("messages added at (-want +got):\n%s", diff)
		}
		mu.Lock()
		if diff := cmp.Diff([]Entry{e1, e2, e3}, applied, ignoreSeq); diff != "" {
			t.Errorf("b applied (-want +got):\n%s", diff)
		}
		mu.Unlock()
		obs.mu.Lock()
		if diff := cmp.Diff([]time.Duration{0, rtt}, obs.got); diff != "" {
			t.Errorf("b's lags (-want +got):\n%s", diff)
		}
		obs.mu.Unlock()
	})
}
