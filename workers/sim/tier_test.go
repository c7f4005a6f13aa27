package sim

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
)

// sevenBlocks is a prompt of 7 full blocks (112 tokens): with one
// generated token it needs 8 blocks, a whole GPU tier of 8.
func sevenBlocks(c byte) string { return strings.Repeat(string(c), 7*blockkey.DefaultBlockChars) }

func nsOf(tenant string) transfer.Namespace {
	return transfer.Namespace{Model: testModel, Salt: blockkey.Seed(testModel, tenant)}
}

func keysOf(tenant, prompt string) []uint64 {
	return blockkey.Append(nil, blockkey.Seed(testModel, tenant), prompt, blockkey.DefaultBlockChars)
}

// timed runs one request of one step (max tokens 1) alone and returns its
// result and its modelled time to first token: the step's modelled time
// (prefill, PCIe copies, the decode pass) plus the modelled fetch from the
// shared tier before it was queued.
func timed(t *testing.T, e *Engine, req *engine.Request) (result, float64) {
	t.Helper()
	req.MaxTokens = 1
	before := e.Stats()
	r := generate(t, e, req)
	// The stats follow the step's tokens.
	waitFor(t, "the step to be counted", func() bool { return e.Stats().Steps != before.Steps })
	after := e.Stats()
	return r, after.ModelledSeconds - before.ModelledSeconds + after.StoreFetchSeconds - before.StoreFetchSeconds
}

// waitStored waits until the store holds every key.
func waitStored(t *testing.T, s transfer.Store, ns transfer.Namespace, keys []uint64) {
	t.Helper()
	waitFor(t, "the store to hold every key", func() bool {
		ok, err := s.Exists(context.Background(), ns, keys)
		return err == nil && !slices.Contains(ok, false)
	})
}

// drain returns the events already delivered to sub.
func drain(sub *Subscription) []CacheEvent {
	var out []CacheEvent
	for {
		select {
		case ev, ok := <-sub.C:
			if !ok {
				return out
			}
			if ev.Cache != nil {
				out = append(out, *ev.Cache)
			}
		default:
			return out
		}
	}
}

// saw reports whether an event of kind, tier and from tier carries key.
func saw(evs []CacheEvent, kind CacheEventKind, tier, from Tier, key uint64) bool {
	for _, ev := range evs {
		if ev.Kind == kind && ev.Tier == tier && ev.FromTier == from && slices.Contains(ev.Keys, key) {
			return true
		}
	}
	return false
}

func newMemory(t *testing.T) *kvstore.Memory {
	m := kvstore.NewMemory(kvstore.MemoryConfig{})
	t.Cleanup(func() { m.Close() })
	return m
}

