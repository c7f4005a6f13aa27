package bench

import (
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"

	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/routing"
)

// Options configure a bench run. They are baton bench's flags: Validate
// names a field by the flag that sets it (--kv-blocks for KVBlocks), as
// users know it. A zero field means its default where its comment gives
// one.
type Options struct {
	// Strategies are the routing strategies to compare, by their built-in
	// names, each on the identical request sequence.
	Strategies []string
	// Target is a running baton's base URL, or the comma-separated URLs
	// of its replicas (request i goes to the i-th mod their number); empty
	// starts an in-process
	// fleet per strategy.
	Target string
	// Workers is the in-process fleet size (with Target: the fleet size
	// for the ideal share), 1–MaxInProcessWorkers.
	Workers int
	// Model is the model preset of the simulated workers and the model
	// requested (default llama-3.1-8b); GPU their GPU preset (default
	// h100).
	Model string
	GPU   string
	// KVBlocks overrides each simulated worker's KV capacity (0: from the
	// cost model).
	KVBlocks int64
	// CPUBlocks is each worker's CPU KV tier in blocks: 0 for none (the
	// SageMaker study's fleet had only GPU caches), -1 for the simulator's
	// default (host memory).
	CPUBlocks int64
	// ConcurrencyThreshold and PrefixLength tune prefix_aware (0: the
	// scheduler's defaults, 16 and 4,096 characters).
	ConcurrencyThreshold int
	PrefixLength         int
	// Speedup compresses time: arrivals come Speedup times faster and the
	// simulated engines run their clock Speedup times faster. Reported
	// latencies and rates are in modelled (uncompressed) time. Default 1.
	Speedup float64
	// Rate is the Poisson arrival rate in modelled requests/s; 0 with a
	// timed workload replays its timestamps.
	Rate float64
	// Concurrency caps requests in flight (0: open loop, no cap).
	Concurrency int
	// Seed seeds the workload, the arrivals and the in-process scheduler's
	// random choices (routing.SeededRand, fresh per fleet), so that a run
	// repeats.
	Seed uint64
	// Fleets are the in-process fleets each strategy runs on, one column
	// per strategy and fleet; empty: one colocated fleet of Workers.
	Fleets []Fleet
	// SharedTier gives every in-process fleet one shared KV tier, a fresh
	// kvstore.NewMemory store (SharedTierBytes) all its workers read at
	// admission and write evicted blocks to: the path kv_aware fetches a
	// prefix from Redis by. Off by default, as SageMaker's study had only
	// GPU caches.
	SharedTier bool
	// SharedTierBytes bounds the shared tier (0: kvstore's default, 1 GiB
	// of the simulator's scaled blocks).
	SharedTierBytes int64
	// Replicas are the numbers of scheduler replicas each strategy runs
	// with on each in-process fleet, one column per number: N schedulers
	// configured alike in front of the same workers, the clients' requests
	// spread over them in turn (request i to replica i mod N), as a load
	// balancer spreads them. 1–16 each; empty: one.
	Replicas []int
	// ShareRedis, when set, is the Redis server (host:port) through which
	// the replicas of each in-process fleet share what they learn
	// (scheduler.ReplicasConfig), each fleet on a stream of its own.
	// Empty: each replica learns alone.
	ShareRedis string
	// SharePeers has the replicas of each in-process fleet also send
	// their decisions straight to each other (replicas.peers), each on a
	// loopback port of its own.
	SharePeers bool
	// ReplicasFirst sends every request to the first replica (the first
	// --target URL): the others run beside it, following the engines and
	// sharing, and decide nothing. A control: what N schedulers cost the
	// machine, apart from splitting the decisions between them.
	ReplicasFirst bool
	// MaxLoRAs is each in-process worker's LoRA adapter slots, for
	// workloads naming adapters (lora), 0–1,024. 0: DefaultMaxLoRAs.
	MaxLoRAs int
	// Progress receives a progress line per second; nil: none.
	Progress io.Writer
	// Virtual says the fleets are replayed on the virtual clock
	// (bench/vsim), which holds up to MaxVirtualWorkers workers where an
	// in-process fleet holds MaxInProcessWorkers.
	Virtual bool
}

// Fleet sizes: an in-process fleet runs a simulated engine, its gRPC
// server and its scheduler connections per worker (1,024 of them take
// about 2 GB and want a --speedup of 1/64 or less on two cores, see
// bench/RESULTS.md §14); the virtual clock only the engines' state, up
// to what one index tracks.
const (
	MaxInProcessWorkers = 1024
	MaxVirtualWorkers   = 4096
)

// maxWorkers is the most workers a fleet of o may have.
func (o Options) maxWorkers() int {
	if o.Virtual {
		return MaxVirtualWorkers
	}
	return MaxInProcessWorkers
}

