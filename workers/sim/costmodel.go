// Cost model of the simulated engine.
//
// Prefill is compute-bound. Following Mooncake (Qin et al., 2024), the
// FLOPs of prefilling n tokens of a decoder with l layers and hidden size d
// are l·(a·n²·d + b·n·d²) with a = 4 (attention scores and values) and
// b = 22 (projections and MLP). With prefix caching, the n new tokens also
// attend to the c tokens already in the KV cache, so the attention term
// becomes a·n·(n+c)·d:
//
//	flops(n, c) = l · (a·n·(n+c)·d + b·n·d²)
//	prefill(n, c) = flops(n, c) / (peak FLOP/s × TP × MFU)
//
// The peak is the GPU's dense BF16 or FP8 figure, matching the precision of
// the model's weights. Decode is memory-bound: each step reads every weight
// once plus the KV cache of every running sequence,
//
//	decode(batch, ctx) = max((weights + ctx·kv) / (HBM × TP × eff),
//	                         batch · 2 · params / (peak × TP × MFU))
//
// where ctx is the context length summed over the batch and kv the KV bytes
// per token (layers × KV heads × head dim × 2 for K and V × 2 bytes). The
// compute term only binds at large batches (roofline). A step that also
// prefills adds the prefill time to the decode time. Tensor-parallel
// communication is not modelled.
//
// Comparison with published figures (go test -run TestPublishedFigures -v):
//
//   - NVIDIA NIM, Llama-3.3-70B FP8 on 2×H100, 5,000 input tokens,
//     concurrency 1: TTFT 407 ms published; this model gives 344 ms
//     (12 ms of weight reads + 332 ms of prefill), 15% under: the published
//     figure includes HTTP, tokenization and scheduling overheads.
//   - Llama-3.1-8B BF16 on 1×H100, concurrency 1: inter-token latency about
//     4.6 ms published; this model gives 5.7 ms (16 GB of weights at
//     3.35 TB/s × 0.85), 24% over. 4.6 ms would need more than the peak
//     HBM bandwidth for BF16 weights, so the published run most likely used
//     FP8 weights (this model gives 2.9 ms for those).
//
// Bandwidth efficiency defaults to 0.85: decode GEMV kernels and memory
// copies reach about 85-90% of the H100's peak HBM bandwidth in practice.

package sim

import (
	"errors"
	"fmt"
	"sort"
)

// Model describes the geometry of a decoder-only transformer.
type Model struct {
	Name    string
	Layers  int
	Hidden  int // hidden size d
	Heads   int // attention (query) heads
	KVHeads int // key/value heads (grouped-query attention)
	HeadDim int
	Params  float64 // parameter count
	// WeightBytes is the size of one parameter as served: 2 for BF16,
	// 1 for FP8. It also picks the GPU's peak FLOP/s.
	WeightBytes int
}

// GPU describes one accelerator.
type GPU struct {
	Name string
	// Dense (not sparse) peak throughput, FLOP/s.
	BF16FLOPS float64
	FP8FLOPS  float64
	// HBMBandwidth is the peak memory bandwidth, bytes/s.
	HBMBandwidth float64
	// MemoryBytes is the device memory as the driver reports it.
	MemoryBytes float64
	// PCIeBandwidth is the host link's bandwidth each way, bytes/s: what a
	// CPU-tier block copy back to the GPU crosses.
	PCIeBandwidth float64
}

// Models are the model presets, by name.
var Models = map[string]Model{
	"llama-3.1-8b": {
		Name: "llama-3.1-8b", Layers: 32, Hidden: 4096, Heads: 32, KVHeads: 8,
		HeadDim: 128, Params: 8.03e9, WeightBytes: 2,
	},
	"llama-3.1-70b": {
		Name: "llama-3.1-70b", Layers: 80, Hidden: 8192, Heads: 64, KVHeads: 8,
		HeadDim: 128, Params: 70.55e9, WeightBytes: 1,
	},
}

// GPUs are the GPU presets (SXM parts), by name.
var GPUs = map[string]GPU{
	// H100 SXM5 80 GB: 81,559 MiB as reported by the driver.
	"h100": {Name: "h100", BF16FLOPS: 989.4e12, FP8FLOPS: 1978.9e12,
		HBMBandwidth: 3.35e12, MemoryBytes: 81559 << 20, PCIeBandwidth: pcieGen5x16},
	// H200 SXM 141 GB: 143,771 MiB as reported by the driver.
	"h200": {Name: "h200", BF16FLOPS: 989.4e12, FP8FLOPS: 1978.9e12,
		HBMBandwidth: 4.8e12, MemoryBytes: 143771 << 20, PCIeBandwidth: pcieGen5x16},
}

// pcieGen5x16 is a PCIe Gen5 x16 link, each way: 64 GB/s (H100 and H200
// SXM both attach to the host over one).
const pcieGen5x16 = 64e9

// ErrUnknownPreset is returned (wrapped) for a model or GPU name that has
// no preset.
var ErrUnknownPreset = errors.New("unknown preset")

// LookupModel returns the model preset called name.
func LookupModel(name string) (Model, error) {
	m, ok := Models[name]
	if !ok {
		return Model{}, fmt.Errorf("model %q (have %v): %w", name, keys(Models), ErrUnknownPreset)
	}
	return m, nil
}

