package cost

import (
	"errors"
	"testing"
)

func mustCost(t *testing.T, model, gpu string, tp int) Engine {
	t.Helper()
	c, err := NewEngine(model, gpu, tp)
	if err != nil {
		t.Fatalf("NewEngine(%q, %q, %d): %v", model, gpu, tp, err)
	}
	return c
}

func TestKVBytesPerToken(t *testing.T) {
	tests := []struct {
		model string
		tp    int
		want  int64
	}{
		{"llama-3.1-8b", 1, 128 << 10},
		{"llama-3.1-70b", 2, 320 << 10},
	}
	for _, tt := range tests {
		if got := mustCost(t, tt.model, "h100", tt.tp).KVBytesPerToken(); got != tt.want {
			t.Errorf("%s: KVBytesPerToken() = %d, want %d", tt.model, got, tt.want)
		}
	}
}

func TestLookupUnknown(t *testing.T) {
	if _, err := LookupModel("gpt-9"); !errors.Is(err, ErrUnknownPreset) {
		t.Errorf("LookupModel(gpt-9) error = %v, want ErrUnknownPreset", err)
	}
	if _, err := LookupGPU("a100"); !errors.Is(err, ErrUnknownPreset) {
		t.Errorf("LookupGPU(a100) error = %v, want ErrUnknownPreset", err)
	}
}

func TestEngineValidate(t *testing.T) {
	// 70B in FP8 is 70.6 GB: it fits one H100 (76.9 GB usable), barely.
	if _, err := NewEngine("llama-3.1-70b", "h100", 1); err != nil {
		t.Errorf("70b on 1×h100: %v", err)
	}
	c := mustCost(t, "llama-3.1-8b", "h100", 1)
	bad := []func(*Engine){
		func(c *Engine) { c.TP = 0 },
		func(c *Engine) { c.MFU = 0 },
		func(c *Engine) { c.MFU = 1.5 },
		func(c *Engine) { c.BandwidthEfficiency = -1 },
		func(c *Engine) { c.MemoryUtilization = 0 },
		func(c *Engine) { c.Model.Params = 1e12 }, // weights exceed memory
	}
	for i, mutate := range bad {
		cc := c
		mutate(&cc)
		if err := cc.Validate(); err == nil {
			t.Errorf("case %d: Validate() = nil, want an error", i)
		}
	}
}

func TestEngineShape(t *testing.T) {
	c := mustCost(t, "llama-3.1-8b", "h100", 1)
	// Prefill grows superlinearly with new tokens and with cached context.
	if a, b := c.PrefillSeconds(1000, 0), c.PrefillSeconds(2000, 0); !(b > 2*a) {
		t.Errorf("prefill(2000) = %v, want > 2×prefill(1000) = %v", b, 2*a)
	}
	if a, b := c.PrefillSeconds(1000, 0), c.PrefillSeconds(1000, 8000); !(b > a) {
		t.Errorf("prefill over cached context %v, want > %v", b, a)
	}
	// Cached tokens are much cheaper than recomputing them.
	if full, hit := c.PrefillSeconds(4000, 0), c.PrefillSeconds(100, 3900); !(hit < full/10) {
		t.Errorf("prefill with 3900 cached = %v, want < %v/10", hit, full)
	}
	if got := c.PrefillSeconds(0, 100); got != 0 {
		t.Errorf("prefill of nothing = %v, want 0", got)
	}
	// Decode grows with batch and context.
	prev := 0.0
	for _, batch := range []int{1, 8, 64, 256} {
		got := c.DecodeStepSeconds(batch, batch*2000)
		if got <= prev {
			t.Errorf("decode step at batch %d = %v, want > %v", batch, got, prev)
		}
		prev = got
	}
	// TP splits the weights: faster steps, more blocks.
	c2 := mustCost(t, "llama-3.1-8b", "h100", 2)
	if !(c2.DecodeStepSeconds(1, 1000) < c.DecodeStepSeconds(1, 1000)) {
		t.Errorf("TP 2 decode not faster than TP 1")
	}
	if !(c2.BlockCapacity(16) > 2*c.BlockCapacity(16)) {
		t.Errorf("TP 2 capacity %d, want > 2×%d", c2.BlockCapacity(16), c.BlockCapacity(16))
	}
	// 8B on an H100: (85.5 GB × 0.9 − 16 GB) / 2 MiB ≈ 29k blocks.
	if got := c.BlockCapacity(16); got < 25000 || got > 32000 {
		t.Errorf("8b/h100 BlockCapacity(16) = %d, want about 29k", got)
	}
	if h200 := mustCost(t, "llama-3.1-8b", "h200", 1); !(h200.DecodeStepSeconds(1, 0) < c.DecodeStepSeconds(1, 0)) {
		t.Errorf("h200 decode not faster than h100")
	}
}

// TestPublishedFigures compares the presets with published measurements.
// The bounds are loose: the model ignores serving overheads.
func TestPublishedFigures(t *testing.T) {
	// NVIDIA NIM: Llama-3.3-70B FP8 on 2×H100, 5,000 input tokens,
	// concurrency 1: TTFT 407 ms. At concurrency 1 the first token comes
	// from one step: the prefill plus one pass over the weights.
	c70 := mustCost(t, "llama-3.1-70b", "h100", 2)
	weights := c70.DecodeStepSeconds(0, 0)
	prefill := c70.PrefillSeconds(5000, 0)
	ttft := weights + prefill
	t.Logf("70B FP8 2×H100, 5000 tokens: TTFT %.0f ms (weights %.1f ms + prefill %.0f ms); published 407 ms (%+.0f%%)",
		ttft*1e3, weights*1e3, prefill*1e3, (ttft/0.407-1)*100)
	if ttft < 0.407/2 || ttft > 0.407*2 {
		t.Errorf("TTFT %.0f ms is more than 2× off the published 407 ms", ttft*1e3)
	}

	// Llama-3.1-8B BF16 on 1×H100, concurrency 1: ITL about 4.6 ms.
	c8 := mustCost(t, "llama-3.1-8b", "h100", 1)
	itl := c8.DecodeStepSeconds(1, 1000)
	t.Logf("8B BF16 1×H100, batch 1, 1000-token context: ITL %.2f ms; published 4.6 ms (%+.0f%%)",
		itl*1e3, (itl/0.0046-1)*100)
	fp8 := c8
	fp8.Model.WeightBytes = 1
	t.Logf("8B FP8 weights, same: ITL %.2f ms", fp8.DecodeStepSeconds(1, 1000)*1e3)
	if itl < 0.0046/2 || itl > 0.0046*2 {
		t.Errorf("ITL %.2f ms is more than 2× off the published 4.6 ms", itl*1e3)
	}
	t.Logf("8B/H100 KV: %d bytes/token, %d blocks of 16 tokens; 70B/2×H100: %d blocks",
		c8.KVBytesPerToken(), c8.BlockCapacity(16), c70.BlockCapacity(16))
	t.Logf("8B/H100 decode step at batch 64, 2000-token contexts: %.2f ms; at batch 256: %.2f ms",
		c8.DecodeStepSeconds(64, 64*2000)*1e3, c8.DecodeStepSeconds(256, 256*2000)*1e3)
}
