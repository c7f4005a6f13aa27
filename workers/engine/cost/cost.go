// Package cost is baton's one cost model: the modelled seconds an engine
// spends prefilling, decoding and moving KV blocks. The simulated engine
// charges its steps with an Engine; kv_aware estimates time to first token
// with the same formulas over the Figures a worker reports.
//
// Prefill is compute-bound. Following Mooncake (Qin et al., 2024), n new
// tokens over c cached ones cost l·(a·n·(n+c)·d + b·n·d²) FLOPs for l
// layers of hidden size d, a = 4 (attention) and b = 22 (projections and
// MLP), at peak FLOP/s × TP × MFU. Decode is memory-bound: a step reads the
// weights and the running sequences' KV at HBM bandwidth × TP × efficiency,
// unless its matmuls take longer. Tensor-parallel communication is not
// modelled. docs/simulated-engine.md compares the presets with published figures.
package cost

import (
	"fmt"

	"github.com/batonllm/baton/transfer/blockkey"
)

// BlockTokens is the number of tokens in one KV block.
const BlockTokens = blockkey.DefaultBlockChars / blockkey.CharsPerToken

// Mooncake's prefill FLOP coefficients.
const (
	attnCoeff   = 4
	linearCoeff = 22
)

// Defaults of an Engine's efficiencies.
const (
	DefaultMFU = 0.5
	// DefaultBandwidthEfficiency: decode GEMV kernels and memory copies
	// reach about 85-90% of the H100's peak HBM bandwidth in practice.
	DefaultBandwidthEfficiency = 0.85
	DefaultMemoryUtilization   = 0.9 // vLLM's gpu_memory_utilization
)

// prefillFLOPs is l·(a·n·(n+c)·d + b·n·d²) for n new tokens over c cached.
func prefillFLOPs(layers, hidden, newTokens, cachedTokens int) float64 {
	if newTokens <= 0 {
		return 0
	}
	n, ctx, d := float64(newTokens), float64(max(cachedTokens, 0)), float64(hidden)
	return float64(layers) * (attnCoeff*n*(n+ctx)*d + linearCoeff*n*d*d)
}

// Engine is the cost model of one model served on TP GPUs. Its methods
// are pure and safe for concurrent use.
type Engine struct {
	Model Model
	GPU   GPU
	// TP is the tensor-parallel degree: FLOP/s, bandwidth and memory scale
	// by TP, weights are split across the TP GPUs.
	TP int
	// MFU is the fraction of peak FLOP/s prefill achieves.
	MFU float64
	// BandwidthEfficiency is the fraction of peak HBM bandwidth decode
	// achieves.
	BandwidthEfficiency float64
	// MemoryUtilization is the fraction of GPU memory the engine may use
	// for weights and KV cache.
	MemoryUtilization float64
}

// NewEngine returns the cost model of the named presets on tp GPUs with
// default efficiencies.
func NewEngine(model, gpu string, tp int) (Engine, error) {
	m, err := LookupModel(model)
	if err != nil {
		return Engine{}, err
	}
	g, err := LookupGPU(gpu)
	if err != nil {
		return Engine{}, err
	}
	c := Engine{Model: m, GPU: g, TP: tp, MFU: DefaultMFU,
		BandwidthEfficiency: DefaultBandwidthEfficiency, MemoryUtilization: DefaultMemoryUtilization}
	return c, c.Validate()
}

// Validate reports a cost model that cannot serve: bad efficiencies or
// weights that do not fit in memory.
func (c Engine) Validate() error {
	switch {
	case c.TP < 1:
		return fmt.Errorf("tp %d: must be at least 1", c.TP)
	case c.MFU <= 0 || c.MFU > 1:
		return fmt.Errorf("mfu %v: must be in (0, 1]", c.MFU)
	case c.BandwidthEfficiency <= 0 || c.BandwidthEfficiency > 1:
		return fmt.Errorf("bandwidth efficiency %v: must be in (0, 1]", c.BandwidthEfficiency)
	case c.MemoryUtilization <= 0 || c.MemoryUtilization > 1:
		return fmt.Errorf("memory utilization %v: must be in (0, 1]", c.MemoryUtilization)
	case c.KVBytesPerToken() <= 0 || c.Model.Hidden <= 0 || c.Model.Params <= 0:
		return fmt.Errorf("model %q: incomplete geometry", c.Model.Name)
	case c.peakFLOPS() <= 0 || c.GPU.HBMBandwidth <= 0:
		return fmt.Errorf("gpu %q: incomplete figures", c.GPU.Name)
	case c.BlockCapacity(BlockTokens) <= 0:
		return fmt.Errorf("tp %d: %s weights (%.1f GB) leave no KV memory on %d×%s",
			c.TP, c.Model.Name, c.WeightBytes()/1e9, c.TP, c.GPU.Name)
	}
	return nil
}

