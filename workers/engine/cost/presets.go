package cost

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

// The presets a zero configuration means.
const (
	DefaultModel = "llama-3.1-8b"
	DefaultGPU   = "h100"
)

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
