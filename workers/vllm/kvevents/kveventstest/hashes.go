package kveventstest

import "github.com/batonllm/baton/workers/vllm/kvevents"

// IntHashes returns vs as the integer block hashes vLLM publishes.
func IntHashes(vs ...uint64) []kvevents.Hash {
	hs := make([]kvevents.Hash, len(vs))
	for i, v := range vs {
		hs[i] = kvevents.IntHash(v)
	}
	return hs
}

// BytesHashes returns ss as the byte-string block hashes of publishers
// that hash to bytes.
func BytesHashes(ss ...string) []kvevents.Hash {
	hs := make([]kvevents.Hash, len(ss))
	for i, s := range ss {
		hs[i] = kvevents.BytesHash([]byte(s))
	}
	return hs
}

// TokenRun returns n token ids counting up from from.
func TokenRun(from, n int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = uint32(from + i)
	}
	return ts
}
