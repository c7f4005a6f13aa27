package replica

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// benchPair starts a redis-server and two replicas sharing through it, both
// reporting to obs, and returns the sender and a wait for the receiver's
// b.N'th entry. The stream starts empty: the receiver follows it from its
// first message, whenever its first read comes.
func benchPair(b *testing.B, obs Observer) (sender *Sharer, wait func()) {
	addr := redistest.Start(b).Addr()
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
	var got atomic.Int64
	all := make(chan struct{}) // closed at the b.N'th entry
	mk("receiver", func(Entry) {
		if got.Add(1) == int64(b.N) {
			close(all)
		}
	})
	return mk("sender", func(Entry) {}), func() {
		select {
		case <-all:
		case <-time.After(time.Minute):
			b.Fatalf("received %d of %d", got.Load(), b.N)
		}
	}
}

// benchKeys returns n block keys, spread as hashes are.
func benchKeys(n int) []uint64 {
	ks := make([]uint64, n)
	for i := range ks {
		ks[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	return ks
}

// BenchmarkShare sends b.N decisions of an 8,000-token prompt (500 block
// keys of 16 tokens) on one of 64 workers from one replica to another
// through a real redis-server on loopback, and reports what it costs:
// bytes and messages per decision, and decisions a second end to end.
func BenchmarkShare(b *testing.B) {
	for _, keys := range []int{64, 500} {
		b.Run(fmt.Sprintf("keys=%d", keys), func(b *testing.B) {
			var sent, bytes atomic.Int64
			sender, wait := benchPair(b, &countObserver{sent: &sent, bytes: &bytes})
			ks := benchKeys(keys)
			b.ResetTimer()
			for i := range b.N {
				sender.Publish(Entry{Worker: fmt.Sprintf("worker-%02d", i%64), Keys: ks})
			}
			wait()
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

func (c *countObserver) Sent(_ string, _, bytes int) {
	c.sent.Add(1)
	c.bytes.Add(int64(bytes))
}

// BenchmarkShareLag publishes one decision of an 8,000-token prompt every
// 200 µs, from one replica to another through a real redis-server on
// loopback, and reports how long after its publication each reached the
// other (p50, p99): the window in which the other replica routes without
// it, when neither replica's process is busy with anything else.
func BenchmarkShareLag(b *testing.B) {
	obs := &lagObserver{}
	sender, wait := benchPair(b, obs)
	ks := benchKeys(500)
	// The receiver's first read must be waiting before the first message.
	time.Sleep(50 * time.Millisecond)
	b.ResetTimer()
	tick := time.NewTicker(200 * time.Microsecond)
	defer tick.Stop()
	for i := range b.N {
		<-tick.C
		sender.Publish(Entry{Worker: fmt.Sprintf("worker-%02d", i%64), Keys: ks})
	}
	wait()
	b.StopTimer()
	obs.report(b)
}

// lagObserver keeps the lag of every message received.
type lagObserver struct {
	nopObserver
	mu   sync.Mutex
	lags []time.Duration
}

func (l *lagObserver) Received(_ string, _, _ int, lag time.Duration) {
	l.mu.Lock()
	l.lags = append(l.lags, lag)
	l.mu.Unlock()
}

// report reports the lags' p50 and p99 to b.
func (l *lagObserver) report(b *testing.B) {
	l.mu.Lock()
	defer l.mu.Unlock()
	slices.Sort(l.lags)
	if n := len(l.lags); n > 0 {
		b.ReportMetric(float64(l.lags[n/2].Microseconds()), "p50-lag-µs")
		b.ReportMetric(float64(l.lags[n*99/100].Microseconds()), "p99-lag-µs")
	}
}

// BenchmarkShareFleet is what sharing costs as deployed at the rate the
// replicas aim names: four replicas through a real redis-server on
// loopback, together committing 1,000 decisions a second (each 250, on
// a ticker of its own) of 8,000-token prompts (500 block keys) on 64
// workers; b.N decisions in all. It reports messages and bytes a second
// sent to Redis, bytes and messages a decision, the lag at which the
// other three applied each message (p50, p99), the entries every replica
// applied, the heap the four Sharers hold once done (a replica's share of
// it) and the stream's size in Redis. Sub-benchmarks: through Redis
// alone, straight from replica to replica alone (peers, no Redis), and
// both ways (each decision applied once): what is sent counts both.
func BenchmarkShareFleet(b *testing.B) {
	for _, way := range []string{"redis", "peers", "both"} {
		b.Run(way, func(b *testing.B) { benchShareFleet(b, way != "peers", way != "redis") })
	}
}

func benchShareFleet(b *testing.B, viaRedis, viaPeers bool) {
	const replicas, rate, workers = 4, 1000, 64
	var srv *redistest.Server
	if viaRedis {
		srv = redistest.Start(b)
	}
	var sent, bytes, applied atomic.Int64
	obs := &lagObserver{}
	counting := &countObserver{sent: &sent, bytes: &bytes}
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	heapBefore := ms.HeapAlloc
	sharers := make([]*Sharer, replicas)
	var connected atomic.Int64
	var addrs []string
	for i := range sharers {
		cfg := Config{ID: fmt.Sprintf("replica-%d", i),
			Apply: func(Entry) { applied.Add(1) }, Observer: fleetObserver{counting, obs, &connected}}
		if viaRedis {
			client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			b.Cleanup(func() { client.Close() })
			cfg.Client = client
		}
		if viaPeers {
			cfg.Listen = "127.0.0.1:0"
		}
		s, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		sharers[i] = s
		addrs = append(addrs, s.ListenAddr())
	}
	if viaPeers {
		for _, s := range sharers {
			s.SetPeers(addrs)
		}
		for deadline := time.Now().Add(10 * time.Second); connected.Load() < replicas*(replicas-1); {
			if time.Now().After(deadline) {
				b.Fatalf("%d peer connections of %d", connected.Load(), replicas*(replicas-1))
			}
			time.Sleep(time.Millisecond)
		}
	}
	ks := benchKeys(500)
	time.Sleep(50 * time.Millisecond) // every follower's first read waits
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for r, s := range sharers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(time.Second * replicas / rate)
			defer tick.Stop()
			for i := r; i < b.N; i += replicas {
				<-tick.C
				keys := slices.Clone(ks)
				keys[len(keys)-1] += uint64(i) // each decision's prompt ends its own way
				s.Poll()
				s.Publish(Entry{Worker: fmt.Sprintf("worker-%02d", i%workers), Keys: keys})
			}
		}()
	}
	wg.Wait()
	want := int64(b.N) * (replicas - 1)
	for deadline := time.Now().Add(10 * time.Second); applied.Load() < want && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if got := applied.Load(); got < want {
		b.Fatalf("applied %d entries of %d", got, want)
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	var streamBytes int64
	if viaRedis {
		var err error
		if streamBytes, err = redis.NewClient(&redis.Options{Addr: srv.Addr()}).MemoryUsage(context.Background(), defaultStream).Result(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(sent.Load())/elapsed.Seconds(), "msgs/s")
	b.ReportMetric(float64(bytes.Load())/elapsed.Seconds(), "bytes/s")
	b.ReportMetric(float64(bytes.Load())/float64(b.N), "bytes/decision")
	b.ReportMetric(float64(sent.Load())/float64(b.N), "msgs/decision")
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "decisions/s")
	b.ReportMetric((float64(ms.HeapAlloc)-float64(heapBefore))/replicas, "heap-B/replica")
	b.ReportMetric(float64(streamBytes), "stream-B")
	obs.report(b)
}

// fleetObserver counts what is sent and keeps the lags of what is received;
// connected sums the replicas' peers.
type fleetObserver struct {
	*countObserver
	lags      *lagObserver
	connected *atomic.Int64
}

// Peers counts connections as they come: every replica's reach n at most
// once each in the benchmark's run.
func (f fleetObserver) Peers(n int) { f.connected.Add(1) }

func (f fleetObserver) Received(via string, entries, bytes int, lag time.Duration) {
	f.lags.Received(via, entries, bytes, lag)
}
