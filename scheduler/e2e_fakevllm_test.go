package scheduler_test

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// startFakeVLLMs starts n fake vLLM engines (vllmtest) publishing their KV
// events, and a scheduler routing to them with strategy, once subscribed
// to every engine.
func startFakeVLLMs(t *testing.T, n int, strategy string) (*scheduler.Scheduler, string, []*vllmtest.Server) {
	t.Helper()
	return startFakeVLLMsWith(t, n, strategy, vllmtest.Config{Encoding: kveventstest.TaggedMaps})
}

// startFakeVLLMsWith is startFakeVLLMs with engines of cfg (its model and
// time scale set).
func startFakeVLLMsWith(t *testing.T, n int, strategy string, cfg vllmtest.Config) (*scheduler.Scheduler, string, []*vllmtest.Server) {
	t.Helper()
	return startFakeVLLMFleet(t, n, strategy, cfg, 50*time.Millisecond)
}

// startFakeVLLMFleet is startFakeVLLMsWith with each worker's metrics
// scraped every metricsInterval.
func startFakeVLLMFleet(t *testing.T, n int, strategy string, cfg vllmtest.Config, metricsInterval time.Duration) (*scheduler.Scheduler, string, []*vllmtest.Server) {
	t.Helper()
	cfg.Model, cfg.TimeScale = model, 1000
	var engines []*vllmtest.Server
	var workers []scheduler.WorkerConfig
	for i := range n {
		e, err := vllmtest.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		engines = append(engines, e)
		workers = append(workers, scheduler.WorkerConfig{
			Name: fmt.Sprintf("v%d", i), Kind: scheduler.KindVLLM, Address: e.URL,
			EngineConfig: scheduler.EngineConfig{
				Events: e.EventsEndpoint(), EventsReplay: e.ReplayEndpoint(), EventsTopic: e.Topic(),
				MetricsInterval: metricsInterval,
			},
		})
	}
	s, addr := startScheduler(t, scheduler.Config{Strategy: strategy, Pool: fastPool(), Workers: workers})
	for _, e := range engines {
		if err := e.WaitSubscribed(ctxT(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	return s, addr, engines
}

// fakeVLLMPrompt is a long-context prompt: document d, then question q.
func fakeVLLMPrompt(d, q int) string {
	return fmt.Sprintf("Document %d. %s\n\nQuestion %d: what does it say about item %d?", d, longPrefix(1200), q, q)
}

// engineTokens are the tokens a fake engine computes for a one-message
// chat prompt.
func engineTokens(prompt string) []uint32 {
	return vllmtest.ChatTokens([]vllmtest.Message{{Role: "user", Content: json.RawMessage(strconv.Quote(prompt))}}, true)
}

// TestFakeVLLMPredictedHit: kv_aware over fake vLLM engines, on a short
// long-context run (four documents, a question at a time): the hit it
// predicts for the engine it picks is the hit that engine achieves, in
// every request's route and in the totals, within 5%; a document's
// questions stay on the engine that holds it.
func TestFakeVLLMPredictedHit(t *testing.T) {
	s, addr, engines := startFakeVLLMs(t, 3, "kv_aware")
	c := oaClient(t, addr)
	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	rng := rand.New(rand.NewPCG(1, 2))
	holder := map[int]string{}
	var predicted, achieved float64
	for q := range 24 {
		d := rng.IntN(4)
		r, err := streamChat(t, c, chatParams(fakeVLLMPrompt(d, q), 4))
		if err != nil {
			t.Fatal(err)
		}
		hit := predictedHit(t, r.route)
		got := float64(r.cached) / float64(r.prompt)
		if math.Abs(hit-got) > 0.05 {
			t.Errorf("question %d on document %d: predicted hit %.2f on %s, achieved %.2f (%d of %d tokens)", q, d, hit, r.worker, got, r.cached, r.prompt)
		}
		if h, ok := holder[d]; ok && r.worker != h {
			t.Errorf("question %d on document %d went to %s, the document is on %s", q, d, r.worker, h)
		} else if !ok {
			holder[d] = r.worker
		}
		predicted += hit * float64(r.prompt)
		achieved += float64(r.cached)
		// The next question is routed once the engine's events for this
		// one are in the index: the test is of what the index predicts
		// from them, not of how fast they arrive on a busy machine (a
		// prediction made at commit lapses after PredictTTL).
		keys := blockkey.AppendTokens(nil, seed, engineTokens(fakeVLLMPrompt(d, q)), 16)
		eventually(t, 20*time.Second, func() error {
			if m := lookup(s, r.worker, keys); m.GPU != len(keys) {
				return fmt.Errorf("index has %d of the %d blocks of question %d on %s", m.GPU, len(keys), q, r.worker)
			}
			return nil
		})
	}
	if achieved < 0.5*predicted || achieved == 0 {
		t.Errorf("achieved %v cached tokens, predicted %v: the run reused too little to test", achieved, predicted)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	pred, _ := metric(m, "baton_kv_predicted_cached_tokens_total", `strategy="kv_aware"`)
	got, _ := metric(m, "baton_kv_achieved_cached_tokens_total", `strategy="kv_aware"`)
	if pred <= 0 || math.Abs(got-pred) > 0.05*pred {
		t.Errorf("baton_kv_predicted_cached_tokens_total %v, baton_kv_achieved_cached_tokens_total %v: want within 5%%", pred, got)
	}
	t.Logf("predicted %v cached tokens, achieved %v", pred, got)
	var engineCached int64
	for _, e := range engines {
		engineCached += e.Stats().CachedTokens
	}
	if float64(engineCached) != got {
		t.Errorf("the engines found %d tokens cached, the scheduler counted %v achieved", engineCached, got)
	}
}

// TestFakeVLLMAllBlocksCleared: an engine's AllBlocksCleared empties its
// entries in the index, and only its own.
func TestFakeVLLMAllBlocksCleared(t *testing.T) {
	s, addr, engines := startFakeVLLMs(t, 2, "kv_aware")
	c := oaClient(t, addr)
	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	prompts := map[string][]uint64{}
	for d := range 2 {
		p := fakeVLLMPrompt(d, 0)
		r := chat(t, c, chatParams(p, 4))
		prompts[r.worker] = blockkey.AppendTokens(nil, seed, engineTokens(p), 16)
	}
	// kv_aware spreads two cold documents over two idle engines.
	if len(prompts) != 2 {
		t.Fatalf("two documents went to %d engines, want 2", len(prompts))
	}
	for w, keys := range prompts {
		eventually(t, 10*time.Second, func() error {
			if m := lookup(s, w, keys); m.GPU != len(keys) {
				return fmt.Errorf("index has %d of %s's %d blocks", m.GPU, w, len(keys))
			}
			return nil
		})
	}
	if err := engines[0].ResetPrefixCache(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v0", prompts["v0"]); m.GPU != 0 {
			return fmt.Errorf("after v0's AllBlocksCleared the index has %d of its blocks", m.GPU)
		}
		return nil
	})
	if m := lookup(s, "v1", prompts["v1"]); m.GPU != len(prompts["v1"]) {
		t.Errorf("v0's clear left %d of v1's %d blocks in the index", m.GPU, len(prompts["v1"]))
	}
	if n := engines[0].CachedBlocks(); n != 0 {
		t.Errorf("v0 holds %d blocks after its reset", n)
	}
}

// TestFakeVLLMTenants: the same prompt under two tenants never hits across
// them inside the engine, which is sent each tenant as cache_salt; each
// tenant's own repeat does.
func TestFakeVLLMTenants(t *testing.T) {
	_, addr, engines := startFakeVLLMs(t, 1, "kv_aware")
	c := oaClient(t, addr)
	p := fakeVLLMPrompt(0, 0)
	ask := func(tenant string) chatResult {
		params := chatParams(p, 4)
		params.PromptCacheKey = openai.String(tenant)
		return chat(t, c, params)
	}
	for i, want := range []struct {
		tenant string
		hit    bool
	}{{"tenant-a", false}, {"tenant-b", false}, {"tenant-a", true}, {"tenant-b", true}} {
		var r chatResult
		if want.hit {
			// The tenant's blocks reach the index through the engine's events.
			eventually(t, 10*time.Second, func() error {
				if r = ask(want.tenant); predictedHit(t, r.route) < 0.9 {
					return fmt.Errorf("%s's repeat: route %q", want.tenant, r.route)
				}
				return nil
			})
		} else {
			r = ask(want.tenant)
			if hit := predictedHit(t, r.route); hit != 0 {
				t.Errorf("request %d, %s's first: predicted hit %v, want 0", i, want.tenant, hit)
			}
		}
		if got := r.cached > 0; got != want.hit {
			t.Errorf("request %d (%s): %d of %d tokens cached, want a hit %v", i, want.tenant, r.cached, r.prompt, want.hit)
		}
	}
	for _, req := range engines[0].Requests()[:2] {
		if req.CachedTokens != 0 {
			t.Errorf("the engine found %d tokens cached for %s's first request", req.CachedTokens, req.CacheSalt)
		}
	}
	if salts := []string{engines[0].Requests()[0].CacheSalt, engines[0].Requests()[1].CacheSalt}; salts[0] != "tenant-a" || salts[1] != "tenant-b" {
		t.Errorf("cache_salt the engine saw first: %q, want tenant-a then tenant-b", salts)
	}
}

// TestFakeVLLMEventVariants: kv_aware over fake engines whose events are
// written as other publishers write them (a first block's parent as 0,
// block_size 0, full-width integers; older vLLM's fields; bytes hashes,
// nil fields left out) indexes every block they store, drops none for an
// unknown parent, and keeps a document's questions on the engine that
// holds it.
func TestFakeVLLMEventVariants(t *testing.T) {
	for name, cfg := range map[string]vllmtest.Config{
		"array-like, llm-d Go publisher": {Encoding: kveventstest.ArrayLike, EventsVariant: kveventstest.Variant{
			NoParent: kveventstest.ParentZero, ZeroBlockSize: true, FixedInts: true}},
		"array-like, parent 0, vLLM 0.9 fields": {Encoding: kveventstest.ArrayLike, EventsVariant: kveventstest.Variant{
			NoParent: kveventstest.ParentZero, StoredFields: kveventstest.FieldsLoRAID}},
		"maps, bytes hashes, nils left out": {Encoding: kveventstest.Maps, EventsVariant: kveventstest.Variant{
			NoParent: kveventstest.ParentAbsent, OmitNil: true, BytesHashes: true}},
	} {
		t.Run(name, func(t *testing.T) {
			s, addr, engines := startFakeVLLMsWith(t, 2, "kv_aware", cfg)
			c := oaClient(t, addr)
			seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
			holder := map[int]string{}
			for q := range 6 {
				d := q % 2
				p := fakeVLLMPrompt(d, q)
				r := chat(t, c, chatParams(p, 4))
				if h, ok := holder[d]; ok && r.worker != h {
					t.Errorf("question %d on document %d went to %s, the document is on %s", q, d, r.worker, h)
				} else if !ok {
					holder[d] = r.worker
				}
				keys := blockkey.AppendTokens(nil, seed, engineTokens(p), 16)
				eventually(t, 20*time.Second, func() error {
					if m := lookup(s, r.worker, keys); m.GPU != len(keys) {
						return fmt.Errorf("index has %d of the %d blocks of question %d on %s", m.GPU, len(keys), q, r.worker)
					}
					return nil
				})
			}
			// An engine publishes the blocks of an answer as it ends, which
			// may be after its client has the answer: wait for them.
			eventually(t, 10*time.Second, func() error {
				var engineStored int64
				for _, e := range engines {
					engineStored += e.Stats().BlocksStored
				}
				m := scrapeSettled(t, httpClient(t), addr)
				stored, _ := metric(m, "baton_kv_events_total", `outcome="stored"`)
				unknown, _ := metric(m, "baton_kv_events_total", `outcome="unknown_parent"`)
				bad, _ := metric(m, "baton_kv_events_total", `outcome="bad_stored"`)
				if stored != float64(engineStored) || unknown != 0 || bad != 0 {
					return fmt.Errorf("baton_kv_events_total stored %v, unknown_parent %v, bad_stored %v; want the engines' %d blocks stored, none dropped",
						stored, unknown, bad, engineStored)
				}
				return nil
			})
		})
	}
}

// TestFakeVLLMManyEngines: a scheduler follows the KV events of 128 fake
// vLLM engines (two of the index's groups of workers): each engine stores
// a document of its own, every one of them reaches the index, and
// kv_aware sends a question on a document to the engine that holds it.
func TestFakeVLLMManyEngines(t *testing.T) {
	const n = 128
	// The test is of the events; scraping a fleet is measured in bench/.
	s, addr, engines := startFakeVLLMFleet(t, n, "kv_aware", vllmtest.Config{Encoding: kveventstest.TaggedMaps}, 5*time.Second)
	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	for i, e := range engines {
		e.Churn(engineTokens(fakeVLLMPrompt(i, 0)))
	}
	for i := range engines {
		keys := blockkey.AppendTokens(nil, seed, engineTokens(fakeVLLMPrompt(i, 0)), 16)
		name := fmt.Sprintf("v%d", i)
		eventually(t, 30*time.Second, func() error {
			if m := lookup(s, name, keys); m.GPU != len(keys) {
				return fmt.Errorf("the index has %d of the %d blocks %s stored", m.GPU, len(keys), name)
			}
			return nil
		})
	}
	c := oaClient(t, addr)
	for _, i := range []int{0, 1, 63, 64, 65, 100, 127} {
		r, err := streamChat(t, c, chatParams(fakeVLLMPrompt(i, 0), 4))
		if err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("v%d", i); r.worker != want {
			t.Errorf("document %d went to %s, held by %s", i, r.worker, want)
		} else if r.cached == 0 {
			t.Errorf("document %d on %s: no token cached", i, r.worker)
		}
	}
}