// Validate checks each field's range, the strategies' names, the fleets'
// shapes, and that Target is not given fleets or a shared tier only an
// in-process fleet has.
func (o Options) Validate() error {
	switch {
	case o.Workers < 1 || o.Workers > o.maxWorkers():
		return fmt.Errorf("--workers: must be 1–%d, got %d", o.maxWorkers(), o.Workers)
	case !(o.Speedup >= 0):
		return fmt.Errorf("--speedup: must be positive, got %v", o.Speedup)
	case !(o.Rate >= 0):
		return fmt.Errorf("--rate: must be positive, got %v", o.Rate)
	case o.Concurrency < 0:
		return fmt.Errorf("--concurrency: must not be negative (0: open loop), got %d", o.Concurrency)
	case o.MaxLoRAs < 0 || o.MaxLoRAs > 1024:
		return fmt.Errorf("--max-loras: must be 0–1024, got %d", o.MaxLoRAs)
	case o.KVBlocks < 0:
		return fmt.Errorf("--kv-blocks: must be at least 1, got %d", o.KVBlocks)
	case o.CPUBlocks < -1:
		return fmt.Errorf("--cpu-blocks: must be at least -1 (0: none; -1: the simulator's default), got %d", o.CPUBlocks)
	case o.SharedTierBytes < 0:
		return fmt.Errorf("--shared-tier-bytes: must be positive, got %d", o.SharedTierBytes)
	case o.ConcurrencyThreshold != 0 && (o.ConcurrencyThreshold < routing.MinConcurrencyThreshold || o.ConcurrencyThreshold > routing.MaxConcurrencyThreshold):
		return fmt.Errorf("--concurrency-threshold: must be %d–%d, got %d", routing.MinConcurrencyThreshold, routing.MaxConcurrencyThreshold, o.ConcurrencyThreshold)
	case o.PrefixLength != 0 && (o.PrefixLength < frontend.MinPrefixLength || o.PrefixLength > frontend.MaxPrefixLength):
		return fmt.Errorf("--prefix-length: must be %d–%d, got %d", frontend.MinPrefixLength, frontend.MaxPrefixLength, o.PrefixLength)
	}
	seenN := map[int]bool{}
	for _, n := range o.Replicas {
		if n < 1 || n > MaxReplicas {
			return fmt.Errorf("--replicas: must be 1–%d each, got %d", MaxReplicas, n)
		}
		if seenN[n] {
			return fmt.Errorf("--replicas: %d given twice (columns would share a label)", n)
		}
		seenN[n] = true
	}
	if o.ShareRedis != "" {
		if _, _, err := net.SplitHostPort(o.ShareRedis); err != nil {
			return fmt.Errorf("--share-redis: want host:port: %v", err)
		}
		if o.Target != "" {
			return errors.New("--share-redis applies to in-process fleets, not --target (configure the target's replicas: with replicas.redis)")
		}
	}
	if o.SharePeers && o.Target != "" {
		return errors.New("--share-peers applies to in-process fleets, not --target (configure the target's replicas: with replicas.peers)")
	}
	if o.Target != "" && (len(o.Replicas) > 1 || len(o.Replicas) == 1 && o.Replicas[0] != 1) {
		return errors.New("--replicas applies to in-process fleets, not --target (put the target's replicas behind one URL)")
	}
	var reg routing.Registry
	routing.RegisterBuiltins(&reg)
	known := reg.Names()
	for _, s := range o.Strategies {
		if !slices.Contains(known, s) {
			return fmt.Errorf("--strategies: unknown %q (known: %s)", s, strings.Join(known, ", "))
		}
	}
	if len(o.Strategies) == 0 {
		return errors.New("--strategies: none given")
	}
	seen := map[string]bool{}
	for _, f := range o.Fleets {
		if n := o.maxWorkers(); !f.valid(n) {
			return fmt.Errorf("--fleets: fleet %+v: want 1–%d colocated workers, or 1–%d prefill and 1–%d decode workers", f, n, n, n)
		}
		if seen[f.Label()] {
			return fmt.Errorf("--fleets: fleet %s given twice (columns would share a label)", f)
		}
		seen[f.Label()] = true
	}
	inProcessOnly := o.SharedTier || len(o.Fleets) > 1 || len(o.Fleets) == 1 && o.Fleets[0] != Fleet{Workers: o.Workers}
	if o.Target != "" && inProcessOnly {
		return errors.New("--fleets and --shared-tier apply to in-process fleets, not --target")
	}
	return nil
}

// MaxReplicas bounds Options.Replicas: each replica follows every
// worker's streams, on the one machine the bench runs on.
const MaxReplicas = 16

// valid reports whether f is a fleet ParseFleets could give, of at most
// max workers of each role.
func (f Fleet) valid(max int) bool {
	in := func(n int) bool { return n >= 1 && n <= max }
	if f.Disaggregated() || f.Decode != 0 {
		return in(f.Prefill) && in(f.Decode)
	}
	return in(f.Workers)
}
