package sim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/workers/engine/cost"
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

// Tier defaults.
const (
	// DefaultCPUMemoryBytes is the host memory a worker gives its CPU KV
	// tier by default: 256 GiB (a GPU's share of a 2 TiB, 8-GPU host).
	DefaultCPUMemoryBytes = 256 << 30
	// DefaultRedisBandwidth is the modelled bandwidth of fetches from the
	// shared Redis tier, bytes/s: 10 GB/s, about a 100 Gb/s NIC.
	DefaultRedisBandwidth = cost.DefaultRedisBandwidth
	// DefaultRedisRTT is the modelled fixed time of one round trip to the
	// shared tier (one batched fetch).
	DefaultRedisRTT = cost.DefaultRedisRTT
	// DefaultStoreTimeout bounds, in real time, one lookup in the shared
	// tier at admission.
	DefaultStoreTimeout = 250 * time.Millisecond
	// DefaultStoreQueue is how many blocks may wait to be written to the
	// shared tier; more are dropped (and counted).
	DefaultStoreQueue = 4096
)

// Policies of writes to the shared tier (Config.StorePolicy).
const (
	// PolicyDemotion writes a block when it leaves the worker's last local
	// tier (the CPU tier, or the GPU tier without one).
	PolicyDemotion = "demotion"
	// PolicyWriteThrough writes every newly computed block.
	PolicyWriteThrough = "write-through"
)

