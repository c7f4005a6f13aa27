// Package sim is baton's simulated LLM engine: it behaves like vLLM with
// prefix caching (continuous batching, chunked prefill, a paged KV cache of
// 16-token blocks with LRU eviction) on the CPU, timing each step with a
// cost model of a model on GPUs (costmodel.go).
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
// sleeps blocks × KVBytesPerToken × 16 / Config.LinkBandwidth (real,
// unscaled KV bytes; 50 GB/s by default, a 400 Gb/s RDMA NIC), divided by
// Config.TimeScale like every modelled time.
package sim
