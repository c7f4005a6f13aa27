package routing

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/watch"
)

// kvFleet is a fleet with a KV index fed by hand, as the watcher would.
type kvFleet struct {
	*fleet
	idx *kvindex.Index
	seq map[string]uint64
}

func newKVFleet(t testing.TB, n int) *kvFleet {
	t.Helper()
	return newKVFleetConfig(t, n, kvindex.Config{})
}

// newKVFleetConfig is newKVFleet with the index's configuration (e.g. a
// clock that does not move).
func newKVFleetConfig(t testing.TB, n int, cfg kvindex.Config) *kvFleet {
	t.Helper()
	f := &kvFleet{fleet: newFleet(t, n), idx: kvindex.New(cfg), seq: map[string]uint64{}}
	for _, w := range f.snap().Workers[:min(n, kvindex.MaxWorkers)] {
		f.apply(w.Name, &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{}}})
	}
	return f
}

// apply applies ev to the index as the next event of worker's stream.
func (f *kvFleet) apply(worker string, ev *workerpb.WatchEvent) {
	f.t.Helper()
	if ev.GetSnapshot() != nil {
		f.seq[worker] = 0
	}
	f.seq[worker]++
	ev.Seq = f.seq[worker]
	if err := f.idx.Apply(worker, watch.FromProto(ev)); err != nil {
		f.t.Fatal(err)
	}
}

func (f *kvFleet) store(worker string, tier workerpb.Tier, keys []uint64) {
	f.apply(worker, &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
		Kind: workerpb.CacheEvent_KIND_STORED, Tier: tier, Keys: keys}}})
}

func (f *kvFleet) report(worker string, l *workerpb.LoadReport) {
	f.apply(worker, &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Load{Load: l}})
}

// info gives worker the simulated engine's default cost figures, with
// Redis at redisBps bytes/s, and access to the Redis tier if redis.
func (f *kvFleet) info(worker string, redis bool, redisBps float64) {
	f.t.Helper()
	c := kvindex.DefaultCost
	err := f.idx.SetInfo(worker, watch.InfoFromProto(&workerpb.InfoResponse{BlockChars: 64, RedisTier: redis, Cost: &workerpb.CostParams{
		Layers: int32(c.Layers), Hidden: int32(c.Hidden), Flops: c.FLOPS, DecodeStepSeconds: c.DecodeStepSeconds,
		KvBytesPerBlock: c.KVBytesPerBlock, PcieBytesPerSecond: c.PCIeBytesPerSecond,
		RedisBytesPerSecond: redisBps, RedisRttSeconds: c.RedisRTTSeconds,
	}}))
	if err != nil {
		f.t.Fatal(err)
	}
}

func (f *kvFleet) strategy(p Params, d Deps) Strategy {
	f.t.Helper()
	if d.Rand == nil {
		d.Rand = SeededRand(1)
	}
	var r Registry
	RegisterBuiltins(&r)
	d.Index = f.idx
	s, err := r.New(KVAware, p, d)
	if err != nil {
		f.t.Fatal(err)
	}
	return s
}

// prompt returns the keys of a 500-block (8,000-token) prompt.
func prompt(seed uint64) []uint64 {
	rng := rand.New(rand.NewPCG(seed, 99))
	ks := make([]uint64, 500)
	for i := range ks {
		ks[i] = rng.Uint64()
	}
	return ks
}

func kvRequest(keys []uint64) *Request {
	return &Request{Model: "llama", Keys: keys, Tokens: 16 * len(keys)}
}

