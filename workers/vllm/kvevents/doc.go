// Package kvevents reads the KV cache events of vLLM and SGLang engines and
// turns them into the scheduler's index events.
//
// The engines publish batches of events over ZeroMQ: each message is the
// frames [topic, 8-byte big-endian sequence number, msgpack payload]. The
// payload is a batch [timestamp, events, data-parallel rank]; each event is
// a msgspec struct, encoded as an array whose first element is its tag
// ("BlockStored", "BlockRemoved", "AllBlocksCleared") or, in newer vLLM, as
// a map with a "type" key. A subscriber that misses batches asks the
// engine's replay ROUTER socket for them by sequence number.
//
// The formats follow the engines' sources, vllm/distributed/kv_events.py and
// SGLang's python/sglang/srt/disaggregation/kv_events.py:
//
//   - vLLM from its first release with KV events (v0.9: array-like batch
//     [ts, events], BlockStored [tag, block_hashes, parent_block_hash,
//     token_ids, block_size, lora_id], integer hashes) through the fields
//     appended since (medium, lora_name, extra_keys, group_idx,
//     kv_cache_spec_kind, the batch's data_parallel_rank; bytes hashes), to
//     v0.26 (events as maps tagged under "type", replay replies carrying
//     the topic frame) and its main branch (the batch a map too).
//   - SGLang's main branch (2026): array-like everywhere, integer hashes,
//     the batch's attn_dp_rank, media "GPU", "CPU_PINNED", "DISK",
//     "EXTERNAL", and a metadata map {cache_salt} in the slot where vLLM
//     has lora_name; its older releases are the same minus those fields.
//
// A sequence's first block has no parent. vLLM writes its
// parent_block_hash as nil (every version above, integer and bytes hashes
// alike); publishers built on Go's msgpack structs write 0 instead, or
// leave block_size 0: the array-like events of llm-d's kv-cache-manager
// examples and of its inference simulator (llm-d-inference-sim's
// kv_cache_sender.go), which llm-d's own reader
// (llm-d-kv-cache pkg/kvevents: vllm_adapter.go, pool.go) takes as "no
// parent" too. Decode reads nil, 0, empty bytes and a missing field alike
// as no parent (NoParent), and the scheduler's translator
// (scheduler/watch.Translator) takes a block size of 0 as the tokens a
// block. A parent that is none of these and that the translator never saw
// drops the event (watch.TranslatorStats.UnknownParent): its token ids
// follow a prefix the event does not carry, so they cannot be keyed as
// baton keys them (each key covers every token before it), and keying them
// as a sequence of their own would claim a prefix the engine does not hold.
//
// Keys are baton's own: the translator recomputes chained block keys over
// each stored block's token ids (blockkey.AppendTokens) and keeps a bounded map from
// the engine's hash to baton's key for removals, so the engine's hash
// algorithm and seed never matter.
package kvevents
