package replica

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// BenchmarkShare sends b.N decisions of an 8,000-token prompt (500 block
// keys of 16 tokens) on one of 64 workers from one replica to another
// through a real redis-server on loopback, and reports what it costs:
// bytes and messages per decision, and decisions a second end to end.
func BenchmarkShare(b *testing.B) {
	for _, keys := range []int{64, 500} {
		b.Run(fmt.Sprintf("keys=%d", keys), func(b *testing.B) {
			addr := redistest.Start(b).Addr()
			var got atomic.Int64
			var sent, bytes atomic.Int64
			obs := &countObserver{sent: &sent, bytes: &bytes}
			mk := func(id string, apply func(Entry)) *Sharer {
				client := redis.NewClient(&redis.Options{Addr: addr})
				b.Cleanup(func() { client.Close() })
				s, err := New(Config{Client: client, ID: id, Queue: 1 << 16, Apply: apply, Observer: obs})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { s.Close() })
				return s
			}
			// The stream starts empty: the receiver follows it from its
			// first message, whenever its first read comes.
			all := make(chan struct{}) // closed at the b.N'th entry
			mk("receiver", func(Entry) {
				if got.Add(1) == int64(b.N) {
					close(all)
				}
			})
			sender := mk("sender", func(Entry) {})
			ks := make([]uint64, keys)
			for i := range ks {
				ks[i] = uint64(i) * 0x9e3779b97f4a7c15
			}
			b.ResetTimer()
			for i := range b.N {
				sender.Publish(Entry{Worker: fmt.Sprintf("worker-%02d", i%64), Keys: ks})
			}
			select {
			case <-all:
			case <-time.After(time.Minute):
				b.Fatalf("received %d of %d", got.Load(), b.N)
			}
			b.StopTimer()
			b.ReportMetric(float64(bytes.Load())/float64(b.N), "bytes/decision")
			b.ReportMetric(float64(sent.Load())/float64(b.N), "msgs/decision")
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}

type countObserver struct {
	nopObserver
	sent, bytes *atomic.Int64
}

func (c *countObserver) Sent(_, bytes int) {
	c.sent.Add(1)
	c.bytes.Add(int64(bytes))
}

// BenchmarkShareLag publishes one decision of an 8,000-token prompt every
// 200 µs, from one replica to another through a real redis-server on
// loopback, and reports how long after its publication each reached the
// other (p50, p99): the window in which the other replica routes without
// it, when neither replica's process is busy with anything else.
func BenchmarkShareLag(b *testing.B) {
	addr := redistest.Start(b).Addr()
	var mu sync.Mutex
	var lags []time.Duration
	obs := &lagObserver{record: func(d time.Duration) {
		mu.Lock()
		lags = append(lags, d)
		mu.Unlock()
	}}
	var got atomic.Int64
	all := make(chan struct{})
	mk := func(id string, apply func(Entry)) *Sharer {
		client := redis.NewClient(&redis.Options{Addr: addr})
		b.Cleanup(func() { client.Close() })
		s, err := New(Config{Client: client, ID: id, Queue: 1 << 16, Apply: apply, Observer: obs})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		return s
	}
	mk("receiver", func(Entry) {
		if got.Add(1) == int64(b.N) {
			close(all)
		}
	})
	sender := mk("sender", func(Entry) {})
	ks := make([]uint64, 500)
	for i := range ks {
		ks[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	// The receiver's first read must be waiting before the first message.
	time.Sleep(50 * time.Millisecond)
	b.ResetTimer()
	tick := time.NewTicker(200 * time.Microsecond)
	defer tick.Stop()
	for i := range b.N {
		<-tick.C
		sender.Publish(Entry{Worker: fmt.Sprintf("worker-%02d", i%64), Keys: ks})
	}
	select {
	case <-all:
	case <-time.After(time.Minute):
		b.Fatalf("received %d of %d", got.Load(), b.N)
	}
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(lags)
	if len(lags) > 0 {
		b.ReportMetric(float64(lags[len(lags)/2].Microseconds()), "p50-lag-µs")
		b.ReportMetric(float64(lags[len(lags)*99/100].Microseconds()), "p99-lag-µs")
	}
}

type lagObserver struct {
	nopObserver
	record func(time.Duration)
}

func (l *lagObserver) Received(_, _ int, lag time.Duration) { l.record(lag) }
