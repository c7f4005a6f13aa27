package scheduler_test

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/sim"
)

// startTiered starts n colocated workers sharing store (nil: none), and a
// kv_aware scheduler in front of them.
func startTiered(t *testing.T, n int, scale float64, store transfer.Store, edit func(*sim.Config), sched func(*scheduler.Config)) ([]*sim.Worker, *scheduler.Scheduler, string) {
	t.Helper()
	spec := simfleet.Spec{
		Workers: n,
		Name:    shortName,
		Config: func(string, string) sim.Config {
			sc := sim.Config{TimeScale: scale, Tiers: sim.Tiers{Store: store}}
			if edit != nil {
				edit(&sc)
			}
			return sc
		},
		Scheduler: scheduler.Config{Strategy: "kv_aware", Pool: fastPool()},
	}
	if sched != nil {
		sched(&spec.Scheduler)
	}
	f := startFleetSpec(t, spec)
	waitDescribed(t, f.Scheduler)
	return f.Workers, f.Scheduler, f.Addr
}

// indexed waits until the scheduler's index shows worker holding every
// full block of a one-message chat prompt in its GPU tier.
func indexed(t *testing.T, s *scheduler.Scheduler, worker, prompt string) {
	t.Helper()
	keys := userKeys(prompt)
	out := make([]kvindex.Match, 1)
	eventually(t, 5*time.Second, func() error {
		s.Index.Lookup(keys, []string{worker}, out)
		if out[0].GPU < len(keys) {
			return fmt.Errorf("index shows %s holding %d of %d blocks", worker, out[0].GPU, len(keys))
		}
		return nil
	})
}

