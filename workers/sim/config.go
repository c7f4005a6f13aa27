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

// Config configures an Engine. The zero value of every field, and of every
// group's, means its default; DefaultConfig spells them out. Validate's
// errors name a field by its path in snake case, e.g. "batching.max_running".
type Config struct {
	// Name is the worker's name in the fleet. Default "sim".
	Name string
	// Models are the model names the engine serves (requests for any
	// other model fail). Default: Cost.Model alone.
	Models []string
	// Role is the worker's role in disaggregated serving: RoleBoth
	// (default), RolePrefill or RoleDecode. Info reports it; Prefill is
	// served by prefill and both workers, Decode by decode and both
	// workers, Generate by all.
	Role string
	// TimeScale makes the modelled clock run TimeScale times faster than
	// real time: a modelled 400 ms step sleeps 400/TimeScale ms. Default 1.
	TimeScale float64
	// KVScale divides real KV sizes into the payload bytes of a block that
	// transfers and the shared tier move: kvblock.Size(KVBytesPerToken,
	// BlockTokens, KVScale). Default kvblock.DefaultScale (a Llama-3.1-8B
	// block of 2 MiB moves as 32 KiB); 1 moves real sizes.
	KVScale int
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

	// Cost is the cost model the engine charges its steps with, in
	// modelled time (cost.Config: presets and efficiencies).
	Cost cost.Config
	// Batching bounds the step loop's batches.
	Batching Batching
	// Tiers sizes the KV tiers (GPU, CPU, the shared one) and models the
	// links between them.
	Tiers Tiers
	// Disagg models the KV transfers of disaggregated serving.
	Disagg Disagg
	// Warmup warms a starting engine from the shared tier.
	Warmup Warmup
	// LoRA lists the LoRA adapters of Models the engine can load, and
	// models their slots.
	LoRA LoRA
}

// Batching bounds the step loop's batches, as vLLM's scheduler options do.
type Batching struct {
	// MaxRunning bounds the sequences in the running batch. Default 256,
	// vLLM's max_num_seqs.
	MaxRunning int
	// MaxBatchedTokens is the token budget of one step (decode tokens plus
	// prefill chunks; longer prompts are prefilled in chunks over several
	// steps). Default cost.DefaultMaxBatchedTokens, 8192, vLLM's
	// chunked-prefill default.
	MaxBatchedTokens int
}

// WithDefaults returns b with every zero field set to its default.
func (b Batching) WithDefaults() Batching {
	if b.MaxRunning == 0 {
		b.MaxRunning = 256
	}
	if b.MaxBatchedTokens == 0 {
		b.MaxBatchedTokens = cost.DefaultMaxBatchedTokens
	}
	return b
}

// Validate reports the first invalid field of b (defaults applied first),
// naming it.
func (b Batching) Validate() error {
	b = b.WithDefaults()
	switch {
	case b.MaxRunning < 1:
		return fmt.Errorf("max_running: %d is below 1", b.MaxRunning)
	case b.MaxBatchedTokens < 1:
		return fmt.Errorf("max_batched_tokens: %d is below 1", b.MaxBatchedTokens)
	}
	return nil
}

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

// Policies of writes to the shared tier (Tiers.StorePolicy).
const (
	// PolicyDemotion writes a block when it leaves the worker's last local
	// tier (the CPU tier, or the GPU tier without one).
	PolicyDemotion = "demotion"
	// PolicyWriteThrough writes every newly computed block.
	PolicyWriteThrough = "write-through"
)

// Tiers sizes the KV tiers: GPU blocks, evicted LRU to the CPU tier, and
// the fleet's shared tier behind both.
type Tiers struct {
	// GPUBlocks overrides the GPU KV capacity in blocks of 16 tokens.
	// Default: from the cost model (memory × 0.9 − weights).
	GPUBlocks int64
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
}

// WithDefaults returns t with every zero field set to its default.
func (t Tiers) WithDefaults() Tiers {
	if t.CPUMemoryBytes == 0 {
		t.CPUMemoryBytes = DefaultCPUMemoryBytes
	}
	if t.StorePolicy == "" {
		t.StorePolicy = PolicyDemotion
	}
	if t.RedisBandwidth == 0 {
		t.RedisBandwidth = DefaultRedisBandwidth
	}
	if t.RedisRTT == 0 {
		t.RedisRTT = DefaultRedisRTT
	}
	if t.StoreTimeout == 0 {
		t.StoreTimeout = DefaultStoreTimeout
	}
	if t.StoreQueue == 0 {
		t.StoreQueue = DefaultStoreQueue
	}
	return t
}

