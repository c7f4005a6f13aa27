package sim

import (
	"errors"
	"fmt"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer/kvblock"
)

// Roles of a worker in disaggregated serving (Config.Role).
const (
	// RoleBoth serves Generate, Prefill and Decode: colocated serving, and
	// either side of a disaggregated one.
	RoleBoth = "both"
	// RolePrefill serves Prefill (and Generate, as a colocated fallback).
	RolePrefill = "prefill"
	// RoleDecode serves Decode and Generate.
	RoleDecode = "decode"
)

// DefaultLinkBandwidth is the default modelled bandwidth of the link KV
// blocks cross between workers, bytes/s: 50 GB/s, about a 400 Gb/s RDMA
// NIC.
const DefaultLinkBandwidth = 50e9

// DefaultTransferTimeout is how long Decode waits for a transfer by
// default.
const DefaultTransferTimeout = 5 * time.Second

// Config configures an Engine. The zero value of every field means its
// default; DefaultConfig spells them out.
type Config struct {
	// Name is the worker's name in the fleet. Default "sim".
	Name string
	// Models are the model names the engine serves (requests for any
	// other model fail). Default: Model alone.
	Models []string
	// Model is the model preset whose cost is modelled (see Models map).
	// Default "llama-3.1-8b".
	Model string
	// GPU is the GPU preset. Default "h100".
	GPU string
	// TP is the tensor-parallel degree. Default 1.
	TP int
	// MFU is the fraction of peak FLOP/s prefill reaches. Default 0.5.
	MFU float64
	// BandwidthEfficiency is the fraction of peak HBM bandwidth decode
	// reaches. Default 0.85.
	BandwidthEfficiency float64
	// TimeScale makes the modelled clock run TimeScale times faster than
	// real time: a modelled 400 ms step sleeps 400/TimeScale ms. Default 1.
	TimeScale float64
	// BlockCapacity overrides the GPU KV capacity in blocks of 16 tokens.
	// Default: from the cost model (memory × 0.9 − weights).
	BlockCapacity int64
	// MaxRunning bounds the sequences in the running batch. Default 256,
	// vLLM's max_num_seqs.
	MaxRunning int
	// MaxBatchedTokens is the token budget of one step (decode tokens plus
	// prefill chunks; longer prompts are prefilled in chunks over several
	// steps). Default 8192, vLLM's chunked-prefill default.
	MaxBatchedTokens int
	// DefaultMaxTokens bounds completions of requests that set no
	// max_tokens. Default 1024.
	DefaultMaxTokens int
	// LoadInterval is how often, in real time, Watch subscribers get a
	// load report when the load changed. Default 100 ms.
	LoadInterval time.Duration
	// WatchBuffer is the event buffer of each Watch subscriber; one that
	// falls further behind is dropped and must resubscribe. Default 4096:
	// several seconds of events at a few cache events per step.
	WatchBuffer int

	// Role is the worker's role in disaggregated serving: RoleBoth
	// (default), RolePrefill or RoleDecode. Info reports it; Prefill is
	// served by prefill and both workers, Decode by decode and both
	// workers, Generate by all.
	Role string
	// KVScale divides real KV sizes into the payload bytes of a block that
	// transfers move: kvblock.Size(KVBytesPerToken, BlockTokens, KVScale).
	// Default kvblock.DefaultScale (a Llama-3.1-8B block of 2 MiB moves as
	// 32 KiB); 1 moves real sizes.
	KVScale int
	// TransferTimeout is how long Decode waits for its transfer when the
	// request sets no timeout. Default DefaultTransferTimeout.
	TransferTimeout time.Duration
	// LinkBandwidth is the modelled bandwidth, in bytes/s, of the link a
	// prefill worker pushes KV blocks over. Each push first sleeps
	// blocks × KVBytesPerToken × BlockTokens / LinkBandwidth / TimeScale:
	// the transfer time of the REAL (unscaled) KV bytes, on the modelled
	// clock, on top of the time the scaled payload takes to move over the
	// actual network. Default DefaultLinkBandwidth; negative models an
	// infinitely fast link (no sleep).
	LinkBandwidth float64
}

