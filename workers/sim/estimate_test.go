package sim_test

import (
	"context"
	"io"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"
)

// The figures a worker reports must let kv_aware predict what the worker
// charges: these tests take them the way the scheduler does (Info, then
// the KV index) and compare its estimate, in real seconds × TimeScale,
// with the engine's modelled seconds.

var presets = []sim.Config{
	{Cost: cost.Config{Model: "llama-3.1-8b", GPU: "h100", TP: 1}, TimeScale: 1000},
	{Cost: cost.Config{Model: "llama-3.1-8b", GPU: "h200", TP: 1}, TimeScale: 250},
	{Cost: cost.Config{Model: "llama-3.1-70b", GPU: "h100", TP: 2}, TimeScale: 50, Tiers: sim.Tiers{PCIeBandwidth: 32e9}},
}

func startSim(t *testing.T, cfg sim.Config) *sim.Engine {
	t.Helper()
	e, err := sim.New(cfg)
	if err != nil {
		t.Fatalf("sim.New: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// reported returns the cost figures the scheduler holds for e once it has
// read e's Info.
func reported(t *testing.T, e *sim.Engine) kvindex.Cost {
	t.Helper()
	info, err := sim.NewServer(e).Info(context.Background(), &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	x := kvindex.New(kvindex.Config{})
	if err := x.SetInfo("w", watch.InfoFromProto(info)); err != nil {
		t.Fatal(err)
	}
	out := make([]kvindex.Match, 1)
	x.Lookup(nil, []string{"w"}, out)
	if !out[0].HasCost || out[0].BlockTokens != sim.BlockTokens {
		t.Fatalf("Lookup = %+v, want the worker's cost and %d-token blocks", out[0], sim.BlockTokens)
	}
	return out[0].Cost
}

// prefillEstimate is kv_aware's time for n new tokens over cached ones
// with nothing queued: the compute, plus every step it takes paying for
// the weights and the KV of usedBlocks blocks decoded alongside.
func prefillEstimate(c kvindex.Cost, n, cached, running int, usedBlocks int64) float64 {
	return c.PrefillSeconds(n, cached) + float64(c.Steps(int64(n), running))*c.StepSeconds(usedBlocks)
}

func near(got, want float64) bool { return math.Abs(got-want) <= 1e-9*math.Abs(want) }

func TestReportedFiguresEstimateCharge(t *testing.T) {
	for _, cfg := range presets {
		t.Run(cfg.Cost.Model+"/"+cfg.Cost.GPU, func(t *testing.T) {
			e := startSim(t, cfg)
			c, cm, ts := reported(t, e), e.CostModel(), cfg.TimeScale
			tests := []struct {
				n, cached int
				// decodes sequences decode alongside, their contexts
				// summing to context tokens (whole blocks).
				decodes, context int
			}{
				{1, 0, 0, 0},
				{500, 0, 0, 0},
				{8192, 0, 0, 0},
				{100, 3900, 0, 0},
				{4000, 4000, 0, 0},
				{1, 32000, 0, 0},
				{1000, 0, 8, 8 * 2048},
				{2000, 6000, 32, 32 * 4096},
				{8160, 0, 32, 32 * 512},
				{16, 12000, 1, 128 * 1024},
			}
			for _, tt := range tests {
				used := int64(tt.context / sim.BlockTokens)
				got := prefillEstimate(c, tt.n, tt.cached, tt.decodes, used) * ts
				want := cm.DecodeStepSeconds(tt.decodes, tt.context) + cm.PrefillSeconds(tt.n, tt.cached)
				if !near(got, want) {
					t.Errorf("n=%d cached=%d decodes=%d context=%d: estimate %.9g s, engine charges %.9g s",
						tt.n, tt.cached, tt.decodes, tt.context, got, want)
				}
			}
			for _, blocks := range []int{1, 7, 500} {
				if got, want := c.CPUCopySeconds(blocks)*ts, e.PCIeSeconds(blocks); !near(got, want) {
					t.Errorf("CPU copy of %d blocks: estimate %.9g s, engine charges %.9g s", blocks, got, want)
				}
				if got, want := c.RedisFetchSeconds(blocks)*ts, e.FetchSeconds(blocks); !near(got, want) {
					t.Errorf("Redis fetch of %d blocks: estimate %.9g s, engine charges %.9g s", blocks, got, want)
				}
			}
		})
	}
}

// A running engine charges, for a lone request's first token, what the
// estimate from its reported figures says.
func TestReportedFiguresEstimateRun(t *testing.T) {
	tests := []struct{ n, cached int }{
		{1, 0}, {700, 0}, {8192, 0}, {100, 3904}, {4000, 4000}, {16, 12000},
	}
	for _, cfg := range presets {
		for _, tt := range tests {
			e := startSim(t, cfg)
			c := reported(t, e)
			text := words(rand.New(rand.NewPCG(uint64(tt.n), uint64(tt.cached))), tt.cached+tt.n)
			before := e.Stats()
			if tt.cached > 0 {
				firstToken(t, e, text[:4*tt.cached])
				before = waitSteps(t, e, uint64(c.Steps(int64(tt.cached), 0)))
			}
			if got := firstToken(t, e, text); got != tt.cached {
				t.Fatalf("%s n=%d: %d tokens cached, want %d", cfg.Cost.Model, tt.n, got, tt.cached)
			}
			after := waitSteps(t, e, before.Steps+1)
			got := prefillEstimate(c, tt.n, tt.cached, 0, 0) * cfg.TimeScale
			if charged := after.ModelledSeconds - before.ModelledSeconds; !near(got, charged) {
				t.Errorf("%s/%s n=%d cached=%d: estimate %.9g s, engine charged %.9g s",
					cfg.Cost.Model, cfg.Cost.GPU, tt.n, tt.cached, got, charged)
			}
		}
	}
}

// Prompts longer than a step's budget take the steps Steps counts. The
// estimate then bounds the charge from above: the engine's chunks do not
// attend to the chunks after them.
func TestReportedFiguresEstimateChunked(t *testing.T) {
	cfg := presets[0]
	e := startSim(t, cfg)
	c := reported(t, e)
	const n = 20000
	before := e.Stats()
	firstToken(t, e, words(rand.New(rand.NewPCG(1, 2)), n))
	steps := c.Steps(n, 0)
	after := waitSteps(t, e, before.Steps+uint64(steps))
	if got := after.Steps - before.Steps; got != uint64(steps) {
		t.Errorf("engine took %d steps, Steps = %d", got, steps)
	}
	est := prefillEstimate(c, n, 0, 0, 0) * cfg.TimeScale
	if charged := after.ModelledSeconds - before.ModelledSeconds; !(est >= charged && est < 1.2*charged) {
		t.Errorf("estimate %.6g s, engine charged %.6g s: want an upper bound within 20%%", est, charged)
	}
}

// words returns n tokens of text, 4 characters each.
func words(rng *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteByte(' ')
		for range 3 {
			b.WriteByte(byte('a' + rng.IntN(26)))
		}
	}
	return b.String()
}

// firstToken runs prompt to its first token and returns its cached tokens.
func firstToken(t *testing.T, e *sim.Engine, prompt string) int {
	t.Helper()
	st, err := e.Generate(context.Background(), &engine.Request{Model: e.Config().Models[0], Prompt: prompt, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for {
		ev, err := st.Recv()
		if err == io.EOF {
			t.Fatal("stream ended without usage")
		}
		if err != nil {
			t.Fatal(err)
		}
		if ev.Final != nil {
			return ev.Final.CachedTokens
		}
	}
}

// waitSteps waits for e to have accounted for steps steps (the step loop
// counts a step after its tokens are out) and returns its stats.
func waitSteps(t *testing.T, e *sim.Engine, steps uint64) sim.Stats {
	t.Helper()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for {
		s := e.Stats()
		if s.Steps >= steps {
			return s
		}
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("engine at %d steps, want %d", s.Steps, steps)
		}
	}
}

// kv_aware's figures for workers that report none are the default
// simulated engine's.
func TestDefaultCostIsDefaultEngine(t *testing.T) {
	if got := reported(t, startSim(t, sim.Config{})); got != kvindex.DefaultCost {
		t.Errorf("default engine reports %+v, kvindex.DefaultCost = %+v", got, kvindex.DefaultCost)
	}
}
