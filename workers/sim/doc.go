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
// standard health service. A worker's role (Config.Role) is prefill,
// decode or both: prefill workers push the KV blocks a decode worker lacks
// over a transfer.Transport, and every worker is a transfer.Receiver. Its
// blocks live in up to three tiers (Cache): GPU, CPU and a shared
// transfer.Store. A failed, corrupt or late transfer, and a store's error
// or timeout, cost a recompute, never a wrong block nor a failed request.
//
// docs/simulated-engine.md describes the cost model, the disaggregated
// prefill and decode, the tiers and their modelled times, and the warm-up
// from the shared tier's popular prefixes.
package sim
