package kvindex

import "github.com/batonllm/baton/proto/workerpb"

// Cost holds the figures of a worker's cost model (workerpb.CostParams),
// in real seconds, from which kv_aware estimates time to first token.
type Cost struct {
	Layers, Hidden int
	// FLOPS is the effective compute throughput, FLOP/s.
	FLOPS float64
	// DecodeStepSeconds is one decode step at batch 1, short context.
	DecodeStepSeconds float64
	// KVBytesPerBlock is the size of one block's KV (16 tokens).
	KVBytesPerBlock int64
	// PCIeBytesPerSecond moves CPU-tier blocks to the GPU;
	// RedisBytesPerSecond and RedisRTTSeconds fetch from the Redis tier.
	PCIeBytesPerSecond  float64
	RedisBytesPerSecond float64
	RedisRTTSeconds     float64
	// HBMBytesPerSecond is the GPU memory bandwidth every step reads the
	// decoded sequences' KV at; MaxBatchedTokens is a step's token budget.
	HBMBytesPerSecond float64
	MaxBatchedTokens  int
}

// DefaultCost is the cost assumed for workers that report none (OpenAI
// compatible HTTP engines, or a baton worker before its Info arrives):
// Llama-3.1-8B in BF16 on one H100, as the simulated engine's defaults
// model it — 32 layers, hidden size 4,096, 989 TFLOP/s × 0.5 MFU, a 5.6 ms
// decode step (16 GB of weights at 3.35 TB/s × 0.85), 2 MiB of KV per
// 16-token block, a PCIe 5 x16 host copy at 64 GB/s, and a Redis tier at
// 10 GB/s (a 100 Gb/s NIC) with 0.5 ms round trips, and vLLM's default
// step budget of 8,192 tokens. At these figures a block fetched from Redis
// (0.21 ms) beats recomputing it (0.38 ms).
var DefaultCost = Cost{
	Layers:              32,
	Hidden:              4096,
	FLOPS:               989e12 * 0.5,
	DecodeStepSeconds:   16.06e9 / (3.35e12 * 0.85),
	KVBytesPerBlock:     2 << 20,
	PCIeBytesPerSecond:  64e9,
	RedisBytesPerSecond: 10e9,
	RedisRTTSeconds:     0.5e-3,
	HBMBytesPerSecond:   3.35e12 * 0.85,
	MaxBatchedTokens:    8192,
}

// Coefficients of the prefill FLOPs: a·n·(n+c)·d + b·n·d² per layer.
const (
	attnCoeff   = 4
	linearCoeff = 22
)

// PrefillSeconds is the compute time of prefilling n new tokens over c
// tokens already cached: layers·(4·n·(n+c)·hidden + 22·n·hidden²)/flops.
func (c Cost) PrefillSeconds(n, cached int) float64 {
	if n <= 0 || c.FLOPS <= 0 {
		return 0
	}
	nf, cf, d := float64(n), float64(max(cached, 0)), float64(c.Hidden)
	return float64(c.Layers) * (attnCoeff*nf*(nf+cf)*d + linearCoeff*nf*d*d) / c.FLOPS
}

// QueueSeconds is the time to prefill tokens queued ahead of a request
// whose own prompt has promptTokens tokens. The queued tokens belong to
// prompts whose lengths the scheduler does not know; their attention term
// is counted as if they were as long as this one (capped by the queue):
// exact for a burst of similar requests, the case where queues form, and
// far closer than the linear term alone, which for 8,000-token prompts on
// 8B-class models leaves out a quarter of the time.
func (c Cost) QueueSeconds(tokens int64, promptTokens int) float64 {
	if tokens <= 0 || c.FLOPS <= 0 {
		return 0
	}
	q, d := float64(tokens), float64(c.Hidden)
	l := min(float64(max(promptTokens, 0)), q)
	return float64(c.Layers) * (linearCoeff*q*d*d + attnCoeff*q*l*d) / c.FLOPS
}

// CPUCopySeconds is the time to copy blocks from the CPU tier to the GPU.
func (c Cost) CPUCopySeconds(blocks int) float64 {
	if blocks <= 0 || c.PCIeBytesPerSecond <= 0 {
		return 0
	}
	return float64(blocks) * float64(c.KVBytesPerBlock) / c.PCIeBytesPerSecond
}

// RedisFetchSeconds is the time to fetch blocks from the Redis tier: one
// round trip (the worker fetches them pipelined) plus their bytes.
func (c Cost) RedisFetchSeconds(blocks int) float64 {
	if blocks <= 0 || c.RedisBytesPerSecond <= 0 {
		return 0
	}
	return c.RedisRTTSeconds + float64(blocks)*float64(c.KVBytesPerBlock)/c.RedisBytesPerSecond
}

// StepSeconds is the time one step of the worker spends beyond its
// prefill compute: reading the weights (DecodeStepSeconds) and the KV of
// the sequences it holds, usedBlocks blocks, which it decodes alongside.
func (c Cost) StepSeconds(usedBlocks int64) float64 {
	s := c.DecodeStepSeconds
	if usedBlocks > 0 && c.HBMBytesPerSecond > 0 {
		s += float64(usedBlocks) * float64(c.KVBytesPerBlock) / c.HBMBytesPerSecond
	}
	return s
}

// Steps is the number of steps a worker running running sequences takes
// to prefill tokens tokens (the request's own and those queued ahead of
// it): each step's budget less one token per running sequence goes to
// prefill, but never less than a quarter of the budget (a worker that
// full admits nothing new until some sequences finish, which the queue
// term of the estimate does not see either). At least 1.
func (c Cost) Steps(tokens int64, running int) int64 {
	budget := int64(c.MaxBatchedTokens)
	if budget <= 0 {
		budget = int64(DefaultCost.MaxBatchedTokens)
	}
	per := max(budget-int64(max(running, 0)), budget/4, 1)
	return max((tokens+per-1)/per, 1)
}

// costFrom converts p, filling every zero or missing figure from
// DefaultCost; ok reports whether p was present.
func costFrom(p *workerpb.CostParams) (c Cost, ok bool) {
	c = DefaultCost
	if p == nil {
		return c, false
	}
	if p.Layers > 0 {
		c.Layers = int(p.Layers)
	}
	if p.Hidden > 0 {
		c.Hidden = int(p.Hidden)
	}
	if p.Flops > 0 {
		c.FLOPS = p.Flops
	}
	if p.DecodeStepSeconds > 0 {
		c.DecodeStepSeconds = p.DecodeStepSeconds
	}
	if p.KvBytesPerBlock > 0 {
		c.KVBytesPerBlock = p.KvBytesPerBlock
	}
	if p.PcieBytesPerSecond > 0 {
		c.PCIeBytesPerSecond = p.PcieBytesPerSecond
	}
	if p.RedisBytesPerSecond > 0 {
		c.RedisBytesPerSecond = p.RedisBytesPerSecond
	}
	if p.RedisRttSeconds > 0 {
		c.RedisRTTSeconds = p.RedisRttSeconds
	}
	if p.HbmBytesPerSecond > 0 {
		c.HBMBytesPerSecond = p.HbmBytesPerSecond
	}
	if p.MaxBatchedTokens > 0 {
		c.MaxBatchedTokens = int(p.MaxBatchedTokens)
	}
	return c, true
}