func (c Engine) peakFLOPS() float64 {
	if c.Model.WeightBytes == 1 {
		return c.GPU.FP8FLOPS
	}
	return c.GPU.BF16FLOPS
}

// FLOPS is the effective compute throughput of the TP group, FLOP/s.
func (c Engine) FLOPS() float64 { return c.peakFLOPS() * float64(c.TP) * c.MFU }

// Bandwidth is the effective HBM bandwidth of the TP group, bytes/s.
func (c Engine) Bandwidth() float64 {
	return c.GPU.HBMBandwidth * float64(c.TP) * c.BandwidthEfficiency
}

// WeightBytes is the size of all weights (split over the TP GPUs).
func (c Engine) WeightBytes() float64 { return c.Model.Params * float64(c.Model.WeightBytes) }

// KVBytesPerToken is the KV cache size of one token: layers × KV heads ×
// head dim × 2 (K and V) × 2 bytes (BF16 cache).
func (c Engine) KVBytesPerToken() int64 {
	m := c.Model
	return int64(m.Layers) * int64(m.KVHeads) * int64(m.HeadDim) * 2 * 2
}

// KVBytesPerBlock is the KV cache size of one block of BlockTokens tokens.
func (c Engine) KVBytesPerBlock() int64 { return c.KVBytesPerToken() * BlockTokens }

// PrefillFLOPs is the compute of prefilling newTokens tokens over
// cachedTokens tokens already in the KV cache.
func (c Engine) PrefillFLOPs(newTokens, cachedTokens int) float64 {
	return prefillFLOPs(c.Model.Layers, c.Model.Hidden, newTokens, cachedTokens)
}

// PrefillSeconds is the compute time of prefilling newTokens tokens over
// cachedTokens tokens already in the KV cache.
func (c Engine) PrefillSeconds(newTokens, cachedTokens int) float64 {
	return c.PrefillFLOPs(newTokens, cachedTokens) / c.FLOPS()
}

// DecodeStepSeconds is the time of one step decoding one token for each
// of batch sequences whose contexts sum to contextTokens: reading the
// weights and that KV, or the step's matmuls if they take longer. Every
// step pays it (batch 0: the weights alone); a step that also prefills
// adds PrefillSeconds.
func (c Engine) DecodeStepSeconds(batch, contextTokens int) float64 {
	bytes := c.WeightBytes() + float64(max(contextTokens, 0))*float64(c.KVBytesPerToken())
	mem := bytes / c.Bandwidth()
	compute := float64(max(batch, 0)) * 2 * c.Model.Params / c.FLOPS()
	return max(mem, compute)
}

// BlockCapacity is the number of KV blocks of blockTokens tokens that fit
// in the TP group's memory: (memory × utilization − weights) over the KV
// bytes of a block. It is at most 0 when the weights do not fit.
func (c Engine) BlockCapacity(blockTokens int) int64 {
	free := c.GPU.MemoryBytes*float64(c.TP)*c.MemoryUtilization - c.WeightBytes()
	per := float64(c.KVBytesPerToken()) * float64(blockTokens)
	if per <= 0 {
		return 0
	}
	return int64(free / per)
}

// Figures returns the figures of c a worker reports, in modelled seconds:
// PCIe at the GPU's link × TP, and no Redis tier nor step budget (the
// engine's configuration sets those).
func (c Engine) Figures() Figures {
	return Figures{
		Layers:             c.Model.Layers,
		Hidden:             c.Model.Hidden,
		FLOPS:              c.FLOPS(),
		DecodeStepSeconds:  c.DecodeStepSeconds(1, 0),
		KVBytesPerBlock:    c.KVBytesPerBlock(),
		PCIeBytesPerSecond: c.GPU.PCIeBandwidth * float64(c.TP),
		HBMBytesPerSecond:  c.Bandwidth(),
	}
}