func TestKVAwareChoosesByCache(t *testing.T) {
	ks := prompt(1)
	fast, slow := kvindex.DefaultCost.RedisBytesPerSecond, 1e6
	tests := []struct {
		name       string
		setup      func(f *kvFleet)
		want       string
		wantCached int
		wantSpill  bool
	}{
		{"GPU holder", func(f *kvFleet) {
			f.store("w02", workerpb.Tier_TIER_GPU, ks[:400])
			f.store("w01", workerpb.Tier_TIER_GPU, ks[:100])
		}, "w02", 400 * 16, false},
		{"CPU holder over recompute", func(f *kvFleet) {
			f.store("w03", workerpb.Tier_TIER_CPU, ks)
		}, "w03", 500 * 16, false},
		{"longer GPU and CPU run over shorter GPU run", func(f *kvFleet) {
			f.store("w01", workerpb.Tier_TIER_GPU, ks[:200])
			f.store("w02", workerpb.Tier_TIER_GPU, ks[:100])
			f.store("w02", workerpb.Tier_TIER_CPU, ks[100:500])
		}, "w02", 500 * 16, false},
		{"Redis fetch over recompute", func(f *kvFleet) {
			f.info("w00", false, fast)
			f.info("w01", true, fast)
			f.store("w00", workerpb.Tier_TIER_REDIS, ks)
			f.load("w00", 1)
			f.load("w02", 1)
			f.load("w03", 1)
		}, "w01", 500 * 16, false},
		{"recompute over a slow Redis", func(f *kvFleet) {
			f.info("w01", true, slow)
			f.store("w00", workerpb.Tier_TIER_REDIS, ks)
			for _, w := range []string{"w00", "w01", "w03"} {
				f.report(w, &workerpb.LoadReport{Running: 1, Waiting: 1, WaitingPrefillTokens: 8000})
			}
		}, "w02", 0, true},
		{"queue wait outweighs the cache", func(f *kvFleet) {
			f.store("w01", workerpb.Tier_TIER_GPU, ks)
			f.report("w01", &workerpb.LoadReport{Running: 8, WaitingPrefillTokens: 200_000})
			f.load("w00", 1)
			f.load("w02", 1)
		}, "w03", 0, false},
		{"hot prefix at the threshold spreads, warming from Redis", func(f *kvFleet) {
			f.info("w00", true, fast)
			f.info("w02", true, fast)
			f.store("w01", workerpb.Tier_TIER_GPU, ks)
			f.store("w01", workerpb.Tier_TIER_REDIS, ks)
			f.load("w01", 2)
			f.report("w02", &workerpb.LoadReport{Running: 1, Waiting: 1, WaitingPrefillTokens: 8000})
		}, "w00", 500 * 16, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newKVFleet(t, 4)
			tt.setup(f)
			s := f.strategy(Params{ConcurrencyThreshold: 2}, Deps{})
			d, err := s.Pick(kvRequest(ks), f.snap())
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker.Name != tt.want || d.PredictedCached != tt.wantCached || d.Spill != tt.wantSpill {
				t.Errorf("Pick = %s (cached %d, spill %t, reason %s), want %s (cached %d, spill %t)",
					d.Worker.Name, d.PredictedCached, d.Spill, d.Reason, tt.want, tt.wantCached, tt.wantSpill)
			}
			if d.Reason != ReasonKVAware {
				t.Errorf("Reason = %v, want %v", d.Reason, ReasonKVAware)
			}
		})
	}
}

func TestKVAwareSiblingBurstLandsTogether(t *testing.T) {
	f := newKVFleet(t, 8)
	s := f.strategy(Params{}, Deps{})
	ks := prompt(2)
	var first string
	for i := range 6 {
		req := kvRequest(ks)
		d, err := s.Pick(req, f.snap())
		if err != nil {
			t.Fatal(err)
		}
		Commit(s, req, d) // the front end, once it acquired the worker
		if i == 0 {
			first = d.Worker.Name
			if d.PredictedCached != 0 {
				t.Errorf("first request: PredictedCached = %d, want 0", d.PredictedCached)
			}
		} else if d.Worker.Name != first || d.PredictedCached != 500*16 {
			t.Errorf("sibling %d: %s (cached %d), want %s (cached %d)", i, d.Worker.Name, d.PredictedCached, first, 500*16)
		}
		f.load(d.Worker.Name, 1) // the front end acquires it
	}
	// An unrelated prompt goes elsewhere: the first worker is busy.
	d, err := s.Pick(kvRequest(prompt(3)), f.snap())
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker.Name == first {
		t.Errorf("unrelated prompt went to the busy %s", first)
	}
}

// TestKVAwarePickChangesNothing: a pick records nothing; only a commit,
// for the worker that serves, predicts blocks and counts the request.
func TestKVAwarePickChangesNothing(t *testing.T) {
	f := newKVFleet(t, 4)
	s := f.strategy(Params{}, Deps{})
	req := kvRequest(prompt(5))
	names := []string{"w00", "w01", "w02", "w03"}
	ms := make([]kvindex.Match, len(names))
	var first Decision
	for i := range 5 { // a request re-picking while it waits in the queue
		d, err := s.Pick(req, f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = d
		}
	}
	f.idx.Lookup(req.Keys, names, ms)
	for i, m := range ms {
		if m.GPU != 0 || m.Routed != 0 || m.PendingTokens != 0 {
			t.Errorf("%s after picks alone: %d blocks, routed %v, pending %d; want nothing", names[i], m.GPU, m.Routed, m.PendingTokens)
		}
	}
	// The caller replaced the choice (a full worker); the commit goes to
	// the worker that serves.
	served := first
	for _, w := range f.snap().Workers {
		if w != first.Worker {
			served.Worker, served.Reason = w, ReasonFull
			break
		}
	}
	Commit(s, req, served)
	f.idx.Lookup(req.Keys, names, ms)
	for i, m := range ms {
		wantBlocks, wantRouted := 0, 0.0
		if names[i] == served.Worker.Name {
			wantBlocks, wantRouted = len(req.Keys), 1
		}
		if m.GPU != wantBlocks || math.Abs(m.Routed-wantRouted) > 0.01 {
			t.Errorf("%s after the commit: %d predicted blocks, routed %.2f; want %d, %.0f", names[i], m.GPU, m.Routed, wantBlocks, wantRouted)
		}
	}
}

