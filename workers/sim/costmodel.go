package sim

import "github.com/batonllm/baton/workers/engine/cost"

// CostModel is what the engine charges its steps with: baton's one cost
// model, whose figures (CostParams) kv_aware estimates with.
type CostModel = cost.Engine

// NewCostModel returns the cost model of the named presets on tp GPUs with
// default efficiencies.
func NewCostModel(model, gpu string, tp int) (CostModel, error) {
	return cost.NewEngine(model, gpu, tp)
}
