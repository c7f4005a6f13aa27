package sim

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

// Info reports the tiers and the cost figures in real seconds.
func TestServerInfoTiers(t *testing.T) {
	e := newEngine(t, Config{Tiers: Tiers{CPUBlocks: 77, Store: newMemory(t)}, TimeScale: 100})
	info, err := workerpb.NewWorkerClient(serve(t, e)).Info(context.Background(), &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	c := info.GetCost()
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Abs(b) }
	if info.GetCpuBlocks() != 77 || !info.GetRedisTier() || c.GetLayers() != 32 || c.GetHidden() != 4096 ||
		c.GetKvBytesPerBlock() != 2<<20 ||
		!near(c.GetFlops(), 989.4e12*0.5*100) ||
		!near(c.GetDecodeStepSeconds(), e.CostModel().DecodeStepSeconds(1, 0)/100) ||
		!near(c.GetPcieBytesPerSecond(), 64e9*100) ||
		!near(c.GetRedisBytesPerSecond(), 10e9*100) ||
		!near(c.GetRedisRttSeconds(), 500e-6/100) {
		t.Errorf("Info = %v", info)
	}
}

// Watch: the snapshot lists blocks per tier, events carry tier and from
// tier, load reports carry the CPU tier.
func TestServerWatchTiers(t *testing.T) {
	e := newEngine(t, Config{Tiers: Tiers{GPUBlocks: 8, CPUBlocks: 8}, LoadInterval: time.Millisecond})
	p, q := sevenBlocks('p'), sevenBlocks('q')
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	generate(t, e, &engine.Request{Prompt: q, MaxTokens: 1}) // p demoted
	pk, qk := keysOf("", p), keysOf("", q)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := workerpb.NewWorkerClient(serve(t, e)).Watch(ctx, &workerpb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil {
		t.Fatal(err)
	}
	snap := first.GetSnapshot()
	tiers := map[workerpb.Tier][]uint64{}
	for _, b := range snap.GetBlocks() {
		if b.GetKind() != workerpb.CacheEvent_KIND_STORED {
			t.Errorf("snapshot block event %v", b)
		}
		tiers[b.GetTier()] = append(tiers[b.GetTier()], b.GetKeys()...)
	}
	if len(snap.GetBlocks()) != 2 || len(tiers[workerpb.Tier_TIER_GPU]) != 7 || len(tiers[workerpb.Tier_TIER_CPU]) != 7 ||
		!slices.Contains(tiers[workerpb.Tier_TIER_GPU], qk[0]) || !slices.Contains(tiers[workerpb.Tier_TIER_CPU], pk[0]) {
		t.Errorf("snapshot blocks %v", snap.GetBlocks())
	}
	if l := snap.GetLoad(); l.GetCpuBlocksTotal() != 8 || l.GetCpuBlocksUsed() != 7 || l.GetGpuBlocksTotal() != 8 {
		t.Errorf("snapshot load %v", l)
	}

	// p comes back from the CPU tier, q goes down to it.
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	var up, down bool
	seq := first.GetSeq()
	for !up || !down {
		ev, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.GetSeq() != seq+1 {
			t.Fatalf("seq %d after %d", ev.GetSeq(), seq)
		}
		seq = ev.GetSeq()
		ce := ev.GetCache()
		if ce == nil || ce.GetKind() != workerpb.CacheEvent_KIND_TIER_CHANGED {
			continue
		}
		switch {
		case ce.GetTier() == workerpb.Tier_TIER_GPU && ce.GetFromTier() == workerpb.Tier_TIER_CPU:
			up = slices.Equal(ce.GetKeys(), pk)
		case ce.GetTier() == workerpb.Tier_TIER_CPU && ce.GetFromTier() == workerpb.Tier_TIER_GPU:
			down = slices.Contains(ce.GetKeys(), qk[0])
		default:
			t.Errorf("tier change %v", ce)
		}
	}
}

// stalledWatch is a Watch stream whose Send blocks until release is
// closed, as a subscriber that stopped reading.
type stalledWatch struct {
	grpc.ServerStream
	ctx     context.Context
	release chan struct{}
	sent    []*workerpb.WatchEvent
	after   func() // called after each Send, if set
}

func (s *stalledWatch) Context() context.Context { return s.ctx }

func (s *stalledWatch) Send(ev *workerpb.WatchEvent) error {
	s.sent = append(s.sent, ev)
	<-s.release
	if s.after != nil {
		s.after()
	}
	return nil
}

// A subscriber that falls behind is dropped: its Watch ends with Aborted
// after the events it was sent, and a new Watch starts with a snapshot.
func TestServerWatchGap(t *testing.T) {
	e := newEngine(t, Config{WatchBuffer: 4})
	srv := NewServer(e)
	st := &stalledWatch{ctx: context.Background(), release: make(chan struct{})}
	done := make(chan error, 1)
	go func() { done <- srv.Watch(&workerpb.WatchRequest{}, st) }()
	for i := range 10 {
		generate(t, e, &engine.Request{Prompt: sevenBlocks(byte('a' + i)), MaxTokens: 1})
	}
	close(st.release)
	select {
	case err := <-done:
		if status.Code(err) != codes.Aborted {
			t.Errorf("Watch ended with %v, want Aborted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("slow Watch not dropped")
	}
	// It got the snapshot and what its buffer held, in sequence, no more.
	if n := len(st.sent); n < 2 || n > 5 || st.sent[0].GetSnapshot() == nil {
		t.Errorf("sent %d events", n)
	}
	for i, ev := range st.sent {
		if ev.GetSeq() != uint64(i+1) {
			t.Errorf("event %d has seq %d", i, ev.GetSeq())
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	st2 := &stalledWatch{ctx: ctx, release: make(chan struct{}), after: cancel}
	close(st2.release)
	if err := srv.Watch(&workerpb.WatchRequest{}, st2); status.Code(err) != codes.Canceled || len(st2.sent) == 0 || st2.sent[0].GetSnapshot() == nil {
		t.Errorf("resubscribe: %v, first event %v", err, st2.sent)
	}
}