func TestKVAwareOnlyAvailableWorkers(t *testing.T) {
	f := newKVFleet(t, 3)
	f.add("other", "mistral")
	ks := prompt(4)
	f.store("w00", workerpb.Tier_TIER_GPU, ks)
	f.apply("other", &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{}}})
	f.store("other", workerpb.Tier_TIER_GPU, ks)
	f.setHealthy("w00", false)
	f.openBreaker("w01")
	s := f.strategy(Params{}, Deps{})
	for range 5 {
		d, err := s.Pick(kvRequest(ks), f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != "w02" {
			t.Fatalf("Pick = %s, want w02, the only available worker serving llama", d.Worker.Name)
		}
	}
	f.setHealthy("w02", false)
	if _, err := s.Pick(kvRequest(ks), f.snap()); !errors.Is(err, ErrNoWorker) {
		t.Fatalf("no available worker: err %v, want ErrNoWorker", err)
	}
}

// TestKVAwareBeyondMaxWorkers: fleets larger than one of the index's
// groups of workers (MaxWorkers) are looked up in batches, and a holder
// past the first group is found.
func TestKVAwareBeyondMaxWorkers(t *testing.T) {
	f := newKVFleet(t, kvindex.MaxWorkers+6)
	ks := prompt(9)
	f.store("w40", workerpb.Tier_TIER_GPU, ks)
	for _, w := range f.snap().Workers[:kvindex.MaxWorkers] {
		f.report(w.Name, &workerpb.LoadReport{Running: 1, Waiting: 1, WaitingPrefillTokens: 8000})
	}
	s := f.strategy(Params{}, Deps{})
	for i := range 20 {
		s := f.strategy(Params{}, Deps{Rand: SeededRand(uint64(i))})
		d, err := s.Pick(kvRequest(ks), f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != "w40" {
			t.Fatalf("seed %d: Pick = %s, want w40, the holder", i, d.Worker.Name)
		}
	}
	// A new prompt goes to an idle worker of the second group, not to
	// one that reports a queue.
	d, err := s.Pick(kvRequest(prompt(10)), f.snap())
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker.Name < fmt.Sprintf("w%02d", kvindex.MaxWorkers) {
		t.Errorf("cold prompt: Pick = %s, want one of the idle workers past the first group", d.Worker.Name)
	}
}

func TestKVAwareAllFull(t *testing.T) {
	f := newKVFleet(t, 3)
	ks := prompt(5)
	f.store("w01", workerpb.Tier_TIER_GPU, ks)
	for _, w := range f.snap().Workers {
		f.load(w.Name, 1)
	}
	d, err := f.strategy(Params{ConcurrencyThreshold: 1}, Deps{}).Pick(kvRequest(ks), f.snap())
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker.Name != "w01" || d.Reason != ReasonAllFull || d.Spill {
		t.Errorf("Pick = %s (%v, spill %t), want w01 (%v, no spill)", d.Worker.Name, d.Reason, d.Spill, ReasonAllFull)
	}
}

func TestKVAwareEstimateAndCorrection(t *testing.T) {
	// A clock that does not move: the correction's sums decay with time,
	// and on a loaded machine the microseconds between the observations
	// and the pick moved the estimate past the test's tolerance.
	now := time.Now()
	f := newKVFleetConfig(t, 1, kvindex.Config{Now: func() time.Time { return now }})
	s := f.strategy(Params{}, Deps{})
	ks := prompt(6)
	d, err := s.Pick(kvRequest(ks), f.snap())
	if err != nil {
		t.Fatal(err)
	}
	est := d.Estimate
	Commit(s, kvRequest(ks), d)
	c := kvindex.DefaultCost
	// One step of the 8,192-token budget, reading the weights only.
	if want := time.Duration((c.PrefillSeconds(8000, 0) + c.DecodeStepSeconds) * float64(time.Second)); est != want {
		t.Errorf("cold estimate %v, want %v (prefill of 8,000 tokens in one step)", est, want)
	}
	// The first request's 8,000 tokens are pending on w00 now. Twenty
	// requests that took three times their one-second estimate make the
	// correction factor (60+1)/(20+1) against the index's 1 s prior, of
	// which kv_aware applies the excess over the 25% dead band.
	for range 20 {
		f.idx.ObserveTTFT("w00", time.Second, 3*time.Second)
	}
	corr := 61.0/21 - 0.25
	d2, err := s.Pick(kvRequest(prompt(7)), f.snap())
	if err != nil {
		t.Fatal(err)
	}
	est2 := d2.Estimate
	// 16,000 tokens to prefill (8,000 ahead) take two steps.
	want := time.Duration((c.QueueSeconds(8000, 8000) + c.PrefillSeconds(8000, 0) + 2*c.DecodeStepSeconds) * corr * float64(time.Second))
	if d := est2 - want; d < -time.Microsecond || d > time.Microsecond {
		t.Errorf("corrected estimate %v, want %v", est2, want)
	}
}

// A prefix that keeps one worker busy while others have served nothing
// lately is copied onto an idle worker; once traffic is spread, requests
// stay with the holders.
func TestKVAwareReplicatesHotPrefixOntoIdleWorker(t *testing.T) {
	f := newKVFleet(t, 4)
	s := f.strategy(Params{}, Deps{Rand: SeededRand(1)})
	system := prompt(9)[:300] // a shared system prompt: 4,800 tokens
	f.store("w01", workerpb.Tier_TIER_GPU, system)
	session := func(i uint64) *Request {
		return kvRequest(append(append([]uint64(nil), system...), prompt(100 + i)[:20]...))
	}
	// Sessions keep arriving at w01, which holds the system prompt, while
	// every other worker has served nothing.
	var replicated []string
	for i := range uint64(40) {
		req := session(i)
		d, err := s.Pick(req, f.snap())
		if err != nil {
			t.Fatal(err)
		}
		Commit(s, req, d)
		Done(s, req, d, DoneInfo{FirstToken: d.Estimate})
		if d.Reason == ReasonReplicate {
			if got := d.RouteHit(KVAware, req.Tokens); got != "kv_aware; predicted_hit=0.00; replicate=true" {
				t.Errorf("X-Baton-Route %q", got)
			}
			if d.Worker.Name == "w01" || d.PredictedCached != 0 || d.Spill {
				t.Fatalf("request %d: replicated onto %s, predicted cached %d; want an idle worker recomputing", i, d.Worker.Name, d.PredictedCached)
			}
			replicated = append(replicated, d.Worker.Name)
			// The idle worker now holds the system prompt too.
			f.store(d.Worker.Name, workerpb.Tier_TIER_GPU, system)
		}
	}
	if len(replicated) == 0 {
		t.Fatalf("the hot prefix was never replicated")
	}
	t.Logf("replicated onto %v", replicated)
	if len(replicated) > 3 {
		t.Errorf("replicated %d times (%v), want at most once per idle worker", len(replicated), replicated)
	}
}

// A worker routed few requests is not called hot: the holder keeps them.
func TestKVAwareNoReplicationOnLittleTraffic(t *testing.T) {
	f := newKVFleet(t, 4)
	s := f.strategy(Params{}, Deps{Rand: SeededRand(1)})
	system := prompt(9)[:300]
	f.store("w01", workerpb.Tier_TIER_GPU, system)
	for i := range uint64(hotMinRouted - 1) {
		req := kvRequest(append(append([]uint64(nil), system...), prompt(100 + i)[:20]...))
		d, err := s.Pick(req, f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != "w01" || d.Reason == ReasonReplicate {
			t.Fatalf("request %d: %s (%v), want w01", i, d.Worker.Name, d.Reason)
		}
		Commit(s, req, d)
		Done(s, req, d, DoneInfo{FirstToken: d.Estimate})
	}
}

// Done carries a committed decision's outcome back to the index: the
// achieved time to first token corrects the worker's estimates, and the
// tokens it computed no longer wait on it. An attempt that ended without
// a first token teaches nothing.
func TestKVAwareDoneFeedsIndex(t *testing.T) {
	f := newKVFleet(t, 1)
	s := f.strategy(Params{}, Deps{})
	req := kvRequest(prompt(6))
	d, err := s.Pick(req, f.snap())
	if err != nil {
		t.Fatal(err)
	}
	Commit(s, req, d)
	lookup := func() kvindex.Match {
		ms := make([]kvindex.Match, 1)
		f.idx.Lookup(nil, []string{"w00"}, ms)
		return ms[0]
	}
	if m := lookup(); m.PendingTokens != 8000 || m.Correction != 1 {
		t.Fatalf("after Commit: pending %d, correction %v; want 8000, 1", m.PendingTokens, m.Correction)
	}
	Done(s, req, d, DoneInfo{Err: errors.New("worker failed")})
	if m := lookup(); m.PendingTokens != 8000 || m.Correction != 1 {
		t.Fatalf("after a failed attempt: pending %d, correction %v; want 8000, 1", m.PendingTokens, m.Correction)
	}
	Done(s, req, d, DoneInfo{FirstToken: 3 * d.Estimate})
	m := lookup()
	if m.PendingTokens != 0 {
		t.Errorf("after the first token: pending %d, want 0", m.PendingTokens)
	}
	p := d.Estimate.Seconds()
	if want := (3*p + 1) / (p + 1); math.Abs(m.Correction-want) > 1e-6 {
		t.Errorf("after the first token: correction %v, want %v", m.Correction, want)
	}
}

// A prompt no worker holds goes to the worker whose steps read the least
// KV, not to whichever the random start met first; a cached prompt stays
// with its holder however much that worker decodes.
func TestKVAwareSpreadsByDecodeLoad(t *testing.T) {
	f := newKVFleet(t, 3)
	for _, w := range f.snap().Workers {
		f.info(w.Name, false, 0)
	}
	cached := prompt(11)
	f.store("w02", workerpb.Tier_TIER_GPU, cached)
	for seed := uint64(1); seed <= 8; seed++ {
		// w00 and w02 decode 40 sequences of 8,000 tokens (20,000 blocks);
		// w01 decodes 10 of them. A report also clears what the previous
		// picks predicted.
		f.report("w00", &workerpb.LoadReport{Running: 40, GpuBlocksUsed: 20000})
		f.report("w01", &workerpb.LoadReport{Running: 10, GpuBlocksUsed: 5000})
		f.report("w02", &workerpb.LoadReport{Running: 40, GpuBlocksUsed: 20000})
		s := f.strategy(Params{}, Deps{Rand: SeededRand(seed)})
		// A 2,000-token prompt: its prefill (about 55 ms) is short enough
		// for the 11 ms the busier workers' steps add to count.
		d, err := s.Pick(kvRequest(prompt(100 + seed)[:125]), f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != "w01" {
			t.Errorf("seed %d: cold prompt went to %s, want w01 (least KV decoded)", seed, d.Worker.Name)
		}
		d, err = s.Pick(kvRequest(cached), f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != "w02" {
			t.Errorf("seed %d: cached prompt went to %s, want its holder w02", seed, d.Worker.Name)
		}
	}
}

// ringHome returns the worker first met walking f's ring from key, of
// those that keep (all when keep is nil).
func (f *kvFleet) ringHome(key uint64, keep func(name string) bool) string {
	snap := f.snap()
	home := ""
	snap.Ring.Walk(key, func(m int) bool {
		if keep == nil || keep(snap.Workers[m].Name) {
			home = snap.Workers[m].Name
			return false
		}
		return true
	})
	return home
}

// Of workers whose estimates tie, a prompt no worker holds goes to its
// home on the ring from its first block, whatever the requests each
// worker was routed, has in flight, the correction factors one replica
// learned, and the random start: every replica
// in front of the fleet, each with its own index and history, places it
// alike.
func TestKVAwareTiesGoToRingHome(t *testing.T) {
	replicas := []*kvFleet{newKVFleet(t, 3), newKVFleet(t, 3)}
	for _, f := range replicas {
		for _, w := range f.snap().Workers {
			f.info(w.Name, false, 0)
		}
	}
	// One replica routed a few prompts, and has requests in flight.
	replicas[0].idx.Predict("w00", prompt(50))
	replicas[0].idx.Predict("w01", prompt(51))
	replicas[0].idx.Predict("w01", prompt(52))
	replicas[0].load("w01", 1)
	// It found every worker slower than estimated, by factors of its own.
	for i, w := range replicas[0].snap().Workers {
		for range 20 {
			replicas[0].idx.ObserveTTFT(w.Name, 100*time.Millisecond, time.Duration(2+i)*100*time.Millisecond)
		}
	}
	for seed := uint64(1); seed <= 12; seed++ {
		req := kvRequest(prompt(200 + seed))
		want := replicas[0].ringHome(req.Keys[0], nil)
		for r, f := range replicas {
			for _, w := range f.snap().Workers {
				f.report(w.Name, &workerpb.LoadReport{})
			}
			d, err := f.strategy(Params{}, Deps{Rand: SeededRand(seed)}).Pick(req, f.snap())
			if err != nil {
				t.Fatal(err)
			}
			home := ""
			if d.Home != nil {
				home = d.Home.Name
			}
			if d.Worker.Name != want || d.Spill || home != want {
				t.Errorf("prompt %d, replica %d: Pick = %s (spill %t, home %q), want its ring home %s", seed, r, d.Worker.Name, d.Spill, home, want)
			}
		}
	}
}

// A prompt no worker holds leaves its home on the ring when the home is
// at the threshold or reports a queue (for the best estimate), and when
// the home is full or down (for its successor on the ring).
func TestKVAwareColdPromptLeavesBusyHome(t *testing.T) {
	ks := prompt(60)
	tests := []struct {
		name string
		// setup makes the home (named) busy; it returns the worker the
		// request must go to, "" for any but the home.
		setup func(f *kvFleet, home string, req *Request) string
	}{
		{"at the threshold", func(f *kvFleet, home string, _ *Request) string {
			f.load(home, 2)
			return ""
		}},
		{"reporting a queue", func(f *kvFleet, home string, _ *Request) string {
			f.report(home, &workerpb.LoadReport{Running: 4, Waiting: 2, WaitingPrefillTokens: 16000})
			return ""
		}},
		{"full", func(f *kvFleet, home string, req *Request) string {
			f.load(home, 1)
			req.MaxInFlight = 1
			return f.ringHome(ks[0], func(n string) bool { return n != home })
		}},
		{"down", func(f *kvFleet, home string, _ *Request) string {
			f.openBreaker(home)
			return f.ringHome(ks[0], func(n string) bool { return n != home })
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newKVFleet(t, 4)
			for _, w := range f.snap().Workers {
				f.info(w.Name, false, 0)
			}
			home := f.ringHome(ks[0], nil)
			req := kvRequest(ks)
			want := tt.setup(f, home, req)
			d, err := f.strategy(Params{ConcurrencyThreshold: 2}, Deps{}).Pick(req, f.snap())
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker.Name == home || want != "" && d.Worker.Name != want {
				t.Errorf("Pick = %s, home %s; want %q (\"\": any but the home)", d.Worker.Name, home, want)
			}
		})
	}
}

// A prompt no worker holds whose home is busy spills along its own walk of
// the ring, to the first worker there estimated within homeTolerance of
// the fastest, not to the fastest: replicas that have not yet heard of one
// another's latest requests then spread a burst of new prompts as the
// ring does, where each sending its spill to the worker it sees as least
// loaded would send them all there.
func TestKVAwareColdPromptSpillsAlongItsRing(t *testing.T) {
	f := newKVFleet(t, 4)
	for _, w := range f.snap().Workers {
		f.info(w.Name, false, 0)
	}
	spilled := 0
	for seed := uint64(1); seed <= 40; seed++ {
		ks := prompt(300 + seed)
		home := f.ringHome(ks[0], nil)
		next := f.ringHome(ks[0], func(n string) bool { return n != home })
		for _, w := range f.snap().Workers {
			f.report(w.Name, &workerpb.LoadReport{})
		}
		// The home reports a long queue; its successor a short one,
		// which puts it some 8% behind the idle workers, within
		// homeTolerance and beyond tieTolerance.
		f.report(home, &workerpb.LoadReport{Running: 4, Waiting: 2, WaitingPrefillTokens: 16000})
		f.report(next, &workerpb.LoadReport{Waiting: 1, WaitingPrefillTokens: 640})
		d, err := f.strategy(Params{ConcurrencyThreshold: 8}, Deps{}).Pick(kvRequest(ks), f.snap())
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.Name != next {
			t.Errorf("prompt %d: Pick = %s; want %s, the home %s's successor on the ring", seed, d.Worker.Name, next, home)
		}
		if d.Worker.Name != home {
			spilled++
		}
	}
	if spilled == 0 {
		t.Fatal("no prompt left its busy home")
	}
}

// newLearnedFleet returns a fleet of n workers that publish no cache
// events, as llama-servers of the given slots: the index learns what they
// hold from kv_aware's commits and the cached tokens they report.
func newLearnedFleet(t testing.TB, n, slots int) *kvFleet {
	t.Helper()
	f := &kvFleet{fleet: newFleet(t, n), idx: kvindex.New(kvindex.Config{}), seq: map[string]uint64{}}
	for _, w := range f.snap().Workers {
		if err := f.idx.Learn(w.Name, kvindex.Capacity{Prompts: slots}); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// serve picks a worker for req and plays the request's life there as the
// front end would, each request ending before the next: commit, first
// token as estimated, usage reporting the cached tokens predicted. With
// events, the worker reports the prompt's blocks stored.
func (f *kvFleet) serve(s Strategy, req *Request, events bool) Decision {
	f.t.Helper()
	d, err := s.Pick(req, f.snap())
	if err != nil {
		f.t.Fatal(err)
	}
	Commit(s, req, d)
	Done(s, req, d, DoneInfo{FirstToken: d.Estimate})
	if events {
		f.store(d.Worker.Name, workerpb.Tier_TIER_GPU, req.Keys)
	}
	Finish(s, req, d, FinishInfo{Usage: true, PromptTokens: req.Tokens, CachedTokens: d.PredictedCached})
	return d
}

// chat returns the keys of a conversation's prompt: the shared system
// prompt, then the conversation's own blocks.
func chat(system []uint64, own ...[]uint64) []uint64 {
	ks := append([]uint64(nil), system...)
	for _, o := range own {
		ks = append(ks, o...)
	}
	return ks
}

// New conversations sharing a short system prompt (112 tokens), over four
// idle workers, one at a time: every worker serves some. Each worker that
// holds the system prompt estimates a new conversation its recomputation
// faster than one that does not, with nothing else to tell them apart,
// and once three hold it they share the traffic evenly, none twice the
// mean: the fourth must still be given the prompt.
func TestKVAwareSharedPrefixStarvesNoWorker(t *testing.T) {
	system := prompt(20)[:7]
	for _, events := range []bool{false, true} {
		for seed := uint64(1); seed <= 6; seed++ {
			t.Run(fmt.Sprintf("events=%t/seed=%d", events, seed), func(t *testing.T) {
				f := newLearnedFleet(t, 4, 4)
				if events {
					f = newKVFleet(t, 4)
				}
				s := f.strategy(Params{}, Deps{Rand: SeededRand(seed)})
				served := map[string]int{}
				for i := range uint64(60) {
					d := f.serve(s, kvRequest(chat(system, prompt(300 + i)[:4])), events)
					served[d.Worker.Name]++
				}
				for _, w := range f.snap().Workers {
					if served[w.Name] == 0 {
						t.Errorf("%s served none of 60 new conversations (%v)", w.Name, served)
					}
				}
			})
		}
	}
}

// Sending a shared system prompt to a starved worker moves no request
// away from the one worker holding its own history: a conversation's
// later turn, a question on a long document.
func TestKVAwareKeepsAffinityBesideStarvedWorker(t *testing.T) {
	system := prompt(20)[:7]
	history := chat(system, prompt(40)[:4], prompt(41)[:14]) // turn 1: 60 tokens asked, 220 answered
	doc := prompt(42)                                        // 8,000 tokens
	tests := []struct {
		name string
		keys []uint64
		want string
	}{
		{"later turn", chat(history, prompt(43)[:4]), "w01"},
		{"long document", chat(doc, prompt(44)[:4]), "w02"},
		{"new conversation", chat(system, prompt(45)[:4]), "w03"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newLearnedFleet(t, 4, 4)
			// w00–w02 each served 12 new conversations, w03 nothing;
			// then w01 served a conversation's first turn and w02 a
			// question on the document.
			s := f.strategy(Params{}, Deps{})
			served := func(worker string, keys []uint64) {
				req := kvRequest(keys)
				d := Decision{Worker: f.worker(worker), Reason: ReasonKVAware, Estimate: time.Millisecond}
				Commit(s, req, d)
				Done(s, req, d, DoneInfo{FirstToken: d.Estimate})
				Finish(s, req, d, FinishInfo{Usage: true, PromptTokens: req.Tokens, CachedTokens: 112})
			}
			for i := range uint64(36) {
				served(fmt.Sprintf("w%02d", i%3), chat(system, prompt(500 + i)[:4]))
			}
			served("w01", history)
			served("w02", chat(doc, prompt(46)[:4]))
			for seed := uint64(1); seed <= 6; seed++ {
				s := f.strategy(Params{}, Deps{Rand: SeededRand(seed)})
				d, err := s.Pick(kvRequest(tt.keys), f.snap())
				if err != nil {
					t.Fatal(err)
				}
				if d.Worker.Name != tt.want {
					t.Errorf("seed %d: Pick = %s (cached %d, %v), want %s", seed, d.Worker.Name, d.PredictedCached, d.Reason, tt.want)
				}
			}
		})
	}
}

func TestRouteHit(t *testing.T) {
	tests := []struct {
		d        Decision
		strategy string
		tokens   int
		want     string
	}{
		{Decision{PredictedCached: 6640}, KVAware, 8000, "kv_aware; predicted_hit=0.83"},
		{Decision{PredictedCached: 0}, KVAware, 0, "kv_aware; predicted_hit=0.00"},
		{Decision{PredictedCached: 8000, Spill: true}, KVAware, 8000, "kv_aware; predicted_hit=1.00; spill=true"},
		{Decision{Spill: true}, PrefixAware, 8000, "prefix_aware; spill=true"},
	}
	for _, tt := range tests {
		if got := tt.d.RouteHit(tt.strategy, tt.tokens); got != tt.want {
			t.Errorf("RouteHit(%s, %d) = %q, want %q", tt.strategy, tt.tokens, got, tt.want)
		}
	}
}

func TestKVAwareDoesNotAllocate(t *testing.T) {
	skipUnderRace(t)
	f := newKVFleet(t, 16)
	s := f.strategy(Params{}, Deps{})
	req := kvRequest(prompt(8))
	snap := f.snap()
	if _, err := s.Pick(req, snap); err != nil { // warm the scratch and index
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = s.Pick(req, snap) }); n != 0 {
		t.Errorf("Pick allocates %v times, want 0", n)
	}
}

// BenchmarkKVAware measures one kv_aware decision (index lookup, estimates,
// prediction) for an 8,000-token prompt (500 keys) with a million blocks
// indexed across the workers. Each prompt's first 300 blocks are held by
// one worker; the rest are new. It reports the heap per indexed block.
// newHeldFleet returns a fleet of n workers whose index holds blocks
// random keys, an equal share on each worker in its GPU tier, and those
// keys by worker. Each worker has the default costs, a Redis tier and a
// little load.
func newHeldFleet(b *testing.B, n, blocks int, rng *rand.Rand) (*kvFleet, [][]uint64) {
	f := newKVFleet(b, n)
	held := make([][]uint64, n)
	for i, w := range f.snap().Workers {
		if i >= kvindex.MaxWorkers { // newKVFleet snapshots the first group's
			f.apply(w.Name, &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{}}})
		}
		ks := make([]uint64, blocks/n)
		for j := range ks {
			ks[j] = rng.Uint64()
		}
		held[i] = ks
		f.info(w.Name, true, kvindex.DefaultCost.RedisBytesPerSecond)
		f.store(w.Name, workerpb.Tier_TIER_GPU, ks)
		f.report(w.Name, &workerpb.LoadReport{Running: int32(i % 4), WaitingPrefillTokens: int64(i%3) * 1000})
	}
	return f, held
}

// heldBench is the KV-aware benchmarks' setup: n workers holding 1 Mi
// blocks between them, a kv_aware strategy over them, and 64 prompts of
// 500 keys (300 a worker holds, 200 new) whose predictions are indexed.
// bytesPerBlock is what the index grew by per block it holds.
func heldBench(b *testing.B, n int) (s Strategy, snap *pool.Snapshot, reqs []*Request, bytesPerBlock float64) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f, held := newHeldFleet(b, n, 1<<20, rand.New(rand.NewPCG(5, 6)))
	per := len(held[0])
	runtime.GC()
	runtime.ReadMemStats(&after)
	bytesPerBlock = float64(after.HeapAlloc-before.HeapAlloc) / float64(f.idx.Len())
	const prompts = 64
	reqs = make([]*Request, prompts)
	for p := range reqs {
		ks := append(append([]uint64(nil), held[p%n][p*300%(per-300):][:300]...), prompt(uint64(p))[:200]...)
		reqs[p] = kvRequest(ks)
	}
	s = f.strategy(Params{ConcurrencyThreshold: 1024}, Deps{})
	snap = f.snap()
	for _, r := range reqs { // index the predicted blocks
		d, err := s.Pick(r, snap)
		if err != nil {
			b.Fatal(err)
		}
		Commit(s, r, d)
	}
	runtime.GC()
	return s, snap, reqs, bytesPerBlock
}

func BenchmarkKVAware(b *testing.B) {
	for _, n := range []int{8, 64, 1000} {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", n), func(b *testing.B) {
			s, snap, reqs, bytesPerBlock := heldBench(b, n)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				if _, err := s.Pick(reqs[i%len(reqs)], snap); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(bytesPerBlock, "B/block")
		})
	}
}