// DefaultConfig returns the configuration the zero Config stands for.
func DefaultConfig() Config {
	return Config{}.WithDefaults()
}

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.Name == "" {
		c.Name = "sim"
	}
	if c.Model == "" {
		c.Model = "llama-3.1-8b"
	}
	if len(c.Models) == 0 {
		c.Models = []string{c.Model}
	}
	if c.GPU == "" {
		c.GPU = "h100"
	}
	if c.TP == 0 {
		c.TP = 1
	}
	if c.MFU == 0 {
		c.MFU = DefaultMFU
	}
	if c.BandwidthEfficiency == 0 {
		c.BandwidthEfficiency = DefaultBandwidthEfficiency
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = 256
	}
	if c.MaxBatchedTokens == 0 {
		c.MaxBatchedTokens = 8192
	}
	if c.DefaultMaxTokens == 0 {
		c.DefaultMaxTokens = 1024
	}
	if c.LoadInterval == 0 {
		c.LoadInterval = 100 * time.Millisecond
	}
	if c.WatchBuffer == 0 {
		c.WatchBuffer = 4096
	}
	if c.Role == "" {
		c.Role = RoleBoth
	}
	if c.KVScale == 0 {
		c.KVScale = kvblock.DefaultScale
	}
	if c.TransferTimeout == 0 {
		c.TransferTimeout = DefaultTransferTimeout
	}
	if c.LinkBandwidth == 0 {
		c.LinkBandwidth = DefaultLinkBandwidth
	}
	return c
}

// Validate reports the first invalid field of c (defaults applied first),
// naming it.
func (c Config) Validate() error {
	c = c.WithDefaults()
	seen := make(map[string]bool, len(c.Models))
	for _, m := range c.Models {
		if m == "" {
			return errors.New("models: empty model name")
		}
		if seen[m] {
			return fmt.Errorf("models: %q listed twice", m)
		}
		seen[m] = true
	}
	switch {
	case c.TP < 1:
		return fmt.Errorf("tp: %d is below 1", c.TP)
	case c.MFU < 0 || c.MFU > 1:
		return fmt.Errorf("mfu: %v is outside (0, 1]", c.MFU)
	case c.BandwidthEfficiency < 0 || c.BandwidthEfficiency > 1:
		return fmt.Errorf("bandwidth_efficiency: %v is outside (0, 1]", c.BandwidthEfficiency)
	case !(c.TimeScale > 0): // also rejects NaN
		return fmt.Errorf("time_scale: %v must be positive", c.TimeScale)
	case c.BlockCapacity < 0:
		return fmt.Errorf("block_capacity: %d is negative", c.BlockCapacity)
	case c.MaxRunning < 1:
		return fmt.Errorf("max_running: %d is below 1", c.MaxRunning)
	case c.MaxBatchedTokens < 1:
		return fmt.Errorf("max_batched_tokens: %d is below 1", c.MaxBatchedTokens)
	case c.DefaultMaxTokens < 1:
		return fmt.Errorf("default_max_tokens: %d is below 1", c.DefaultMaxTokens)
	case c.LoadInterval < 0:
		return fmt.Errorf("load_interval: %v is negative", c.LoadInterval)
	case c.WatchBuffer < 2:
		return fmt.Errorf("watch_buffer: %d is below 2", c.WatchBuffer)
	case c.Role != RoleBoth && c.Role != RolePrefill && c.Role != RoleDecode:
		return fmt.Errorf("role: %q is not %s, %s or %s", c.Role, RoleBoth, RolePrefill, RoleDecode)
	case c.KVScale < 1:
		return fmt.Errorf("kv_scale: %d is below 1", c.KVScale)
	case c.TransferTimeout < 0:
		return fmt.Errorf("transfer_timeout: %v is negative", c.TransferTimeout)
	case c.LinkBandwidth != c.LinkBandwidth: // NaN
		return fmt.Errorf("link_bandwidth: %v is not a number", c.LinkBandwidth)
	}
	cm, err := c.costModel()
	if err != nil {
		return err
	}
	if c.BlockCapacity == 0 && cm.BlockCapacity(BlockTokens) <= 0 {
		return fmt.Errorf("tp: %s weights (%.1f GB) leave no KV memory on %d×%s",
			c.Model, cm.WeightBytes()/1e9, c.TP, c.GPU)
	}
	return nil
}

// costModel builds the cost model of c (defaults applied, fields valid).
func (c Config) costModel() (CostModel, error) {
	m, err := LookupModel(c.Model)
	if err != nil {
		return CostModel{}, fmt.Errorf("model: %w", err)
	}
	g, err := LookupGPU(c.GPU)
	if err != nil {
		return CostModel{}, fmt.Errorf("gpu: %w", err)
	}
	return CostModel{Model: m, GPU: g, TP: c.TP, MFU: c.MFU,
		BandwidthEfficiency: c.BandwidthEfficiency, MemoryUtilization: DefaultMemoryUtilization}, nil
}

// role returns the workerpb role of c (defaults applied).
func (c Config) role() workerpb.Role {
	switch c.Role {
	case RolePrefill:
		return workerpb.Role_ROLE_PREFILL
	case RoleDecode:
		return workerpb.Role_ROLE_DECODE
	}
	return workerpb.Role_ROLE_BOTH
}

// servesPrefill and servesDecode report whether the role serves Prefill
// and Decode.
func (c Config) servesPrefill() bool { return c.Role == RoleBoth || c.Role == RolePrefill }
func (c Config) servesDecode() bool  { return c.Role == RoleBoth || c.Role == RoleDecode }