// Validate reports the first invalid field of t (defaults applied first),
// naming it.
func (t Tiers) Validate() error {
	t = t.WithDefaults()
	switch {
	case t.GPUBlocks < 0:
		return fmt.Errorf("gpu_blocks: %d is negative", t.GPUBlocks)
	case !(t.CPUMemoryBytes > 0):
		return fmt.Errorf("cpu_memory_bytes: %v must be positive", t.CPUMemoryBytes)
	case t.PCIeBandwidth < 0 || t.PCIeBandwidth != t.PCIeBandwidth:
		return fmt.Errorf("pcie_bandwidth: %v must be positive", t.PCIeBandwidth)
	case t.StorePolicy != PolicyDemotion && t.StorePolicy != PolicyWriteThrough:
		return fmt.Errorf("store_policy: %q is not %s or %s", t.StorePolicy, PolicyDemotion, PolicyWriteThrough)
	case !(t.RedisBandwidth > 0):
		return fmt.Errorf("redis_bandwidth: %v must be positive", t.RedisBandwidth)
	case t.RedisRTT < 0:
		return fmt.Errorf("redis_rtt: %v is negative", t.RedisRTT)
	case t.StoreTimeout < 0:
		return fmt.Errorf("store_timeout: %v is negative", t.StoreTimeout)
	case t.StoreQueue < 1:
		return fmt.Errorf("store_queue: %d is below 1", t.StoreQueue)
	}
	return nil
}

// cpuBlocks is the CPU tier's capacity of t (defaults applied, fields
// valid): CPUBlocks, or CPUMemoryBytes over the real KV bytes of a block;
// 0 when CPUBlocks is negative.
func (t Tiers) cpuBlocks(cm CostModel) int64 {
	switch {
	case t.CPUBlocks < 0:
		return 0
	case t.CPUBlocks > 0:
		return t.CPUBlocks
	}
	return int64(t.CPUMemoryBytes / float64(cm.KVBytesPerBlock()))
}

// pcieBandwidth is the effective bandwidth of a CPU → GPU copy of the TP
// group, bytes/s.
func (t Tiers) pcieBandwidth(cm CostModel) float64 {
	bw := t.PCIeBandwidth
	if bw == 0 {
		bw = cm.GPU.PCIeBandwidth
	}
	return bw * float64(cm.TP)
}

// Disaggregation defaults.
const (
	// DefaultLinkBandwidth is the default modelled bandwidth of the link
	// KV blocks cross between workers, bytes/s: 50 GB/s, about a 400 Gb/s
	// RDMA NIC.
	DefaultLinkBandwidth = 50e9
	// DefaultTransferTimeout is how long Decode waits for a transfer by
	// default.
	DefaultTransferTimeout = 5 * time.Second
)