// BenchmarkKVAwareCold is BenchmarkKVAware with the CPU's caches cold,
// as a scheduler finds them between requests while its process (and, in
// the bench, the simulated fleet beside it) does other work: before each
// decision it writes coldBytes, more than this machine's caches keep for
// one core. ns/op counts that writing; cold-p50-ns and cold-p99-ns are
// the decision alone.
func BenchmarkKVAwareCold(b *testing.B) {
	const coldBytes = 64 << 20
	evict := make([]byte, coldBytes)
	for _, n := range []int{8, 64, 1000} {
		b.Run(fmt.Sprintf("workers=%d/blocks=1M/keys=500", n), func(b *testing.B) {
			s, snap, reqs, _ := heldBench(b, n)
			lat := make([]time.Duration, 0, 1<<16)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				for j := 0; j < len(evict); j += 64 {
					evict[j]++
				}
				t0 := time.Now()
				if _, err := s.Pick(reqs[i%len(reqs)], snap); err != nil {
					b.Fatal(err)
				}
				if len(lat) < cap(lat) {
					lat = append(lat, time.Since(t0))
				}
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "cold-p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "cold-p99-ns")
		})
	}
}

func TestDeadBand(t *testing.T) {
	for _, tt := range []struct{ c, want float64 }{
		{0, 1}, {-1, 1}, {1, 1}, {0.95, 1}, {1.25, 1}, {0.75, 1},
		{1.5, 1.25}, {0.5, 0.75}, {4, 3.75},
	} {
		if got := deadBand(tt.c); math.Abs(got-tt.want) > 1e-12 {
			t.Errorf("deadBand(%v) = %v, want %v", tt.c, got, tt.want)
		}
	}
}