// direct runs a one-message chat prompt on w's engine, bypassing the
// scheduler.
func direct(t *testing.T, w *sim.Worker, prompt string) {
	t.Helper()
	stream, err := w.Engine.Generate(ctxT(t, 10*time.Second), &engine.Request{Model: model, Prompt: "<|user|>\n" + prompt + "\n", MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for {
		if _, err := stream.Recv(); err == io.EOF {
			return
		} else if err != nil {
			t.Fatal(err)
		}
	}
}

func TestKVAwareRoutesToTheHolder(t *testing.T) {
	_, s, addr := startTiered(t, 3, fastScale, nil, nil, nil)
	c := oaClient(t, addr)
	docs := []string{text("doc-a", 6000), text("doc-b", 6000), text("doc-c", 6000)}
	first := map[string]string{}
	for _, d := range docs {
		r := chat(t, c, chatParams(d+" first question", 8))
		first[d] = r.worker
		indexed(t, s, r.worker, d)
	}
	for i, d := range docs {
		r := chat(t, c, chatParams(d+fmt.Sprintf(" follow-up %d", i), 8))
		if r.worker != first[d] {
			t.Errorf("doc %d: follow-up went to %s, its blocks are on %s", i, r.worker, first[d])
		}
		if !strings.HasPrefix(r.route, "kv_aware; predicted_hit=0.9") {
			t.Errorf("doc %d: route %q, want a predicted hit above 0.9", i, r.route)
		}
		if r.cached < r.prompt*9/10 {
			t.Errorf("doc %d: %d of %d prompt tokens cached", i, r.cached, r.prompt)
		}
	}
	m := scrapeSettled(t, httpClient(t), addr)
	pred, _ := metric(m, "baton_kv_predicted_cached_tokens_total", `strategy="kv_aware"`)
	got, _ := metric(m, "baton_kv_achieved_cached_tokens_total", `strategy="kv_aware"`)
	if pred <= 0 || got < pred*0.9 || got > pred*1.1 {
		t.Errorf("predicted %v cached tokens, achieved %v", pred, got)
	}
}

func TestKVAwareRoutesToTheCPUTierHolder(t *testing.T) {
	// Two workers whose GPU tier holds only a few blocks: the document's
	// blocks are demoted to the CPU tier, and kv_aware still finds them.
	ws, s, addr := startTiered(t, 2, fastScale, nil, func(c *sim.Config) { c.Tiers.GPUBlocks = 200; c.Tiers.CPUBlocks = 4096 }, nil)
	c := oaClient(t, addr)
	doc := text("cpu-doc", 6000)
	r := chat(t, c, chatParams(doc+" q0", 8))
	indexed(t, s, r.worker, doc)
	// Push the document out of the holder's GPU tier with other prompts
	// sent straight to it.
	holder := ws[0]
	if r.worker == "w1" {
		holder = ws[1]
	}
	for i := range 4 {
		direct(t, holder, text(fmt.Sprintf("filler-%d", i), 6000))
	}
	keys := userKeys(doc)
	out := make([]kvindex.Match, 1)
	eventually(t, 5*time.Second, func() error {
		s.Index.Lookup(keys, []string{r.worker}, out)
		if out[0].CPU == 0 {
			return fmt.Errorf("index shows %d GPU, %d CPU blocks of %d", out[0].GPU, out[0].CPU, len(keys))
		}
		return nil
	})
	again := chat(t, c, chatParams(doc+" q1", 8))
	if again.worker != r.worker || again.cached == 0 {
		t.Errorf("follow-up on %s with %d cached tokens; the CPU tier of %s holds the document", again.worker, again.cached, r.worker)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_cached_tokens_by_tier_total", `tier="cpu"`); v <= 0 {
		t.Errorf("cpu-tier hits = %v", v)
	}
}

func TestHotPrefixSpreadsAndWarmsFromRedis(t *testing.T) {
	srv := redistest.Start(t)
	store, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	// At the modelled pace (time scale 1) a long completion, 32 tokens
	// at least, keeps its worker busy for a quarter of a second or more;
	// the threshold of 1 makes the hot prefix's holder full at once.
	// A lookup in Redis may take its time on a loaded machine: this test
	// is about where the blocks come from, not how fast.
	_, s, addr := startTiered(t, 2, 1, store, func(c *sim.Config) {
		c.Tiers.StorePolicy = sim.PolicyWriteThrough
		c.Tiers.StoreTimeout = 10 * time.Second
	}, func(c *scheduler.Config) { c.ConcurrencyThreshold = 1 })
	c := oaClient(t, addr)
	doc := text("hot-doc", 6000)
	first := chat(t, c, chatParams(doc+" q0", 4))
	indexed(t, s, first.worker, doc)
	// Write-through writes happen off the step loop: wait for Redis to
	// hold the document.
	keys := userKeys(doc)
	ns := transfer.Namespace{Model: model, Salt: blockkey.Seed(model, "")}
	eventually(t, 5*time.Second, func() error {
		held, err := store.Exists(ctxT(t, time.Second), ns, keys)
		if err != nil {
			return err
		}
		for i, h := range held {
			if !h {
				return fmt.Errorf("redis lacks block %d of %d", i, len(keys))
			}
		}
		return nil
	})

	// Keep the holder busy with a long completion of the hot document.
	var wg sync.WaitGroup
	wg.Add(1)
	busy := make(chan chatResult, 1)
	go func() {
		defer wg.Done()
		busy <- chat(t, c, chatParams(doc+" a long answer", 400))
	}()
	// The long answer keeps its worker busy for seconds at the modelled
	// pace, longer on a loaded machine: the wait only bounds how late the
	// request may start.
	eventually(t, 30*time.Second, func() error {
		if s.Pool.Snapshot().Worker(first.worker).InFlight() == 0 {
			return fmt.Errorf("holder not busy yet (in flight: %s)", inFlight(s))
		}
		return nil
	})
	spread := chat(t, c, chatParams(doc+" q1", 4))
	wg.Wait()
	if b := <-busy; b.worker != first.worker {
		t.Errorf("the long request went to %s, not the holder %s", b.worker, first.worker)
	}
	if spread.worker == first.worker {
		t.Fatalf("hot prefix did not spread: %s served while %s was at its threshold", spread.worker, first.worker)
	}
	if spread.cached < int64(len(keys))*16*9/10 {
		t.Errorf("the second worker's first request found %d of %d tokens cached; it should warm from Redis", spread.cached, spread.prompt)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_cached_tokens_by_tier_total", `tier="redis"`); v <= 0 {
		t.Errorf("redis-tier hits = %v, want the second worker's", v)
	}
}

func TestRedisDownNeverFailsARequest(t *testing.T) {
	srv := redistest.Start(t)
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	store := kvstore.NewBreaker(r, kvstore.BreakerConfig{Failures: 2, OpenTimeout: 300 * time.Millisecond})
	t.Cleanup(func() { store.Close() })
	ws, _, addr := startTiered(t, 2, fastScale, store, func(c *sim.Config) { c.Tiers.StorePolicy = sim.PolicyWriteThrough }, nil)
	c := oaClient(t, addr)
	ask := func(i int) chatResult {
		return chat(t, c, chatParams(text(fmt.Sprintf("redis-down-%d", i), 3000), 4))
	}
	for i := range 3 {
		ask(i)
	}
	srv.Stop()
	for i := 3; i < 12; i++ {
		if r := ask(i); r.content == "" {
			t.Fatalf("request %d with Redis down: empty answer", i)
		}
	}
	// Open, or half-open once its timeout passed (a slow run may take
	// longer than that to get here): either way it opened, and with Redis
	// still down no probe can close it.
	if st := store.State(); st == gobreaker.StateClosed {
		t.Errorf("breaker %v with Redis down, want it opened", st)
	}
	srv.Restart()
	before := ws[0].Engine.Stats().StoreWrites + ws[1].Engine.Stats().StoreWrites
	eventually(t, 5*time.Second, func() error {
		ask(100 + int(time.Now().UnixNano()%1000))
		if st := store.State(); st != gobreaker.StateClosed {
			return fmt.Errorf("breaker %v", st)
		}
		if w := ws[0].Engine.Stats().StoreWrites + ws[1].Engine.Stats().StoreWrites; w <= before {
			return fmt.Errorf("no store writes since Redis came back")
		}
		return nil
	})
}

func TestIndexResyncsToTheWorkersState(t *testing.T) {
	// A worker that restarts breaks the scheduler's watch stream and comes
	// back with an empty cache: the index must resubscribe and end equal to
	// the worker's real state, forgetting what the old process held.
	ws, s, addr := startTiered(t, 1, fastScale, nil, nil, nil)
	c := oaClient(t, addr)
	old := text("before-restart", 4000)
	chat(t, c, chatParams(old, 4))
	indexed(t, s, "w0", old)

	ws[0].Close()
	w, err := sim.Start(sim.Config{Name: "w0", TimeScale: fastScale}, ws[0].GRPCAddr, "", nil)
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	t.Cleanup(func() { w.Close() })

	fresh := text("after-restart", 4000)
	out := make([]kvindex.Match, 1)
	eventually(t, 10*time.Second, func() error {
		m := scrape(t, httpClient(t), addr)
		if v, _ := metric(m, "baton_kv_index_resyncs_total", `worker="w0"`); v < 1 {
			return fmt.Errorf("no resync yet")
		}
		s.Index.Lookup(userKeys(old), []string{"w0"}, out)
		if out[0].GPU != 0 {
			return fmt.Errorf("index still shows %d blocks the old process held", out[0].GPU)
		}
		return nil
	})
	eventually(t, 10*time.Second, func() error {
		if _, err := streamChat(t, c, chatParams(fresh, 4)); err != nil {
			return err
		}
		return nil
	})
	for _, p := range []string{old, fresh} {
		keys := userKeys(p)
		eventually(t, 5*time.Second, func() error {
			s.Index.Lookup(keys, []string{"w0"}, out)
			if real := w.Engine.Cache().Lookup(keys); out[0].GPU != real {
				return fmt.Errorf("index shows %d leading blocks, the worker holds %d", out[0].GPU, real)
			}
			return nil
		})
	}
}

func TestKVAwareAcrossSchedulerReplicas(t *testing.T) {
	// Two schedulers watch the same workers, each with its own index: a
	// prefix one of them placed is found by the other from the workers'
	// events alone.
	_, s1, addr1 := startTiered(t, 3, fastScale, nil, nil, nil)
	var workers []scheduler.WorkerConfig
	for _, w := range s1.Pool.Snapshot().Workers {
		workers = append(workers, scheduler.WorkerConfig{Name: w.Name, Address: w.Addr})
	}
	s2, addr2 := startScheduler(t, scheduler.Config{Strategy: "kv_aware", Pool: fastPool(), Workers: workers})
	c1, c2 := oaClient(t, addr1), oaClient(t, addr2)
	for i := range 3 {
		doc := text(fmt.Sprintf("replica-doc-%d", i), 6000)
		first := chat(t, c1, chatParams(doc+" via one", 8))
		indexed(t, s2, first.worker, doc)
		second := chat(t, c2, chatParams(doc+" via two", 8))
		if second.worker != first.worker || second.cached < second.prompt*9/10 {
			t.Errorf("doc %d: replica two sent it to %s (%d of %d cached); replica one had placed it on %s",
				i, second.worker, second.cached, second.prompt, first.worker)
		}
	}
}

// A hot prefix is replicated onto an idle worker by copying its blocks
// from the holder, not by recomputing them: the holder prefills the
// request (computing only its new tokens) and pushes the blocks, and the
// idle worker finds the prefix cached.
func TestKVAwareCopiesHotPrefixOntoIdleWorker(t *testing.T) {
	_, s, addr := startTiered(t, 3, fastScale, nil, nil, nil)
	c := oaClient(t, addr)
	system := text("system-prompt", 6000)
	first := chat(t, c, chatParams(system+" session 0", 8))
	indexed(t, s, first.worker, system)
	var copied *chatResult
	for i := 1; i < 40 && copied == nil; i++ {
		r := chat(t, c, chatParams(system+fmt.Sprintf(" session %d", i), 8))
		if strings.Contains(r.route, "replicate=true") {
			copied = &r
		}
	}
	if copied == nil {
		t.Fatal("40 sessions on one worker's system prompt while two workers idled: never replicated")
	}
	if copied.worker == first.worker || copied.prefill != first.worker {
		t.Errorf("replicated onto %s with prefill worker %q; want an idle worker, copied from the holder %s", copied.worker, copied.prefill, first.worker)
	}
	if copied.cached < copied.prompt*8/10 {
		t.Errorf("replicated request: %d of %d prompt tokens reused; the copied prefix should count", copied.cached, copied.prompt)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if n, _ := metric(m, "baton_prefix_copies_total", `outcome="copied"`); n < 1 {
		t.Errorf("baton_prefix_copies_total{outcome=copied} = %v, want at least 1", n)
	}
	if n, _ := metric(m, "baton_routing_decisions_total", `reason="replicate"`); n < 1 {
		t.Errorf("baton_routing_decisions_total{reason=replicate} = %v, want at least 1", n)
	}
}

// inFlight lists the requests in flight on each worker of s's pool.
func inFlight(s *scheduler.Scheduler) string {
	var parts []string
	for _, w := range s.Pool.Snapshot().Workers {
		parts = append(parts, fmt.Sprintf("%s=%d", w.Name, w.InFlight()))
	}
	return strings.Join(parts, " ")
}
