package calibration_test

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/batonllm/baton/bench/calibration"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"
)

// Calibration against the simulated engine's OpenAI endpoint recovers the
// cost figures it runs with: its prefill FLOP/s, decode step and HBM
// bandwidth within 15%. The engine runs four times slower than modelled,
// so that a loaded machine's late wake-ups, which lengthen each of its
// steps by a millisecond or so, stay small beside them, and beside the
// 6 ms the long batch's KV adds to a step.
func TestRecoversSimulatedFigures(t *testing.T) {
	if testing.Short() {
		t.Skip("measures in real time")
	}
	const scale = 0.25
	w, err := sim.Start(sim.Config{TimeScale: scale}, "127.0.0.1:0", "127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	var progress strings.Builder
	res, err := calibration.Run(context.Background(), calibration.Config{
		URL:          "http://" + w.HTTPAddr,
		Lengths:      []int{1024, 4096},
		Repeats:      3,
		DecodeTokens: 32,
		Batch:        8,
		BatchContext: 4096,
		Progress:     &progress,
	})
	t.Log("\n" + progress.String() + res.YAML())
	if err != nil {
		t.Fatal(err)
	}
	want := cost.DefaultFigures.Scaled(scale)
	for _, f := range []struct {
		name      string
		got, want float64
	}{
		{"flops", res.Figures.FLOPS, want.FLOPS},
		{"decode_step_seconds", res.Figures.DecodeStepSeconds, want.DecodeStepSeconds},
		{"hbm_bytes_per_second", res.Figures.HBMBytesPerSecond, want.HBMBytesPerSecond},
	} {
		t.Logf("%s: measured %.4g, the simulated engine's %.4g", f.name, f.got, f.want)
		if math.Abs(f.got/f.want-1) > 0.15 {
			t.Errorf("%s = %.4g, want %.4g within 15%%", f.name, f.got, f.want)
		}
	}
	if !res.HBMMeasured {
		t.Error("HBM bandwidth not measured")
	}
	if res.Requests == 0 || res.Requests > 200 {
		t.Errorf("%d requests sent, want some and at most the default budget", res.Requests)
	}
}