// A prompt's blocks go GPU → CPU → shared store and come back, each tier
// cheaper than the next and all cheaper than recomputing.
func TestTierMovement(t *testing.T) {
	store := newMemory(t)
	e := newEngine(t, Config{Tiers: Tiers{GPUBlocks: 8, CPUBlocks: 8, Store: store}})
	sub, err := e.Subscribe()
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	p := sevenBlocks('p')
	keys := keysOf("", p)

	r, recompute := timed(t, e, &engine.Request{Prompt: p})
	if f := r.final; f.CachedTokens != 0 {
		t.Fatalf("first request: %+v", f)
	}
	r, gpuHit := timed(t, e, &engine.Request{Prompt: p})
	if f := r.final; f.CachedTokens != 111 || f.CachedGPU != 111 {
		t.Errorf("GPU hit: %+v, want 111 cached on the GPU", f)
	}

	// Another prompt takes the GPU tier: p is demoted to the CPU tier.
	timed(t, e, &engine.Request{Prompt: sevenBlocks('q')})
	for _, k := range keys {
		if got := e.Cache().Locate(k); got != TierCPU {
			t.Fatalf("after q: block in %v, want cpu", got)
		}
	}
	r, cpuHit := timed(t, e, &engine.Request{Prompt: p})
	if f := r.final; f.CachedTokens != 111 || f.CachedCPU != 111 {
		t.Errorf("CPU hit: %+v, want 111 cached in the CPU tier", f)
	}
	if st := e.Stats(); st.PromotedBlocks != 7 {
		t.Errorf("promoted %d blocks, want 7", st.PromotedBlocks)
	}

	// More prompts push p out of both tiers: written to the store on its
	// way out (policy demotion).
	for i := byte(0); slices.ContainsFunc(keys, func(k uint64) bool { return e.Cache().Locate(k) != 0 }); i++ {
		if i == 6 {
			t.Fatal("p never left the local tiers")
		}
		timed(t, e, &engine.Request{Prompt: sevenBlocks('a' + i)})
	}
	waitStored(t, store, nsOf(""), keys)
	// The writer counts a write and announces it after the store took it:
	// wait for the announcement too (the count comes before it).
	var evs []CacheEvent
	waitFor(t, "the store write's event", func() bool {
		evs = append(evs, drain(sub)...)
		return saw(evs, BlockStored, TierRedis, 0, keys[0])
	})
	r, storeHit := timed(t, e, &engine.Request{Prompt: p})
	if f := r.final; f.CachedTokens != 111 || f.CachedRedis != 111 {
		t.Errorf("store hit: %+v, want 111 cached from the shared tier", f)
	}
	if st := e.Stats(); st.StoreHitBlocks != 7 || st.StoreErrors != 0 || st.StoreWrites == 0 {
		t.Errorf("stats %+v", st)
	}

	t.Logf("modelled TTFT of a 112-token prompt: GPU hit %.3f ms, CPU hit %.3f ms (PCIe %.3f ms), store fetch %.3f ms (fetch %.3f ms), recompute %.3f ms",
		gpuHit*1e3, cpuHit*1e3, e.PCIeSeconds(7)*1e3, storeHit*1e3, e.FetchSeconds(7)*1e3, recompute*1e3)
	if !(gpuHit < cpuHit && cpuHit < storeHit && storeHit < recompute) {
		t.Errorf("costs not ordered GPU < CPU < store < recompute")
	}

	evs = append(evs, drain(sub)...)
	for _, c := range []struct {
		name       string
		kind       CacheEventKind
		tier, from Tier
	}{
		{"computed", BlockStored, TierGPU, 0},
		{"demoted", BlockTierChanged, TierCPU, TierGPU},
		{"promoted", BlockTierChanged, TierGPU, TierCPU},
		{"evicted from the CPU tier", BlockRemoved, TierCPU, 0},
		{"written to the store", BlockStored, TierRedis, 0},
	} {
		if !saw(evs, c.kind, c.tier, c.from, keys[0]) {
			t.Errorf("no %s event for p's first block", c.name)
		}
	}
}

// A worker's first request for a prompt another worker computed is served
// from the shared store, not recomputed; another tenant's identical
// prompt is not.
func TestSharedStoreAcrossWorkers(t *testing.T) {
	store := newMemory(t)
	a := newEngine(t, Config{Name: "a", Tiers: Tiers{Store: store, StorePolicy: PolicyWriteThrough}})
	b := newEngine(t, Config{Name: "b", Tiers: Tiers{Store: store}})
	p := sevenBlocks('s')
	if f := generate(t, a, &engine.Request{Prompt: p, Tenant: "alice", MaxTokens: 1}).final; f.CachedTokens != 0 {
		t.Fatalf("a: %+v", f)
	}
	waitStored(t, store, nsOf("alice"), keysOf("alice", p))

	if f := generate(t, b, &engine.Request{Prompt: p, Tenant: "bob", MaxTokens: 1}).final; f.CachedTokens != 0 {
		t.Errorf("bob's first request: cached %d, want 0 (tenants never share blocks)", f.CachedTokens)
	}
	f := generate(t, b, &engine.Request{Prompt: p, Tenant: "alice", MaxTokens: 1}).final
	if f.CachedTokens != 111 || f.CachedRedis != 111 {
		t.Errorf("alice on b: %+v, want 111 tokens from the shared tier", f)
	}
}