// WarmupFunc lists the prefixes a starting worker should fetch from the
// shared tier, hottest first: one namespace and one list of chained block
// keys per prefix.
type WarmupFunc func(ctx context.Context) ([]transfer.Namespace, [][]uint64, error)

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
	// Model is the model preset whose cost is modelled (cost.Models).
	// Default cost.DefaultModel, "llama-3.1-8b".
	Model string
	// GPU is the GPU preset (cost.GPUs). Default cost.DefaultGPU, "h100".
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

	// CPUBlocks is the CPU (host memory) tier's capacity in blocks of 16
	// tokens: GPU blocks evicted LRU are demoted there instead of dropped,
	// and promoted back at a modelled PCIe copy cost when a sequence hits
	// them. Default: CPUMemoryBytes over the real KV bytes of a block;
	// negative: no CPU tier.
	CPUBlocks int64
	// CPUMemoryBytes is the host memory of the CPU tier when CPUBlocks is
	// 0. Default DefaultCPUMemoryBytes.
	CPUMemoryBytes float64
	// PCIeBandwidth overrides the GPU preset's PCIe bandwidth (bytes/s
	// each way, per GPU; a TP group copies over TP links at once).
	// Promoting n blocks from the CPU tier adds n × real KV bytes per
	// block / (PCIeBandwidth × TP) to the modelled time of the step that
	// admits the sequence (the copy is synchronous, as vLLM's swap-in).
	PCIeBandwidth float64

	// Store is the fleet's shared KV tier (Redis, or an in-process store);
	// nil: none. The engine reads it at admission and writes to it by
	// StorePolicy, never failing a request on its errors. The caller owns
	// it: Close does not close it.
	Store transfer.Store
	// StorePolicy is PolicyDemotion (default) or PolicyWriteThrough.
	StorePolicy string
	// RedisBandwidth (bytes/s) and RedisRTT model a fetch from the shared
	// tier: a sequence whose next leading blocks are fetched waits
	// RedisRTT + n × real KV bytes per block / RedisBandwidth (over
	// TimeScale) before it is queued. Defaults DefaultRedisBandwidth and
	// DefaultRedisRTT.
	RedisBandwidth float64
	RedisRTT       time.Duration
	// StoreTimeout bounds one lookup in the shared tier, in real time.
	// Default DefaultStoreTimeout.
	StoreTimeout time.Duration
	// StoreQueue bounds the blocks waiting to be written to the shared
	// tier. Default DefaultStoreQueue.
	StoreQueue int

	// WarmupTopK makes a starting engine with a Store fetch the blocks of
	// the WarmupTopK hottest prefixes of each model it serves (see
	// Engine.Warm), in the background, within 10 s: those WarmupKeys
	// lists first if it is set, else those the store's hot-prefix tracker
	// ranks (transfer.Tracker; every engine with such a store records
	// there the prefixes it reuses). Until the warm-up ends the worker's
	// health is NOT_SERVING. Default 0: no warm-up; 32 is a sensible value
	// (a few hundred MiB of GPU blocks for an 8B model's typical system
	// prompts).
	WarmupTopK int
	// WarmupKeys, if set, lists the prefixes to warm instead of the
	// store's tracker, hottest first. The engine calls it once at start.
	WarmupKeys WarmupFunc
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
		c.Model = cost.DefaultModel
	}
	if len(c.Models) == 0 {
		c.Models = []string{c.Model}
	}
	if c.GPU == "" {
		c.GPU = cost.DefaultGPU
	}
	if c.TP == 0 {
		c.TP = 1
	}
	if c.MFU == 0 {
		c.MFU = cost.DefaultMFU
	}
	if c.BandwidthEfficiency == 0 {
		c.BandwidthEfficiency = cost.DefaultBandwidthEfficiency
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = 256
	}
	if c.MaxBatchedTokens == 0 {
		c.MaxBatchedTokens = cost.DefaultMaxBatchedTokens
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
	if c.CPUMemoryBytes == 0 {
		c.CPUMemoryBytes = DefaultCPUMemoryBytes
	}
	if c.StorePolicy == "" {
		c.StorePolicy = PolicyDemotion
	}
	if c.RedisBandwidth == 0 {
		c.RedisBandwidth = DefaultRedisBandwidth
	}
	if c.RedisRTT == 0 {
		c.RedisRTT = DefaultRedisRTT
	}
	if c.StoreTimeout == 0 {
		c.StoreTimeout = DefaultStoreTimeout
	}
	if c.StoreQueue == 0 {
		c.StoreQueue = DefaultStoreQueue
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
	case !(c.CPUMemoryBytes > 0):
		return fmt.Errorf("cpu_memory_bytes: %v must be positive", c.CPUMemoryBytes)
	case c.PCIeBandwidth < 0 || c.PCIeBandwidth != c.PCIeBandwidth:
		return fmt.Errorf("pcie_bandwidth: %v must be positive", c.PCIeBandwidth)
	case c.StorePolicy != PolicyDemotion && c.StorePolicy != PolicyWriteThrough:
		return fmt.Errorf("store_policy: %q is not %s or %s", c.StorePolicy, PolicyDemotion, PolicyWriteThrough)
	case !(c.RedisBandwidth > 0):
		return fmt.Errorf("redis_bandwidth: %v must be positive", c.RedisBandwidth)
	case c.RedisRTT < 0:
		return fmt.Errorf("redis_rtt: %v is negative", c.RedisRTT)
	case c.StoreTimeout < 0:
		return fmt.Errorf("store_timeout: %v is negative", c.StoreTimeout)
	case c.StoreQueue < 1:
		return fmt.Errorf("store_queue: %d is below 1", c.StoreQueue)
	case c.WarmupTopK < 0:
		return fmt.Errorf("warmup_top_k: %d is negative", c.WarmupTopK)
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
	m, err := cost.LookupModel(c.Model)
	if err != nil {
		return CostModel{}, fmt.Errorf("model: %w", err)
	}
	g, err := cost.LookupGPU(c.GPU)
	if err != nil {
		return CostModel{}, fmt.Errorf("gpu: %w", err)
	}
	return CostModel{Model: m, GPU: g, TP: c.TP, MFU: c.MFU,
		BandwidthEfficiency: c.BandwidthEfficiency, MemoryUtilization: cost.DefaultMemoryUtilization}, nil
}

// cpuBlocks is the CPU tier's capacity of c (defaults applied, fields
// valid): CPUBlocks, or CPUMemoryBytes over the real KV bytes of a block;
// 0 when CPUBlocks is negative.
func (c Config) cpuBlocks(cm CostModel) int64 {
	switch {
	case c.CPUBlocks < 0:
		return 0
	case c.CPUBlocks > 0:
		return c.CPUBlocks
	}
	return int64(c.CPUMemoryBytes / float64(cm.KVBytesPerBlock()))
}

// pcieBandwidth is the effective bandwidth of a CPU → GPU copy of the TP
// group, bytes/s.
func (c Config) pcieBandwidth(cm CostModel) float64 {
	bw := c.PCIeBandwidth
	if bw == 0 {
		bw = cm.GPU.PCIeBandwidth
	}
	return bw * float64(cm.TP)
}

// figures are c's cost figures in modelled seconds (defaults applied,
// fields valid): cm's, with c's PCIe link, Redis tier and step budget.
func (c Config) figures(cm CostModel) cost.Figures {
	f := cm.Figures()
	f.PCIeBytesPerSecond = c.pcieBandwidth(cm)
	f.RedisBytesPerSecond, f.RedisRTTSeconds = c.RedisBandwidth, c.RedisRTT.Seconds()
	f.MaxBatchedTokens = c.MaxBatchedTokens
	return f
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
