package scheduler_test

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// startFakeDP starts a fake vLLM with two data-parallel ranks and a
// scheduler routing to it with kv_aware, as the worker v0 with
// data_parallel_size 2 and no models listed (the model is the engine's),
// once subscribed to both ranks' events. Requests are tokenized with a
// generous timeout: on a loaded machine (a -race run beside others) the
// engine's /tokenize can take longer than the default 250 ms, and a
// request it times out is keyed by its text, which no engine event
// matches.
func startFakeDP(t *testing.T) (*scheduler.Scheduler, string, *vllmtest.DP) {
	t.Helper()
	d, err := vllmtest.NewDP(vllmtest.Config{Model: model, TimeScale: 1000, Encoding: kveventstest.TaggedMaps}, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	s, addr := startDPScheduler(t, d, scheduler.WorkerConfig{Name: "v0", Kind: scheduler.KindVLLM})
	return s, addr, d
}

// startDPScheduler starts a kv_aware scheduler routing to the two-rank
// engine d as the worker wc (its name, kind and block size set), with
// data_parallel_size 2, rank 0's event endpoints, rankPool's health
// checks and a generous tokenize timeout, once subscribed to both ranks'
// events.
func startDPScheduler(t *testing.T, d *vllmtest.DP, wc scheduler.WorkerConfig) (*scheduler.Scheduler, string) {
	t.Helper()
	r0 := d.Rank(0)
	wc.Address = d.URL
	wc.Events, wc.EventsReplay, wc.EventsTopic = r0.EventsEndpoint(), r0.ReplayEndpoint(), r0.Topic()
	wc.MetricsInterval, wc.DataParallelSize, wc.TokenizeTimeout = 50*time.Millisecond, 2, 10*time.Second
	s, addr := startSchedulerLog(t, scheduler.Config{Strategy: "kv_aware", Pool: rankPool(), Workers: []scheduler.WorkerConfig{wc}}, warnings(t))
	for r := range 2 {
		if err := d.Rank(r).WaitSubscribed(ctxT(t, 10*time.Second)); err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return s, addr
}

// warnings returns a logger whose warnings and errors go to t's log,
// shown when the test fails (a failed tokenization says why there), until
// the test's cleanups have run.
func warnings(t *testing.T) *slog.Logger {
	w := &testLog{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.t = nil
	})
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// testLog writes to a test's log while it has one.
type testLog struct {
	mu sync.Mutex
	t  *testing.T
}

func (w *testLog) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.t != nil {
		w.t.Log(strings.TrimSpace(string(p)))
	}
	return len(p), nil
}

// keyingState says how the scheduler keyed requests so far (its
// tokenize outcomes) and the model and block size it keys them with, for
// a prediction that missed.
func keyingState(t *testing.T, s *scheduler.Scheduler, addr string) string {
	var out []string
	for _, l := range strings.Split(scrape(t, httpClient(t), addr), "\n") {
		if (strings.HasPrefix(l, "baton_tokenize_total") || strings.HasPrefix(l, "baton_kv_events_total")) && !strings.HasSuffix(l, " 0") {
			out = append(out, l)
		}
	}
	for _, r := range []string{"v0/dp0", "v0/dp1"} {
		w := s.Pool.Snapshot().Worker(r)
		if w == nil {
			out = append(out, r+" not in the pool")
			continue
		}
		out = append(out, fmt.Sprintf("%s serves %v, healthy %t, blocks of %d tokens", r, w.ServedModels(), w.Healthy(), lookup(s, r, nil).BlockTokens))
	}
	return strings.Join(out, "; ")
}

// rankPool is fastPool with health checks a loaded -race run meets: the
// tests that check where each question goes assume both ranks stay
// available, and a 100 ms timeout marks a live rank down when two checks
// in a row are slow (the front serves both ranks' checks), sending a
// document's question to the rank that does not hold it.
func rankPool() pool.Config {
	c := fastPool()
	c.HealthInterval, c.HealthTimeout = 2*time.Second, 2*time.Second
	return c
}

// TestDataParallelPredictedHit: kv_aware over a vLLM engine with two
// data-parallel ranks routes to each rank as to a worker of its own: a
// document's questions go to the rank that holds it (the request carries
// its X-data-parallel-rank), and the hit predicted from that rank's events
// is the hit it achieves. One document is first served by rank 1 without
// the scheduler, so that only the rank's events can tell where it is: the
// requests' keys must be those of the events (the engine's model and
// block size), not merely those the scheduler recorded as it routed,
// which expire after a few seconds.
func TestDataParallelPredictedHit(t *testing.T) {
	s, addr, d := startFakeDP(t)
	c := oaClient(t, addr)
	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	rng := rand.New(rand.NewPCG(3, 4))
	holder := map[int]string{0: "v0/dp1"}
	served := map[string]int{}
	warm := fakeVLLMPrompt(0, 100)
	chat(t, oaClient(t, strings.TrimPrefix(d.Rank(1).URL, "http://")), chatParams(warm, 4))
	warmKeys := blockkey.AppendTokens(nil, seed, engineTokens(warm), 16)
	eventually(t, 20*time.Second, func() error {
		if m := lookup(s, "v0/dp1", warmKeys); m.GPU != len(warmKeys) {
			return fmt.Errorf("index has %d of the %d blocks rank 1 served without the scheduler", m.GPU, len(warmKeys))
		}
		return nil
	})
	served["v0/dp1"]++ // the warm-up, which rank 1 counts among its requests
	var predicted, achieved float64
	for q := range 16 {
		doc := rng.IntN(4)
		r, err := streamChat(t, c, chatParams(fakeVLLMPrompt(doc, q), 4))
		if err != nil {
			t.Fatal(err)
		}
		served[r.worker]++
		hit := predictedHit(t, r.route)
		got := float64(r.cached) / float64(r.prompt)
		if math.Abs(hit-got) > 0.05 {
			t.Errorf("question %d on document %d: predicted hit %.2f on %s, achieved %.2f (route %q); %s",
				q, doc, hit, r.worker, got, r.route, keyingState(t, s, addr))
		}
		if h, ok := holder[doc]; ok && r.worker != h {
			t.Errorf("question %d on document %d went to %s, the document is on %s (route %q)", q, doc, r.worker, h, r.route)
		} else if !ok {
			holder[doc] = r.worker
		}
		predicted += hit * float64(r.prompt)
		achieved += float64(r.cached)
		keys := blockkey.AppendTokens(nil, seed, engineTokens(fakeVLLMPrompt(doc, q)), 16)
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
	// Each rank served exactly what was routed to it.
	for r := range 2 {
		name := fmt.Sprintf("v0/dp%d", r)
		if got := len(d.Rank(r).Requests()); got != served[name] || got == 0 {
			t.Errorf("rank %d served %d requests, %d were routed to %s; want the same, some", r, got, served[name], name)
		}
	}
}

// TestDataParallelAllBlocksCleared: a rank's AllBlocksCleared empties that
// rank's entries in the index, and only its own.
func TestDataParallelAllBlocksCleared(t *testing.T) {
	s, addr, d := startFakeDP(t)
	c := oaClient(t, addr)
	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	prompts := map[string][]uint64{}
	// New documents go to their homes on the ring: ask until each rank
	// holds one.
	for doc := 0; len(prompts) < 2 && doc < 16; doc++ {
		p := fakeVLLMPrompt(doc, 0)
		r := chat(t, c, chatParams(p, 4))
		if prompts[r.worker] == nil {
			prompts[r.worker] = blockkey.AppendTokens(nil, seed, engineTokens(p), 16)
		}
	}
	if len(prompts) != 2 || prompts["v0/dp0"] == nil || prompts["v0/dp1"] == nil {
		t.Fatalf("two documents went to %d ranks, want one on each", len(prompts))
	}
	for w, keys := range prompts {
		eventually(t, 10*time.Second, func() error {
			if m := lookup(s, w, keys); m.GPU != len(keys) {
				return fmt.Errorf("index has %d of %s's %d blocks", m.GPU, w, len(keys))
			}
			return nil
		})
	}
	if err := d.Rank(1).ResetPrefixCache(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		if m := lookup(s, "v0/dp1", prompts["v0/dp1"]); m.GPU != 0 {
			return fmt.Errorf("after rank 1's AllBlocksCleared the index has %d of its blocks", m.GPU)
		}
		return nil
	})
	if m := lookup(s, "v0/dp0", prompts["v0/dp0"]); m.GPU != len(prompts["v0/dp0"]) {
		t.Errorf("rank 1's clear left %d of rank 0's %d blocks in the index", m.GPU, len(prompts["v0/dp0"]))
	}
}

// TestDiscoveredDataParallelEngine: an endpoint discovered in an
// EndpointSlice, with data_parallel_size 2 in discovery.worker, joins as
// its two ranks, each subscribed to its rank's events and sent the
// requests routed to it; when the endpoint goes, both ranks leave.
func TestDiscoveredDataParallelEngine(t *testing.T) {
	d, err := vllmtest.NewDP(vllmtest.Config{Model: model, TimeScale: 1000, Encoding: kveventstest.TaggedMaps}, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	onHost := func(endpoint string) string { return strings.Replace(endpoint, "127.0.0.1", "{host}", 1) }
	r0 := d.Rank(0)
	api := fake.NewClientset(engineSlice(t, "v0", d.URL))
	f := startFleetSpec(t, simfleet.Spec{Scheduler: scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Discovery: scheduler.DiscoveryConfig{
			Mode:       scheduler.DiscoveryKubernetes,
			Kubernetes: discovery.KubernetesConfig{Namespace: "baton", Selector: "app=vllm", Port: "grpc", Client: api},
			Worker: scheduler.WorkerConfig{Kind: scheduler.KindVLLM, Models: []string{model},
				EngineConfig: scheduler.EngineConfig{
					Events: onHost(r0.EventsEndpoint()), EventsReplay: onHost(r0.ReplayEndpoint()), EventsTopic: r0.Topic(),
					MetricsInterval: 50 * time.Millisecond, DataParallelSize: 2,
				}},
		},
	}})
	s := f.Scheduler
	poolIs(t, s.Pool, "v0/dp0", "v0/dp1")
	for r := range 2 {
		if err := d.Rank(r).WaitSubscribed(ctxT(t, 10*time.Second)); err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	c := oaClient(t, f.Addr)
	served := map[string]int{}
	for q := range 4 {
		served[chat(t, c, chatParams(fakeVLLMPrompt(q, q), 4)).worker]++
	}
	for r := range 2 {
		name := fmt.Sprintf("v0/dp%d", r)
		if got := len(d.Rank(r).Requests()); got != served[name] || got == 0 {
			t.Errorf("rank %d served %d requests, %d were routed to %s; want the same, some", r, got, served[name], name)
		}
	}
	if err := api.DiscoveryV1().EndpointSlices("baton").Delete(context.Background(), "v0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	poolIs(t, s.Pool)
}

// TestSGLangDataParallelLoad: an SGLang engine with two data-parallel
// ranks is two workers, each with the load of its dp_rank's series.
func TestSGLangDataParallelLoad(t *testing.T) {
	series := func(name string, v0, v1 float64) string {
		return fmt.Sprintf("# TYPE %[1]s gauge\n%[1]s{dp_rank=\"0\",engine_type=\"unified\",model_name=%[2]q,tp_rank=\"0\"} %[3]v\n"+
			"%[1]s{dp_rank=\"1\",engine_type=\"unified\",model_name=%[2]q,tp_rank=\"0\"} %[4]v\n", name, model, v0, v1)
	}
	eng := startFakeEngine(t, series("sglang:num_running_reqs", 7, 2)+series("sglang:num_queue_reqs", 4, 1)+
		series("sglang:token_usage", 0.5, 0.25)+series("sglang:max_total_num_tokens", 80000, 80000))
	s, _ := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Workers: []scheduler.WorkerConfig{{
			Name: "s0", Kind: scheduler.KindSGLang, Address: eng.srv.URL,
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond, BlockSize: 32, DataParallelSize: 2},
		}},
	})
	for w, want := range map[string]kvindex.Load{
		"s0/dp0": {Running: 7, Waiting: 4, GPUBlocksUsed: 1250, GPUBlocksTotal: 2500},
		"s0/dp1": {Running: 2, Waiting: 1, GPUBlocksUsed: 625, GPUBlocksTotal: 2500},
	} {
		eventually(t, 10*time.Second, func() error {
			if m := lookup(s, w, nil); m.Load != want {
				return fmt.Errorf("%s: load %+v, want %+v", w, m.Load, want)
			}
			return nil
		})
	}
}

