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
}

// DefaultCost is the cost assumed for workers that report none (OpenAI
// compatible HTTP engines, or a baton worker before its Info arrives):
// Llama-3.1-8B in BF16 on one H100, as the simulated engine's defaults
// model it — 32 layers, hidden size 4,096, 989 TFLOP/s × 0.5 MFU, a 5.6 ms
// decode step (16 GB of weights at 3.35 TB/s × 0.85), 2 MiB of KV per
// 16-token block, a PCIe 5 x16 host copy at 64 GB/s, and a Redis tier at
// 10 GB/s (a 100 Gb/s NIC) with 0.5 ms round trips. At these figures a
// block fetched from Redis (0.21 ms) beats recomputing it (0.38 ms).
var DefaultCost = Cost{
	Layers:              32,
	Hidden:              4096,
	FLOPS:               989e12 * 0.5,
	DecodeStepSeconds:   16.06e9 / (3.35e12 * 0.85),
	KVBytesPerBlock:     2 << 20,
	PCIeBytesPerSecond:  64e9,
	RedisBytesPerSecond: 10e9,
	RedisRTTSeconds:     0.5e-3,
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

// QueueSeconds is the time to prefill tokens queued ahead of a request.
// Queued tokens belong to several prompts whose lengths are unknown, so it
// counts the linear (projection and MLP) term only; for prompts of a few
// thousand tokens on 8B-class models attention adds under a quarter.
func (c Cost) QueueSeconds(tokens int64) float64 {
	if tokens <= 0 || c.FLOPS <= 0 {
		return 0
	}
	d := float64(c.Hidden)
	return float64(c.Layers) * linearCoeff * float64(tokens) * d * d / c.FLOPS
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
	return c, true
}
