package sim

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/health/grpc_health_v1"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/workers/engine"
)

func waitWarm(t *testing.T, e *Engine) {
	t.Helper()
	select {
	case <-e.WarmupDone():
	case <-time.After(15 * time.Second):
		t.Fatal("warm-up did not end")
	}
}

// testScaleOut: worker a serves prompts of uneven popularity through the
// shared store (policy demotion: nothing leaves its GPU tier, only the
// hot prefixes it reuses are written); b, started afterwards with
// Warmup.TopK 2, warms the two hottest and serves the hottest from its GPU
// tier without asking the store; c, without warm-up, starts cold and
// fetches at request time.
func testScaleOut(t *testing.T, store transfer.Store) {
	tenant := t.Name()
	a := newEngine(t, Config{Name: "a", Tiers: Tiers{Store: store}})
	uses := map[byte]int{'h': 5, 'i': 3, 'j': 2, 'k': 1} // reuses: 4, 2, 1, 0
	for round := range 5 {
		for c, n := range uses {
			if round < n {
				generate(t, a, &engine.Request{Prompt: sevenBlocks(c), Tenant: tenant, MaxTokens: 1})
			}
		}
	}
	waitFor(t, "a's touches", func() bool { return a.Stats().HotTouches == 7 })
	for _, c := range []byte{'h', 'i', 'j'} {
		waitStored(t, store, nsOf(tenant), keysOf(tenant, sevenBlocks(c)))
	}
	if st := a.Stats(); st.HotWriteBlocks != 21 || st.HotTouchErrors != 0 || st.HotTouchDropped != 0 {
		t.Errorf("a: %+v, want 3 prefixes of 7 blocks written once each", st)
	}
	hot, err := transfer.Tracker(store).Hottest(context.Background(), testModel, 10)
	if err != nil || len(hot) != 3 || hot[0].Score != 4 || hot[1].Score != 2 || hot[2].Score != 1 {
		t.Fatalf("Hottest = %v, %v; want scores 4, 2, 1", hot, err)
	}

	b := newEngine(t, Config{Name: "b", Tiers: Tiers{Store: store}, Warmup: Warmup{TopK: 2}})
	waitWarm(t, b)
	if st := b.Stats(); st.WarmupPrefixes != 2 || st.WarmedPrefixes != 2 || st.WarmedBlocks != 14 {
		t.Fatalf("b's warm-up: %+v, want 2 prefixes of 7 blocks", st)
	}
	if b.Cache().Locate(keysOf(tenant, sevenBlocks('j'))[0]) != 0 {
		t.Error("b warmed the third prefix too")
	}
	f := generate(t, b, &engine.Request{Prompt: sevenBlocks('h'), Tenant: tenant, MaxTokens: 1}).final
	if f.CachedTokens != 111 || f.CachedGPU != 111 || f.CachedRedis != 0 {
		t.Errorf("b's first request for the hottest prompt: %+v, want 111 tokens cached on the GPU", f)
	}
	if st := b.Stats(); st.StoreLookups != 0 || st.StoreHitBlocks != 0 {
		t.Errorf("b asked the store at request time: %+v", st)
	}

	c := newEngine(t, Config{Name: "c", Tiers: Tiers{Store: store}})
	waitWarm(t, c)
	f = generate(t, c, &engine.Request{Prompt: sevenBlocks('h'), Tenant: tenant, MaxTokens: 1}).final
	if f.CachedTokens != 111 || f.CachedRedis != 111 || f.CachedGPU != 0 {
		t.Errorf("c's first request for the hottest prompt: %+v, want 111 tokens fetched from the store", f)
	}
	if st := c.Stats(); st.WarmedBlocks != 0 || st.StoreLookups != 1 || st.StoreHitBlocks != 7 {
		t.Errorf("c: %+v, want one fetch of 7 blocks at request time", st)
	}
}