// TestSGLangDataParallelPredictedHit: kv_aware over an SGLang engine
// started with --dp-size 2 (a fake one that speaks SGLang's formats: its
// /tokenize takes a prompt, its metrics are labelled dp_rank, its event
// batches carry attn_dp_rank) routes to each rank as to a worker of its
// own: each request is pinned to the rank baton chose by the
// X-Data-Parallel-Rank header, which SGLang reads before the body's
// routed_dp_rank, and none is left to SGLang's own balancing; each rank's
// capacity is read from its own dp_rank series; and the hit predicted
// from a rank's events is the hit it achieves. One document is first
// served by rank 1 without the scheduler, so that only that rank's events
// can tell where it is.
func TestSGLangDataParallelPredictedHit(t *testing.T) {
	const blockSize = 32 // SGLang's --page-size
	d, err := vllmtest.NewDP(vllmtest.Config{Model: model, TimeScale: 1000, BlockSize: blockSize, SGLang: true}, 2,
		func(rank int, c *vllmtest.Config) { c.GPUBlocks = 4000 - 1000*rank })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	s, addr := startDPScheduler(t, d, scheduler.WorkerConfig{Name: "s0", Kind: scheduler.KindSGLang,
		EngineConfig: scheduler.EngineConfig{BlockSize: blockSize}})
	for r := range 2 {
		w, want := fmt.Sprintf("s0/dp%d", r), d.Rank(r).GPUBlocks()
		eventually(t, 10*time.Second, func() error {
			if got := lookup(s, w, nil).Load.GPUBlocksTotal; got != int64(want) {
				return fmt.Errorf("%s: %d GPU blocks, want its rank's %d (sglang:max_total_num_tokens{dp_rank=\"%d\"} / %d)", w, got, want, r, blockSize)
			}
			return nil
		})
	}

	seed := blockkey.TokenSeed(blockkey.Salt(model, "", ""))
	keysOf := func(prompt string) []uint64 {
		return blockkey.AppendTokens(nil, seed, vllmtest.CompletionTokens(prompt, true), blockSize)
	}
	complete := func(c openai.Client, prompt string) (worker, route string, promptTokens, cached int64) {
		t.Helper()
		var resp *http.Response
		got, err := c.Completions.New(ctxT(t, 30*time.Second), openai.CompletionNewParams{
			Model: openai.CompletionNewParamsModel(model), Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt)},
			MaxTokens: openai.Int(4),
		}, option.WithResponseInto(&resp))
		if err != nil {
			t.Fatalf("completion: %v", err)
		}
		return resp.Header.Get("X-Baton-Worker"), resp.Header.Get("X-Baton-Route"),
			got.Usage.PromptTokens, got.Usage.PromptTokensDetails.CachedTokens
	}
	warm := fakeVLLMPrompt(0, 100)
	complete(oaClient(t, strings.TrimPrefix(d.Rank(1).URL, "http://")), warm)
	eventually(t, 20*time.Second, func() error {
		if m, keys := lookup(s, "s0/dp1", keysOf(warm)), keysOf(warm); m.GPU != len(keys) {
			return fmt.Errorf("index has %d of the %d blocks rank 1 served without the scheduler", m.GPU, len(keys))
		}
		return nil
	})

	c := oaClient(t, addr)
	rng := rand.New(rand.NewPCG(5, 6))
	holder := map[int]string{0: "s0/dp1"}
	served := map[string]int{"s0/dp1": 1} // the warm-up
	var predicted, achieved float64
	for q := range 16 {
		doc := rng.IntN(4)
		prompt := fakeVLLMPrompt(doc, q)
		worker, route, promptTokens, cached := complete(c, prompt)
		served[worker]++
		hit := predictedHit(t, route)
		got := float64(cached) / float64(promptTokens)
		if math.Abs(hit-got) > 0.05 {
			t.Errorf("question %d on document %d: predicted hit %.2f on %s, achieved %.2f (route %q)", q, doc, hit, worker, got, route)
		}
		if h, ok := holder[doc]; ok && worker != h {
			t.Errorf("question %d on document %d went to %s, the document is on %s (route %q)", q, doc, worker, h, route)
		} else if !ok {
			holder[doc] = worker
		}
		predicted += hit * float64(promptTokens)
		achieved += float64(cached)
		keys := keysOf(prompt)
		eventually(t, 20*time.Second, func() error {
			if m := lookup(s, worker, keys); m.GPU != len(keys) {
				return fmt.Errorf("index has %d of the %d blocks of question %d on %s", m.GPU, len(keys), q, worker)
			}
			return nil
		})
	}
	if achieved < 0.5*predicted || achieved == 0 {
		t.Errorf("achieved %v cached tokens, predicted %v: the run reused too little to test", achieved, predicted)
	}
	for r, warmups := range []int{0, 1} {
		name := fmt.Sprintf("s0/dp%d", r)
		if got := len(d.Rank(r).Requests()); got != served[name] || got == warmups {
			t.Errorf("rank %d served %d requests, %d were routed to %s (with %d warm-up); want the same, some routed", r, got, served[name], name, warmups)
		}
	}
	// The warm-up went to rank 1's own server, not through the front.
	if header, body, balanced := d.Pinned(); header != 16 || body != 0 || balanced != 0 {
		t.Errorf("the engine saw %d requests pinned by X-Data-Parallel-Rank, %d by routed_dp_rank and %d it balanced itself; want 16, 0, 0",
			header, body, balanced)
	}
}
