package cost

import (
	"time"

	"github.com/batonllm/baton/proto/workerpb"
)

// Defaults of a worker's configuration that its Figures carry.
const (
	// DefaultRedisBandwidth is the bandwidth of fetches from the shared
	// Redis tier, bytes/s: 10 GB/s, about a 100 Gb/s NIC.
	DefaultRedisBandwidth = 10e9
	// DefaultRedisRTT is the fixed time of one round trip to the shared
	// tier (one batched fetch).
	DefaultRedisRTT = 500 * time.Microsecond
	// DefaultMaxBatchedTokens is a step's token budget (vLLM's default).
	DefaultMaxBatchedTokens = 8192
)

// Figures are what a worker reports of its cost model (workerpb.CostParams),
// from which kv_aware estimates time to first token. The simulated engine
// charges the same: for a prefill step, PrefillSeconds plus StepSeconds of
// the KV it decodes alongside. The methods that estimate take a pointer:
// kv_aware calls them for every worker of a decision, and copying the
// figures for each call cost more than the arithmetic.
type Figures struct {
	Layers, Hidden int
	// FLOPS is the effective compute throughput, FLOP/s.
	FLOPS float64
	// DecodeStepSeconds is one decode step at batch 1, short context.
	DecodeStepSeconds float64
	// KVBytesPerBlock is the size of one block's KV (BlockTokens tokens).
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

// DefaultFigures are the simulated engine's with its default
// configuration: DefaultModel on one DefaultGPU, at time scale 1. kv_aware
// assumes them for workers that report none.
var DefaultFigures = defaultFigures()

func defaultFigures() Figures {
	f := Engine{Model: Models[DefaultModel], GPU: GPUs[DefaultGPU], TP: 1, MFU: DefaultMFU,
		BandwidthEfficiency: DefaultBandwidthEfficiency, MemoryUtilization: DefaultMemoryUtilization}.Figures()
	f.RedisBytesPerSecond = DefaultRedisBandwidth
	f.RedisRTTSeconds = DefaultRedisRTT.Seconds()
	f.MaxBatchedTokens = DefaultMaxBatchedTokens
	return f
}

// PrefillSeconds is the compute time of prefilling n new tokens over c
// tokens already cached.
func (c *Figures) PrefillSeconds(n, cached int) float64 {
	if n <= 0 || c.FLOPS <= 0 {
		return 0
	}
	return prefillFLOPs(c.Layers, c.Hidden, n, cached) / c.FLOPS
}

// QueueSeconds is the time to prefill tokens queued ahead of a request
// whose own prompt has promptTokens tokens. The queued prompts' lengths
// are unknown; their attention term counts them as long as this one
// (capped by the queue): exact for a burst of similar requests, the case
// where queues form.
func (c *Figures) QueueSeconds(tokens int64, promptTokens int) float64 {
	if tokens <= 0 || c.FLOPS <= 0 {
		return 0
	}
	q, d := float64(tokens), float64(c.Hidden)
	l := min(float64(max(promptTokens, 0)), q)
	return float64(c.Layers) * (linearCoeff*q*d*d + attnCoeff*q*l*d) / c.FLOPS
}

// CPUCopySeconds is the time to copy blocks from the CPU tier to the GPU.
func (c *Figures) CPUCopySeconds(blocks int) float64 {
	if blocks <= 0 || c.PCIeBytesPerSecond <= 0 {
		return 0
	}
	return float64(blocks) * float64(c.KVBytesPerBlock) / c.PCIeBytesPerSecond
}

// RedisFetchSeconds is the time to fetch blocks from the Redis tier: one
// round trip (the worker fetches them pipelined) plus their bytes.
func (c *Figures) RedisFetchSeconds(blocks int) float64 {
	if blocks <= 0 || c.RedisBytesPerSecond <= 0 {
		return 0
	}
	return c.RedisRTTSeconds + float64(blocks)*float64(c.KVBytesPerBlock)/c.RedisBytesPerSecond
}

// StepSeconds is the time one step spends beyond its prefill compute:
// reading the weights (DecodeStepSeconds) and the KV of usedBlocks
// blocks, the sequences it decodes alongside.
func (c *Figures) StepSeconds(usedBlocks int64) float64 {
	s := c.DecodeStepSeconds
	if usedBlocks > 0 && c.HBMBytesPerSecond > 0 {
		s += float64(usedBlocks) * float64(c.KVBytesPerBlock) / c.HBMBytesPerSecond
	}
	return s
}

// Steps is the number of steps a worker running running sequences takes
// to prefill tokens tokens: each step's budget less one token per running
// sequence goes to prefill, but never less than a quarter of the budget (a
// worker that full admits nothing new until some sequences finish, which
// the queue term of an estimate does not see either). At least 1.
func (c *Figures) Steps(tokens int64, running int) int64 {
	budget := int64(c.MaxBatchedTokens)
	if budget <= 0 {
		budget = DefaultMaxBatchedTokens
	}
	per := max(budget-int64(max(running, 0)), budget/4, 1)
	return max((tokens+per-1)/per, 1)
}

// Scaled returns c in real seconds for a worker whose modelled clock runs
// timeScale times faster than real time: rates × timeScale, times ÷
// timeScale.
func (c Figures) Scaled(timeScale float64) Figures {
	c.FLOPS *= timeScale
	c.DecodeStepSeconds /= timeScale
	c.PCIeBytesPerSecond *= timeScale
	c.RedisBytesPerSecond *= timeScale
	c.RedisRTTSeconds /= timeScale
	c.HBMBytesPerSecond *= timeScale
	return c
}

// Proto returns c as a worker reports it in Info.
func (c Figures) Proto() *workerpb.CostParams {
	return &workerpb.CostParams{
		Layers:              int32(c.Layers),
		Hidden:              int32(c.Hidden),
		Flops:               c.FLOPS,
		DecodeStepSeconds:   c.DecodeStepSeconds,
		KvBytesPerBlock:     c.KVBytesPerBlock,
		PcieBytesPerSecond:  c.PCIeBytesPerSecond,
		RedisBytesPerSecond: c.RedisBytesPerSecond,
		RedisRttSeconds:     c.RedisRTTSeconds,
		HbmBytesPerSecond:   c.HBMBytesPerSecond,
		MaxBatchedTokens:    int32(c.MaxBatchedTokens),
	}
}

// FromProto converts p, filling every zero or missing figure from
// DefaultFigures; ok reports whether p was present.
func FromProto(p *workerpb.CostParams) (c Figures, ok bool) {
	c = DefaultFigures
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
