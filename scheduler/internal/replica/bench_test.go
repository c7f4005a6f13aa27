package replica

import (
	"fmt"
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