func TestScaleOutWarmup(t *testing.T) {
	t.Run("memory", func(t *testing.T) { testScaleOut(t, newMemory(t)) })
	t.Run("redis", func(t *testing.T) {
		// A server of its own: the hot set is per model, and a shared
		// server holds other tests' prefixes.
		cfg, err := kvstore.ParseRedisURL(redistest.Start(t).Addr())
		if err != nil {
			t.Fatal(err)
		}
		r, err := kvstore.NewRedis(cfg)
		if err != nil {
			t.Fatal(err)
		}
		store := kvstore.NewBreaker(r, kvstore.BreakerConfig{})
		defer store.Close()
		testScaleOut(t, store)
	})
}

// Sequences whose blocks a prefill worker pushed are not counted as
// reuse; a store that tracks nothing is never asked.
func TestHotTouchScope(t *testing.T) {
	store := newMemory(t)
	e := newEngine(t, Config{Tiers: Tiers{Store: store}})
	p := sevenBlocks('d')
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	// As if transferred: Decode of a transfer that never comes proceeds
	// after its timeout with the blocks already cached.
	st, err := e.Decode(context.Background(), &engine.Request{Model: testModel, Prompt: p, MaxTokens: 1}, "none", time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := collect(t, st); err != nil {
		t.Fatal(err)
	}
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	// Another prefix reused after it: one goroutine records the touches
	// in order, so once q's is in the store every earlier one is.
	q := sevenBlocks('q')
	generate(t, e, &engine.Request{Prompt: q, MaxTokens: 1})
	generate(t, e, &engine.Request{Prompt: q, MaxTokens: 1})
	scores := func() map[uint64]float64 {
		hot, err := store.Hottest(context.Background(), testModel, 10)
		if err != nil {
			t.Fatal(err)
		}
		m := map[uint64]float64{}
		for _, h := range hot {
			m[h.Keys[0]] = h.Score
		}
		return m
	}
	waitFor(t, "the second prefix's touch", func() bool { return scores()[keysOf("", q)[0]] == 1 })
	if n := scores()[keysOf("", p)[0]]; n != 1 {
		t.Errorf("%v touches of the first prefix, want 1 (the transferred sequence is not reuse)", n)
	}

	plain := kvstore.NewBreaker(&failStore{}, kvstore.BreakerConfig{})
	e = newEngine(t, Config{Tiers: Tiers{Store: plain, GPUBlocks: 64}, Warmup: Warmup{TopK: 4}})
	waitWarm(t, e)
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	generate(t, e, &engine.Request{Prompt: p, MaxTokens: 1})
	if st := e.Stats(); st.HotTouches+st.HotTouchErrors+st.HotTouchDropped != 0 || st.WarmupPrefixes != 0 {
		t.Errorf("a store without tracker: %+v", st)
	}
}

// The worker reports NOT_SERVING until its warm-up ends.
func TestWarmupHealth(t *testing.T) {
	if e := newEngine(t, Config{}); !closed(e.WarmupDone()) {
		t.Error("WarmupDone of an engine without warm-up is not closed")
	}
	release := make(chan struct{})
	e := newEngine(t, Config{Tiers: Tiers{Store: newMemory(t)}, Warmup: Warmup{TopK: 1,
		Keys: func(ctx context.Context) ([]transfer.Namespace, [][]uint64, error) {
			<-release
			return nil, nil, nil
		}}})
	s := NewServer(e)
	status := func() grpc_health_v1.HealthCheckResponse_ServingStatus {
		r, err := s.health.Check(context.Background(), &grpc_health_v1.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return r.Status
	}
	if got := status(); got != grpc_health_v1.HealthCheckResponse_NOT_SERVING {
		t.Errorf("during warm-up: %v, want NOT_SERVING", got)
	}
	close(release)
	waitWarm(t, e)
	waitFor(t, "SERVING", func() bool { return status() == grpc_health_v1.HealthCheckResponse_SERVING })
}

func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