// The same across workers through a real Redis, behind a breaker.
func TestRedisTier(t *testing.T) {
	addr := redistest.Shared(t)
	cfg, err := kvstore.ParseRedisURL(addr)
	if err != nil {
		t.Fatal(err)
	}
	r, err := kvstore.NewRedis(cfg)
	if err != nil {
		t.Fatal(err)
	}
	store := kvstore.NewBreaker(r, kvstore.BreakerConfig{})
	defer store.Close()
	a := newEngine(t, Config{Name: "a", Tiers: Tiers{Store: store, StorePolicy: PolicyWriteThrough}})
	b := newEngine(t, Config{Name: "b", Tiers: Tiers{Store: store}})
	tenant := t.Name() + time.Now().String() // a shared server may hold earlier runs' blocks
	p := sevenBlocks('r')
	generate(t, a, &engine.Request{Prompt: p, Tenant: tenant, MaxTokens: 1})
	waitStored(t, store, nsOf(tenant), keysOf(tenant, p))
	f := generate(t, b, &engine.Request{Prompt: p, Tenant: tenant, MaxTokens: 1}).final
	if f.CachedTokens != 111 || f.CachedRedis != 111 {
		t.Errorf("b: %+v, want 111 tokens from Redis", f)
	}
}

// failStore fails every call with err, or, if hang, blocks until the
// call's context ends.
type failStore struct {
	err        error
	hang       bool
	gets, puts atomic.Int32
}

func (s *failStore) Put(ctx context.Context, _ transfer.Namespace, _ []transfer.Block) error {
	s.puts.Add(1)
	if s.hang {
		<-ctx.Done()
		return ctx.Err()
	}
	return s.err
}

func (s *failStore) Get(ctx context.Context, _ transfer.Namespace, _ []uint64, _ int) ([][]byte, error) {
	s.gets.Add(1)
	if s.hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return nil, s.err
}

func (s *failStore) Exists(context.Context, transfer.Namespace, []uint64) ([]bool, error) {
	return nil, s.err
}

func (s *failStore) Close() error { return nil }

// A store that errors, is bypassed or hangs costs a recompute, never a
// failed request.
func TestStoreFailuresNeverFailRequests(t *testing.T) {
	for name, s := range map[string]*failStore{
		"error":    {err: errors.New("connection refused")},
		"bypassed": {err: transfer.ErrBypassed},
		"hang":     {hang: true},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEngine(t, Config{Tiers: Tiers{GPUBlocks: 8, CPUBlocks: -1, Store: s, StoreTimeout: 20 * time.Millisecond}})
			for i := byte(0); i < 4; i++ { // each evicts the previous: writes
				r := generate(t, e, &engine.Request{Prompt: sevenBlocks('a' + i), MaxTokens: 1})
				if r.final.CachedTokens != 0 || r.final.CompletionTokens != 1 {
					t.Errorf("request %d: %+v", i, r.final)
				}
			}
			waitFor(t, "a failed write to be counted", func() bool { return e.Stats().StoreWriteErrors != 0 })
			if st := e.Stats(); st.StoreLookups != 4 || st.StoreErrors != 4 || st.StoreWrites != 0 {
				t.Errorf("stats %+v, want 4 failed lookups and no write", st)
			}
		})
	}
}

