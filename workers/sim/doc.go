// Package sim is baton's simulated LLM engine: it behaves like vLLM with
// prefix caching (continuous batching, chunked prefill, a paged KV cache of
// 16-token blocks with LRU eviction) on the CPU, timing each step with a
// cost model of a model on GPUs (package workers/engine/cost, whose
// figures kv_aware estimates with).
//
// Its text is deterministic: equal prompts give equal completions, one
// 4-character word per token, so tests and benchmarks are repeatable.
// Tokens are counted as blockkey.Tokens: one per 4 characters, rounded up.
//
// Engine serves requests in process (engine.Client-style Generate); Server
// serves it over gRPC as a baton worker (proto/worker.proto) with the
// standard health service.
//
// # Disaggregated prefill and decode
//
// A worker has a role (Config.Role): prefill, decode or both. Prefill
// (prefill and both workers) runs a prefill-only sequence in the batch like
// any other, then pushes the KV blocks the decode worker lacks to it over
// a transfer.Transport and releases them; Decode (decode and both workers)
// waits, bounded, for its transfer, then generates as Generate does, its
// cache now holding the transferred blocks. Every worker is a
// transfer.Receiver (Has, Accept, Finish): verified blocks enter its cache
// as computed, unreferenced blocks, announced like any stored block. A
// failed, corrupt or late transfer costs the decode worker a recompute,
// never a wrong block nor a failed request; the completion is the same
// text a colocated Generate gives.
//
// Payloads are real bytes (transfer/kvblock), scaled down by
// Config.KVScale so a loopback fleet moves them cheaply. The time a real
// link would take is modelled on top: before each push the prefill worker
// sleeps blocks × KVBytesPerToken × 16 / Config.Disagg.LinkBandwidth
// (real, unscaled KV bytes; 50 GB/s by default, a 400 Gb/s RDMA NIC),
// divided by Config.TimeScale like every modelled time.
//
// # KV tiers
//
// Blocks live in up to three tiers (Cache, tier.go):
//
//   - GPU: Config.Tiers.GPUBlocks blocks (default: what the cost model
//     leaves of GPU memory); unreferenced blocks are evicted least
//     recently used first.
//   - CPU: Config.Tiers.CPUBlocks blocks of host memory (default 256 GiB
//     of real KV, Tiers.CPUMemoryBytes; -1 disables it). A block evicted
//     from the GPU tier is demoted here (a tier-changed event, GPU to CPU)
//     instead of dropped; the CPU tier evicts LRU too (a removed event,
//     tier CPU). A sequence whose leading blocks are here has them
//     promoted back at admission (tier-changed, CPU to GPU): the copy adds
//     n × real KV bytes per block / (PCIe bandwidth × TP) to the modelled
//     time of the step that admits it, as vLLM's synchronous swap-in
//     (64 GB/s per GPU, PCIe Gen5 x16, for the H100 and H200 presets, or
//     Tiers.PCIeBandwidth; a 2 MiB Llama-3.1-8B block takes 33 µs).
//   - Redis: Config.Tiers.Store, the fleet's shared transfer.Store (nil:
//     none). Blocks are written there under their namespace (model, and
//     tenant salt blockkey.Seed(model, tenant)) by one writer goroutine,
//     batched, from a bounded queue that drops (and counts) what
//     overflows, never blocking a step: with Tiers.StorePolicy "demotion"
//     when a block leaves the last local tier, with "write-through" as
//     soon as it is computed. A stored event of tier Redis follows each
//     successful write. Before a sequence is queued (Generate, Decode,
//     Prefill) the engine asks the store, in one Get bounded by
//     Tiers.StoreTimeout, for the leading blocks neither local tier holds,
//     if fetching them all would take less modelled time than computing
//     them; the leading run that comes back enters the GPU tier (stored
//     events) and the sequence waits Tiers.RedisRTT + n × real KV bytes
//     per block / Tiers.RedisBandwidth (0.5 ms and 10 GB/s by default:
//     0.71 ms for one 2 MiB block, 2.0 ms for seven), over TimeScale,
//     before it is queued. Keys it found missing are announced as removed
//     from tier Redis. A store error, timeout or bypass
//     (transfer.ErrBypassed behind a breaker) only costs the recompute.
//
// Cached tokens count hits in every tier (none is recomputed), and the
// final usage splits them by tier. Watch events carry their tier and, for
// tier changes, the tier left; a snapshot lists the GPU and CPU tiers'
// blocks (the worker does not know all the shared tier holds). Info
// reports the CPU tier, whether the worker uses a shared tier, and its
// cost figures in real seconds (workerpb.CostParams).
//
// # Warm-up
//
// Fleet-wide prefix popularity lives in the shared tier itself when the
// store implements transfer.HotTracker (kvstore's Redis and Memory do,
// and a Breaker passes it through): every time a sequence is admitted
// with leading blocks reused from any tier (not pushed by a prefill
// worker), the engine records one use of that reused chain, off the step
// loop (one goroutine, a bounded queue that drops and counts what
// overflows). Counting reused chains rather than whole prompts ranks a
// system prompt shared by many distinct requests as the hot prefix it
// is. The same goroutine queues the blocks of each prefix it records for
// writing to the shared tier, at most once per 10 minutes per prefix: a
// hot prefix stays on the GPU, and under StorePolicy "demotion" would
// otherwise never reach the tier nor survive its TTL there.
//
// Engine.Warm fetches one prefix's blocks from the store into the cache.
// With Config.Warmup.TopK, a starting engine asks the tracker (or the
// Config.Warmup.Keys hook, which takes precedence) for the TopK
// hottest prefixes of each model it serves and warms them, coldest first
// so the hottest are the most recently used, in the background within
// 10 s; Stats counts the prefixes and blocks warmed, and the gRPC health
// is NOT_SERVING until the warm-up ends (Engine.WarmupDone), so that a
// worker that joins a fleet takes traffic warm.
package sim
