package kvindex

import "github.com/batonllm/baton/workers/engine/cost"

// Cost holds a worker's cost figures, in real seconds, from which kv_aware
// estimates time to first token with the simulated engine's own formulas.
type Cost = cost.Figures

// DefaultCost is the cost assumed for workers that report none (OpenAI
// compatible HTTP engines, or a baton worker before its Info arrives): the
// simulated engine's defaults, Llama-3.1-8B in BF16 on one H100.
var DefaultCost = cost.DefaultFigures
