package kvindex

import (
	"math"
	"testing"
)

func TestSteps(t *testing.T) {
	c := Cost{MaxBatchedTokens: 8192}
	tests := []struct {
		tokens  int64
		running int
		want    int64
	}{
		{0, 0, 1},
		{8192, 0, 1},
		{8193, 0, 2},
		{8000, 192, 1},  // 8,000 of 8,192 left after 192 decodes
		{8000, 193, 2},  // 7,999 left
		{8000, 8192, 4}, // never under a quarter of the budget: 2,048 a step
		{16000, 100, 2},
	}
	for _, tt := range tests {
		if got := c.Steps(tt.tokens, tt.running); got != tt.want {
			t.Errorf("Steps(%d, %d) = %d, want %d", tt.tokens, tt.running, got, tt.want)
		}
	}
	if got := new(Cost).Steps(8192, 0); got != 1 {
		t.Errorf("Steps without a budget = %d, want DefaultCost's budget (1 step)", got)
	}
}

func TestStepSeconds(t *testing.T) {
	c := DefaultCost
	if got := c.StepSeconds(0); got != c.DecodeStepSeconds {
		t.Errorf("StepSeconds(0) = %g, want the weights' read %g", got, c.DecodeStepSeconds)
	}
	// 1,000 blocks of 2 MiB at 2.8475 TB/s: 0.7365 ms more.
	want := c.DecodeStepSeconds + 1000*float64(2<<20)/(3.35e12*0.85)
	if got := c.StepSeconds(1000); math.Abs(got-want) > 1e-12 {
		t.Errorf("StepSeconds(1000) = %g, want %g", got, want)
	}
	c.HBMBytesPerSecond = 0
	if got := c.StepSeconds(1000); got != c.DecodeStepSeconds {
		t.Errorf("StepSeconds without a bandwidth = %g, want %g", got, c.DecodeStepSeconds)
	}
}

func TestQueueSeconds(t *testing.T) {
	c := DefaultCost
	// A queue of one 8,000-token prompt costs what prefilling it does.
	if got, want := c.QueueSeconds(8000, 8000), c.PrefillSeconds(8000, 0); math.Abs(got-want) > 1e-12 {
		t.Errorf("QueueSeconds(8000, 8000) = %g, want PrefillSeconds(8000, 0) = %g", got, want)
	}
	// Three of them: three times that.
	if got, want := c.QueueSeconds(24000, 8000), 3*c.PrefillSeconds(8000, 0); math.Abs(got-want) > 1e-12 {
		t.Errorf("QueueSeconds(24000, 8000) = %g, want %g", got, want)
	}
	// A short queue ahead of a long prompt is one short prompt.
	if got, want := c.QueueSeconds(100, 8000), c.PrefillSeconds(100, 0); math.Abs(got-want) > 1e-12 {
		t.Errorf("QueueSeconds(100, 8000) = %g, want %g", got, want)
	}
	if got := c.QueueSeconds(0, 8000); got != 0 {
		t.Errorf("QueueSeconds(0, …) = %g, want 0", got)
	}
}
