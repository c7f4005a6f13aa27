package scheduler_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/sim"
)

// gapWorker is a baton worker reduced to Info and Watch, whose Watch
// streams send what the test queues: it can skip a sequence number, as a
// worker (or anything between it and the scheduler) that loses an event.
type gapWorker struct {
	workerpb.UnimplementedWorkerServer
	streams chan chan *workerpb.WatchEvent // one per Watch call, for the test to feed
}

func (w *gapWorker) Info(ctx context.Context, _ *workerpb.InfoRequest) (*workerpb.InfoResponse, error) {
	return &workerpb.InfoResponse{Name: "g0", Models: []string{model}, Role: workerpb.Role_ROLE_BOTH, BlockChars: 64}, nil
}

func (w *gapWorker) Watch(_ *workerpb.WatchRequest, st grpc.ServerStreamingServer[workerpb.WatchEvent]) error {
	ch := make(chan *workerpb.WatchEvent, 16)
	w.streams <- ch
	for {
		select {
		case ev := <-ch:
			if err := st.Send(ev); err != nil {
				return err
			}
		case <-st.Context().Done():
			return nil
		}
	}
}

func snapshotEvent(keys ...uint64) *workerpb.WatchEvent {
	return &workerpb.WatchEvent{Seq: 1, Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{
		Load:   &workerpb.LoadReport{GpuBlocksTotal: 1000},
		Blocks: []*workerpb.CacheEvent{{Kind: workerpb.CacheEvent_KIND_STORED, Tier: workerpb.Tier_TIER_GPU, Keys: keys}},
	}}}
}

func cacheEvent(seq uint64, kind workerpb.CacheEvent_Kind, keys ...uint64) *workerpb.WatchEvent {
	return &workerpb.WatchEvent{Seq: seq, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
		Kind: kind, Tier: workerpb.Tier_TIER_GPU, Keys: keys}}}
}

// heldByIndex returns the keys in [1, 20] the index says worker holds in
// its GPU tier.
func heldByIndex(s *scheduler.Scheduler, worker string) []uint64 {
	var held []uint64
	out := make([]kvindex.Match, 1)
	for k := uint64(1); k <= 20; k++ {
		s.Index.Lookup([]uint64{k}, []string{worker}, out)
		if out[0].GPU == 1 {
			held = append(held, k)
		}
	}
	return held
}

// TestIndexResyncsOnAWatchGap: a Watch stream that skips a sequence
// number (an event lost on the way) makes the scheduler drop the stream,
// count a gap, resubscribe and replace what its index held of the worker
// by the new snapshot: the block whose removal was lost is gone.
func TestIndexResyncsOnAWatchGap(t *testing.T) {
	gw := &gapWorker{streams: make(chan chan *workerpb.WatchEvent, 4)}
	srv := grpc.NewServer()
	workerpb.RegisterWorkerServer(srv, gw)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(srv.Stop)

	s, addr := startScheduler(t, scheduler.Config{Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{Name: "g0", Address: l.Addr().String()}}})
	next := func() chan *workerpb.WatchEvent {
		t.Helper()
		select {
		case ch := <-gw.streams:
			return ch
		case <-time.After(10 * time.Second):
			t.Fatal("the scheduler did not subscribe")
			return nil
		}
	}
	expect := func(want ...uint64) {
		t.Helper()
		eventually(t, 5*time.Second, func() error {
			if got := heldByIndex(s, "g0"); !slices.Equal(got, want) {
				return fmt.Errorf("index holds %v for g0, want %v", got, want)
			}
			return nil
		})
	}
	first := next()
	first <- snapshotEvent(1, 2, 3)
	first <- cacheEvent(2, workerpb.CacheEvent_KIND_STORED, 4)
	expect(1, 2, 3, 4)
	// Event 3, which removed block 1, is lost: event 4 reveals the gap.
	first <- cacheEvent(4, workerpb.CacheEvent_KIND_STORED, 5)
	second := next()
	// Until the new snapshot the index keeps what it had; the snapshot
	// replaces it whole.
	second <- snapshotEvent(2, 3, 4, 5)
	expect(2, 3, 4, 5)
	second <- cacheEvent(2, workerpb.CacheEvent_KIND_STORED, 6)
	expect(2, 3, 4, 5, 6)

	m := scrape(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_kv_index_resyncs_total", `worker="g0"`, `reason="gap"`); v != 1 {
		t.Errorf("gap resyncs = %v, want 1\n%s", v, m)
	}
	if v, _ := metric(m, "baton_kv_index_resyncs_total", `worker="g0"`); v != 1 {
		t.Errorf("resyncs of every reason = %v, want 1", v)
	}
}

// TestIndexResyncsOnceARestartedWorkerIsHealthy: a worker down for
// seconds, long enough that the watcher waits seconds between attempts to
// resubscribe, comes back with an empty cache. As soon as its health
// checks pass it is routed to again, so the index must drop what the old
// process held then, not at the end of the watcher's backoff.
func TestIndexResyncsOnceARestartedWorkerIsHealthy(t *testing.T) {
	ws, s, addr := startTiered(t, 1, fastScale, nil, nil, nil)
	old := text("before-the-outage", 4000)
	chat(t, oaClient(t, addr), chatParams(old, 4))
	indexed(t, s, "w0", old)

	ws[0].Close()
	eventually(t, 5*time.Second, func() error {
		if s.Pool.Snapshot().Worker("w0").Healthy() {
			return fmt.Errorf("w0 still healthy")
		}
		return nil
	})
	// The watcher's waits grow: after its fifth failed attempt (at 3.1 s)
	// it waits 3.2 s.
	hc := httpClient(t)
	eventually(t, 10*time.Second, func() error {
		if v, _ := metric(scrape(t, hc, addr), "baton_kv_index_resyncs_total", `worker="w0"`, `reason="unreachable"`); v < 5 {
			return fmt.Errorf("%v failed attempts to resubscribe, want 5", v)
		}
		return nil
	})
	w, err := sim.Start(sim.Config{Name: "w0", TimeScale: fastScale}, ws[0].GRPCAddr, "", nil)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	eventually(t, 20*time.Second, func() error {
		if !s.Pool.Snapshot().Worker("w0").Healthy() {
			return fmt.Errorf("w0 not healthy yet")
		}
		return nil
	})
	healthy := time.Now()
	out := make([]kvindex.Match, 1)
	eventually(t, 10*time.Second, func() error {
		s.Index.Lookup(userKeys(old), []string{"w0"}, out)
		if out[0].GPU != 0 {
			return fmt.Errorf("index still shows %d blocks the old process held", out[0].GPU)
		}
		return nil
	})
	// Without the watcher's Retry on the health hook, it took 0.7–1.4 s
	// here (the rest of the watcher's backoff); with it, microseconds.
	if d := time.Since(healthy); d > 500*time.Millisecond {
		t.Errorf("index resynced %v after w0 was healthy again, want at once", d)
	}
}