// LookupGPU returns the GPU preset called name.
func LookupGPU(name string) (GPU, error) {
	g, ok := GPUs[name]
	if !ok {
		return GPU{}, fmt.Errorf("gpu %q (have %v): %w", name, keys(GPUs), ErrUnknownPreset)
	}
	return g, nil
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// Mooncake's prefill FLOP coefficients.
const (
	attnCoeff   = 4
	linearCoeff = 22
)

// Defaults of a CostModel's efficiencies.
const (
	DefaultMFU                 = 0.5
	DefaultBandwidthEfficiency = 0.85
	DefaultMemoryUtilization   = 0.9 // vLLM's gpu_memory_utilization
)

// CostModel turns work into modelled seconds for one model served on TP
// GPUs. Its methods are pure and safe for concurrent use.
type CostModel struct {
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

// NewCostModel returns the cost model of the named presets on tp GPUs with
// default efficiencies.
func NewCostModel(model, gpu string, tp int) (CostModel, error) {
	m, err := LookupModel(model)
	if err != nil {
		return CostModel{}, err
	}
	g, err := LookupGPU(gpu)
	if err != nil {
		return CostModel{}, err
	}
	c := CostModel{Model: m, GPU: g, TP: tp, MFU: DefaultMFU,
		BandwidthEfficiency: DefaultBandwidthEfficiency, MemoryUtilization: DefaultMemoryUtilization}
	return c, c.Validate()
}

// Validate reports a cost model that cannot serve: bad efficiencies or
// weights that do not fit in memory.
func (c CostModel) Validate() error {
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
	case c.BlockCapacity(16) <= 0:
		return fmt.Errorf("tp %d: %s weights (%.1f GB) leave no KV memory on %d×%s",
			c.TP, c.Model.Name, c.WeightBytes()/1e9, c.TP, c.GPU.Name)
	}
	return nil
}

func (c CostModel) peakFLOPS() float64 {
	if c.Model.WeightBytes == 1 {
		return c.GPU.FP8FLOPS
	}
	return c.GPU.BF16FLOPS
}

// FLOPS is the effective compute throughput of the TP group, FLOP/s.
func (c CostModel) FLOPS() float64 { return c.peakFLOPS() * float64(c.TP) * c.MFU }

// Bandwidth is the effective HBM bandwidth of the TP group, bytes/s.
func (c CostModel) Bandwidth() float64 {
	return c.GPU.HBMBandwidth * float64(c.TP) * c.BandwidthEfficiency
}

// WeightBytes is the size of all weights (split over the TP GPUs).
func (c CostModel) WeightBytes() float64 { return c.Model.Params * float64(c.Model.WeightBytes) }

// KVBytesPerToken is the KV cache size of one token: layers × KV heads ×
// head dim × 2 (K and V) × 2 bytes (BF16 cache). 131,072 for Llama-3.1-8B.
func (c CostModel) KVBytesPerToken() int64 {
	m := c.Model
	return int64(m.Layers) * int64(m.KVHeads) * int64(m.HeadDim) * 2 * 2
}

// KVBytesPerBlock is the KV cache size of one block of BlockTokens tokens:
// 2 MiB for Llama-3.1-8B.
func (c CostModel) KVBytesPerBlock() int64 { return c.KVBytesPerToken() * BlockTokens }

// PrefillFLOPs is flops(n, c) = l·(a·n·(n+c)·d + b·n·d²) for n new tokens
// over c cached ones.
func (c CostModel) PrefillFLOPs(newTokens, cachedTokens int) float64 {
	if newTokens <= 0 {
		return 0
	}
	n, ctx, d := float64(newTokens), float64(max(cachedTokens, 0)), float64(c.Model.Hidden)
	return float64(c.Model.Layers) * (attnCoeff*n*(n+ctx)*d + linearCoeff*n*d*d)
}

// PrefillSeconds is the compute time of prefilling newTokens tokens over
// cachedTokens tokens already in the KV cache.
func (c CostModel) PrefillSeconds(newTokens, cachedTokens int) float64 {
	return c.PrefillFLOPs(newTokens, cachedTokens) / c.FLOPS()
}

// DecodeStepSeconds is the time of one decode step generating one token
// for each of batch sequences whose contexts sum to contextTokens: reading
// the weights and their KV cache, or the step's matmul compute if that is
// longer. With batch 0 it is the cost of reading the weights once, which
// every step pays.
func (c CostModel) DecodeStepSeconds(batch, contextTokens int) float64 {
	bytes := c.WeightBytes() + float64(max(contextTokens, 0))*float64(c.KVBytesPerToken())
	mem := bytes / c.Bandwidth()
	compute := float64(max(batch, 0)) * 2 * c.Model.Params / c.FLOPS()
	return max(mem, compute)
}

// BlockCapacity is the number of KV blocks of blockTokens tokens that fit
// in the TP group's memory: (memory × utilization − weights) over the KV
// bytes of a block. It is at most 0 when the weights do not fit.
func (c CostModel) BlockCapacity(blockTokens int) int64 {
	free := c.GPU.MemoryBytes*float64(c.TP)*c.MemoryUtilization - c.WeightBytes()
	per := float64(c.KVBytesPerToken()) * float64(blockTokens)
	if per <= 0 {
		return 0
	}
	return int64(free / per)
}