// Warm fetches a prefix's blocks from the store before any request; the
// warm-up hook does the same at start.
func TestWarm(t *testing.T) {
	store := newMemory(t)
	a := newEngine(t, Config{Tiers: Tiers{Store: store, StorePolicy: PolicyWriteThrough}})
	p := sevenBlocks('w')
	keys := keysOf("t", p)
	generate(t, a, &engine.Request{Prompt: p, Tenant: "t", MaxTokens: 1})
	waitStored(t, store, nsOf("t"), keys)

	b := newEngine(t, Config{Tiers: Tiers{Store: store, GPUBlocks: 8}})
	sub, err := b.Subscribe()
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	// A longer prefix than the store holds: Warm stops at the first miss.
	longer := append(slices.Clone(keys), 12345)
	n, err := b.Warm(context.Background(), nsOf("t"), longer)
	if err != nil || n != 7 {
		t.Fatalf("Warm = %d, %v; want 7", n, err)
	}
	for _, k := range keys {
		if b.Cache().Locate(k) != TierGPU {
			t.Errorf("warmed block not in the GPU tier")
		}
	}
	if evs := drain(sub); !saw(evs, BlockStored, TierGPU, 0, keys[6]) {
		t.Errorf("no stored event for the warmed blocks: %+v", evs)
	}
	if f := generate(t, b, &engine.Request{Prompt: p, Tenant: "t", MaxTokens: 1}).final; f.CachedTokens != 111 || f.CachedGPU != 111 {
		t.Errorf("after warm-up: %+v, want 111 tokens cached on the GPU", f)
	}
	if _, err := newEngine(t, Config{}).Warm(context.Background(), nsOf("t"), keys); err == nil {
		t.Error("Warm without a store succeeded")
	}

	// The hook: the scheduler lists the hottest prefixes, the engine warms
	// the first Warmup.TopK.
	c := newEngine(t, Config{Tiers: Tiers{Store: store}, Warmup: Warmup{TopK: 1,
		Keys: func(context.Context) ([]transfer.Namespace, [][]uint64, error) {
			return []transfer.Namespace{nsOf("t"), nsOf("t")}, [][]uint64{keys, keysOf("t", sevenBlocks('x'))}, nil
		}}})
	waitFor(t, "7 blocks warmed", func() bool { return c.Stats().WarmedBlocks == 7 })
}

// Writes never block the step loop: when the queue is full, blocks are
// dropped and counted.
func TestStoreWriteQueueOverflow(t *testing.T) {
	s := &failStore{hang: true} // the writer's first Put hangs (1 s bound)
	e := newEngine(t, Config{Tiers: Tiers{Store: s, StorePolicy: PolicyWriteThrough, StoreQueue: 1}})
	start := time.Now()
	for i := byte(0); i < 3; i++ {
		generate(t, e, &engine.Request{Prompt: sevenBlocks('a' + i), MaxTokens: 1})
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("requests took %v behind a hanging store", d)
	}
	if st := e.Stats(); st.StoreWriteDropped == 0 {
		t.Errorf("no dropped write counted: %+v", st)
	}
}

func TestTierCosts(t *testing.T) {
	e := newEngine(t, Config{TimeScale: 1})
	// A Llama-3.1-8B block is 2 MiB of real KV: 32.8 µs over PCIe Gen5
	// (64 GB/s), 0.5 ms + 210 µs from Redis (10 GB/s).
	const block = 2 << 20
	if got, want := e.PCIeSeconds(1), block/64e9; got != want {
		t.Errorf("PCIeSeconds(1) = %v, want %v", got, want)
	}
	if got, want := e.FetchSeconds(1), 500e-6+block/10e9; got != want {
		t.Errorf("FetchSeconds(1) = %v, want %v", got, want)
	}
	if got, want := e.Cache().CPUCapacity(), int64(256<<30/block); got != want {
		t.Errorf("default CPU tier %d blocks, want %d", got, want)
	}
	if got := newEngine(t, Config{Tiers: Tiers{CPUBlocks: -1}}).Cache().CPUCapacity(); got != 0 {
		t.Errorf("Tiers.CPUBlocks -1: CPU tier of %d blocks", got)
	}
	if got, want := newEngine(t, Config{Cost: cost.Config{TP: 2}}).PCIeSeconds(1), block/128e9; got != want {
		t.Errorf("TP 2: PCIeSeconds(1) = %v, want %v", got, want)
	}
}