// Disagg models the KV transfers of disaggregated serving (Config.Role
// says which side a worker serves).
type Disagg struct {
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

// WithDefaults returns d with every zero field set to its default.
func (d Disagg) WithDefaults() Disagg {
	if d.TransferTimeout == 0 {
		d.TransferTimeout = DefaultTransferTimeout
	}
	if d.LinkBandwidth == 0 {
		d.LinkBandwidth = DefaultLinkBandwidth
	}
	return d
}

// Validate reports the first invalid field of d (defaults applied first),
// naming it.
func (d Disagg) Validate() error {
	d = d.WithDefaults()
	switch {
	case d.TransferTimeout < 0:
		return fmt.Errorf("transfer_timeout: %v is negative", d.TransferTimeout)
	case d.LinkBandwidth != d.LinkBandwidth: // NaN
		return fmt.Errorf("link_bandwidth: %v is not a number", d.LinkBandwidth)
	}
	return nil
}

// WarmupFunc lists the prefixes a starting worker should fetch from the
// shared tier, hottest first: one namespace and one list of chained block
// keys per prefix.
type WarmupFunc func(ctx context.Context) ([]transfer.Namespace, [][]uint64, error)

// Warmup warms a starting engine's GPU tier with the fleet's hottest
// prefixes, fetched from the shared tier (Tiers.Store).
type Warmup struct {
	// TopK makes a starting engine with a store fetch the blocks of the
	// TopK hottest prefixes of each model it serves (see Engine.Warm), in
	// the background, within 10 s: those Keys lists first if it is set,
	// else those the store's hot-prefix tracker ranks (transfer.Tracker;
	// every engine with such a store records there the prefixes it
	// reuses). Until the warm-up ends the worker's health is NOT_SERVING.
	// Default 0: no warm-up; 32 is a sensible value (a few hundred MiB of
	// GPU blocks for an 8B model's typical system prompts).
	TopK int
	// Keys, if set, lists the prefixes to warm instead of the store's
	// tracker, hottest first. The engine calls it once at start.
	Keys WarmupFunc
}

// Validate reports the first invalid field of w, naming it. (Zero is the
// default of both.)
func (w Warmup) Validate() error {
	if w.TopK < 0 {
		return fmt.Errorf("top_k: %d is negative", w.TopK)
	}
	return nil
}

// DefaultConfig returns the configuration the zero Config stands for.
func DefaultConfig() Config {
	return Config{}.WithDefaults()
}

// WithDefaults returns c with every zero field, its groups' included, set
// to its default.
func (c Config) WithDefaults() Config {
	if c.Name == "" {
		c.Name = "sim"
	}
	c.Cost = c.Cost.WithDefaults()
	if len(c.Models) == 0 {
		c.Models = []string{c.Cost.Model}
	}
	if c.Role == "" {
		c.Role = RoleBoth
	}
	if c.TimeScale == 0 {
		c.TimeScale = 1
	}
	if c.KVScale == 0 {
		c.KVScale = kvblock.DefaultScale
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
	c.Batching = c.Batching.WithDefaults()
	c.Tiers = c.Tiers.WithDefaults()
	c.Disagg = c.Disagg.WithDefaults()
	c.LoRA = c.LoRA.WithDefaults()
	return c
}

// Validate reports the first invalid field of c (defaults applied first),
// naming it by its path, and the rules across fields: the weights must
// leave KV memory unless Tiers.GPUBlocks sets it.
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
	case c.Role != RoleBoth && c.Role != RolePrefill && c.Role != RoleDecode:
		return fmt.Errorf("role: %q is not %s, %s or %s", c.Role, RoleBoth, RolePrefill, RoleDecode)
	case !(c.TimeScale > 0): // also rejects NaN
		return fmt.Errorf("time_scale: %v must be positive", c.TimeScale)
	case c.KVScale < 1:
		return fmt.Errorf("kv_scale: %d is below 1", c.KVScale)
	case c.DefaultMaxTokens < 1:
		return fmt.Errorf("default_max_tokens: %d is below 1", c.DefaultMaxTokens)
	case c.LoadInterval < 0:
		return fmt.Errorf("load_interval: %v is negative", c.LoadInterval)
	case c.WatchBuffer < 2:
		return fmt.Errorf("watch_buffer: %d is below 2", c.WatchBuffer)
	}
	groups := []struct {
		path     string
		validate func() error
	}{
		{"cost", c.Cost.Validate},
		{"batching", c.Batching.Validate},
		{"tiers", c.Tiers.Validate},
		{"disagg", c.Disagg.Validate},
		{"warmup", c.Warmup.Validate},
		{"lora", func() error { return c.LoRA.validate(c.Models) }},
	}
	for _, g := range groups {
		if err := g.validate(); err != nil {
			return fmt.Errorf("%s.%w", g.path, err)
		}
	}
	cm, err := c.costModel()
	if err != nil {
		return err
	}
	if c.Tiers.GPUBlocks == 0 && cm.BlockCapacity(BlockTokens) <= 0 {
		return fmt.Errorf("cost.tp: %s weights (%.1f GB) leave no KV memory on %d×%s",
			c.Cost.Model, cm.WeightBytes()/1e9, c.Cost.TP, c.Cost.GPU)
	}
	return nil
}

// costModel builds the cost model of c (defaults applied, fields valid).
func (c Config) costModel() (CostModel, error) {
	cm, err := c.Cost.Engine()
	if err != nil {
		return CostModel{}, fmt.Errorf("cost.%w", err)
	}
	return cm, nil
}

// figures are c's cost figures in modelled seconds (defaults applied,
// fields valid): cm's, with c's PCIe link, Redis tier and step budget.
func (c Config) figures(cm CostModel) cost.Figures {
	f := cm.Figures()
	f.PCIeBytesPerSecond = c.Tiers.pcieBandwidth(cm)
	f.RedisBytesPerSecond, f.RedisRTTSeconds = c.Tiers.RedisBandwidth, c.Tiers.RedisRTT.Seconds()
	f.MaxBatchedTokens = c.Batching.MaxBatchedTokens
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
