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
package sim
