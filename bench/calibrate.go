package bench

import (
	"fmt"
	"math"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/sim"
)

// The simulated engine's natural completion length is uniform in
// [simNaturalMin, simNaturalMax] tokens (workers/sim/text.go), capped by
// max_tokens.
const (
	simNaturalMin = 32
	simNaturalMax = 255
)

// expectedOutput is E[min(natural, maxTokens)] for natural uniform in
// [simNaturalMin, simNaturalMax].
func expectedOutput(maxTokens int) float64 {
	t := 0.0
	for n := simNaturalMin; n <= simNaturalMax; n++ {
		t += float64(min(n, maxTokens))
	}
	return t / float64(simNaturalMax-simNaturalMin+1)
}

// Calibration is the arrival rate that loads a fleet to a fraction of its
// saturation throughput under the simulated engine's cost model.
type Calibration struct {
	Load         float64 // target fraction of saturation throughput, e.g. 0.7
	HitAssumed   float64 // prompt fraction assumed cached
	PromptTokens float64 // mean prompt tokens
	OutputTokens float64 // mean generated tokens
	Prefill      float64 // modelled seconds to prefill the uncached part of a mean prompt
	MaxBatch     int     // largest decode batch: max_running, or the KV capacity over a sequence's blocks
	DecodeStep   float64 // modelled seconds of one decode step at MaxBatch
	Service      float64 // modelled GPU seconds per request at saturation
	Capacity     float64 // saturation req/s per worker
	Rate         float64 // target req/s for the fleet
}

// Calibrate returns the fleet arrival rate that is load × the fleet's
// saturation throughput when a fraction hit of every prompt is cached
// (hit 0: nothing reused, the capacity a content-blind router can count
// on). A saturated worker decodes at its largest batch b — the engine's
// max_running (256) or as many sequences of P + O tokens as its KV blocks
// hold, whichever is smaller — and prefills every request once, so each
// request costs it PrefillSeconds(P(1−h), P·h) + O × DecodeStepSeconds(b,
// b·(P + O/2)) / b of modelled GPU time, and capacity is one over that.
// P is the mean prompt, O the mean completion: the simulator's natural
// length, uniform in [32, 255] tokens, capped by each request's
// max_tokens.
func Calibrate(w *workload.Workload, model, gpu string, workers int, load, hit float64, kvBlocks int64) (Calibration, error) {
	cm, err := sim.NewCostModel(model, gpu, 1)
	if err != nil {
		return Calibration{}, err
	}
	c := Calibration{Load: load, HitAssumed: hit}
	for i := range w.Requests {
		r := &w.Requests[i]
		c.PromptTokens += float64(blockkey.Tokens(blockkey.Chars(r.RoutingText())))
		c.OutputTokens += expectedOutput(r.MaxTokens)
	}
	n := float64(max(len(w.Requests), 1))
	c.PromptTokens /= n
	c.OutputTokens /= n
	P, O := c.PromptTokens, c.OutputTokens
	c.Prefill = cm.PrefillSeconds(int(math.Round(P*(1-hit))), int(math.Round(P*hit)))
	if kvBlocks == 0 {
		kvBlocks = cm.BlockCapacity(BlockTokens)
	}
	perSeq := int64(math.Ceil((P + O) / BlockTokens))
	c.MaxBatch = int(min(int64(sim.DefaultConfig().Batching.MaxRunning), max(kvBlocks/max(perSeq, 1), 1)))
	b := float64(c.MaxBatch)
	c.DecodeStep = cm.DecodeStepSeconds(c.MaxBatch, int(b*(P+O/2)))
	c.Service = c.Prefill + O*c.DecodeStep/b
	c.Capacity = 1 / c.Service
	c.Rate = load * c.Capacity * float64(workers)
	return c, nil
}

// String explains the calibration in a sentence or two.
func (c Calibration) String() string {
	return fmt.Sprintf("Rate calibrated to %.0f%% of saturation throughput from the cost model: mean prompt %.0f tokens (%.0f%% assumed cached), "+
		"mean output %.0f tokens (the simulator's natural length U[%d,%d] capped by max_tokens); a saturated worker spends %.0f ms prefilling a request "+
		"and %.0f decode steps of %.1f ms shared by a batch of %d (KV-bound), %.0f ms of GPU time per request: %.2f req/s per worker; "+
		"%.0f%% of the fleet's capacity is %.2f req/s.",
		c.Load*100, c.PromptTokens, c.HitAssumed*100, c.OutputTokens, simNaturalMin, simNaturalMax,
		c.Prefill*1e3, c.OutputTokens, c.DecodeStep*1e3, c.MaxBatch, c.Service*1e3, c.Capacity, c.Load*100, c.Rate)
}
