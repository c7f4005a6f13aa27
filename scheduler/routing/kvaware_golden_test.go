package routing

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files of testdata")

// TestKVAwareDecisionsGolden pins kv_aware's decisions, to the nanosecond
// of their estimates, over random fleets: of 3 to 130 workers (one group
// or several), with and without cost figures and the Redis tier, loaded,
// partly unavailable, holding random prefixes of a few shared prompts in
// every tier, and picking, committing and learning from a run of requests
// on a clock that does not move. A change to how kv_aware computes its
// decisions that is meant to change none must leave
// testdata/kvaware_decisions.golden as it is; one that means to changes
// it with -update, and the diff shows which decisions moved.
func TestKVAwareDecisionsGolden(t *testing.T) {
	var b strings.Builder
	for seed := range uint64(24) {
		goldenFleet(t, seed, &b)
	}
	const path = "testdata/kvaware_decisions.golden"
	if *updateGolden {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	got, wantLines := strings.Split(b.String(), "\n"), strings.Split(string(want), "\n")
	for i := range max(len(got), len(wantLines)) {
		g, w := "", ""
		if i < len(got) {
			g = got[i]
		}
		if i < len(wantLines) {
			w = wantLines[i]
		}
		if g != w {
			t.Fatalf("decision %d differs from %s:\n got %s\nwant %s", i, path, g, w)
		}
	}
}

// goldenFleet builds seed's random fleet, routes its requests and writes
// their decisions to b.
func goldenFleet(t *testing.T, seed uint64, b *strings.Builder) {
	rng := rand.New(rand.NewPCG(seed, 7))
	sizes := []int{3, 8, 20, 64, 70, 130}
	n := sizes[seed%uint64(len(sizes))]
	now := time.Unix(1_700_000_000, 0)
	f := newKVFleetConfig(t, n, kvindex.Config{Now: func() time.Time { return now }})
	ws := f.snap().Workers
	for i, w := range ws {
		if i >= kvindex.MaxWorkers {
			f.apply(w.Name, &workerpb.WatchEvent{Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{}}})
		}
	}
	prompts := make([][]uint64, 4)
	for p := range prompts {
		prompts[p] = prompt(seed*16 + uint64(p))
	}
	// Identical workers tie; the others differ by their figures, load and
	// what they hold.
	alike := rng.IntN(2) == 0
	for _, w := range ws {
		if alike {
			f.info(w.Name, true, kvindex.DefaultCost.RedisBytesPerSecond)
			continue
		}
		switch rng.IntN(4) {
		case 0: // no figures
		case 1:
			f.info(w.Name, false, kvindex.DefaultCost.RedisBytesPerSecond)
		case 2:
			f.info(w.Name, true, kvindex.DefaultCost.RedisBytesPerSecond)
		case 3:
			f.info(w.Name, true, 1e6)
		}
		if rng.IntN(2) == 0 {
			f.report(w.Name, &workerpb.LoadReport{Running: int32(rng.IntN(8)), Waiting: int32(rng.IntN(3)),
				WaitingPrefillTokens: int64(rng.IntN(4) * 2000), GpuBlocksUsed: int64(rng.IntN(5000)), GpuBlocksTotal: 5000})
		}
		if rng.IntN(2) == 0 {
			f.load(w.Name, rng.IntN(4))
		}
		for range rng.IntN(3) {
			tier := []workerpb.Tier{workerpb.Tier_TIER_GPU, workerpb.Tier_TIER_CPU, workerpb.Tier_TIER_REDIS}[rng.IntN(3)]
			ks := prompts[rng.IntN(len(prompts))]
			f.store(w.Name, tier, ks[:1+rng.IntN(len(ks))])
		}
	}
	if n > 3 && rng.IntN(2) == 0 {
		f.setHealthy(ws[rng.IntN(n)].Name, false)
	}
	p := Params{ConcurrencyThreshold: []int{1, 2, 1024}[rng.IntN(3)]}
	s := f.strategy(p, Deps{})
	for r := range 40 {
		ks := prompts[0] // a hot prompt, which replication may copy
		if rng.IntN(2) == 0 {
			ks = prompts[rng.IntN(len(prompts))]
		}
		if rng.IntN(4) == 0 {
			ks = prompt(1000 + seed*100 + uint64(r)) // a prompt nobody holds
		}
		req := kvRequest(ks[:100+rng.IntN(len(ks)-100)])
		if rng.IntN(6) == 0 {
			req.MaxInFlight = 1 + rng.IntN(2)
		}
		snap := f.snap()
		if rng.IntN(6) == 0 {
			i := rng.IntN(n)
			req.Tried = snap.Workers[i : i+1]
		}
		d, err := s.Pick(req, snap)
		if err != nil {
			fmt.Fprintf(b, "fleet %d request %d: %v\n", seed, r, err)
			continue
		}
		home := ""
		if d.Home != nil {
			home = d.Home.Name
		}
		fmt.Fprintf(b, "fleet %d request %d: %s home %s spill %v reason %s cached %d estimate %d\n",
			seed, r, d.Worker.Name, home, d.Spill, d.Reason, d.PredictedCached, d.Estimate)
		if rng.IntN(3) > 0 {
			Commit(s, req, d)
			if rng.IntN(2) == 0 {
				Done(s, req, d, DoneInfo{FirstToken: d.Estimate * time.Duration(1+rng.IntN(3))})
			}
		}
	}
}
