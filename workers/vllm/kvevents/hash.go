package kvevents

import (
	"encoding/hex"
	"hash/maphash"
	"strconv"
)

// Hash is an engine's block hash. vLLM sends integers or bytes (its
// ExternalBlockHash), SGLang integers; Hash holds either as a comparable
// value, so it can key a map. The zero Hash is no hash (a chain's first
// block has no parent).
//
// An integer is held in place, so decoding one allocates nothing.
type Hash struct {
	n    uint64 // an integer hash
	b    string // a bytes hash's bytes
	kind uint8  // 0 none, intHash or bytesHash
}

const (
	intHash uint8 = 1 + iota
	bytesHash
)

// IntHash returns the Hash of an integer block hash. Negative integers are
// taken as their two's complement bits.
func IntHash(v uint64) Hash { return Hash{n: v, kind: intHash} }

// BytesHash returns the Hash of a bytes block hash.
func BytesHash(b []byte) Hash { return Hash{b: string(b), kind: bytesHash} }

// Digest returns 64 bits of h for keying a map: an integer hash's value,
// a bytes hash's bytes hashed (with this process's seed). Different hashes
// may share a digest, bytes hashes with a chance of 2⁻⁶⁴: compare the
// hashes themselves on a match.
func (h Hash) Digest() uint64 {
	if h.kind == bytesHash {
		return maphash.String(digestSeed, h.b)
	}
	return h.n
}

var digestSeed = maphash.MakeSeed()

// IsZero reports whether h is no hash.
func (h Hash) IsZero() bool { return h == Hash{} }

// NoParent reports whether h, as a BlockStored's parent, means the block
// has none: the zero Hash (msgpack nil, or the field absent), the integer
// 0, or empty bytes. vLLM sends nil; publishers that encode the parent as
// a plain integer send 0 (llm-d's Go publishers, whose readers take 0 as
// "no parent" too). A real block
// hashed to 0 is a 2⁻⁶⁴ chance.
func NoParent(h Hash) bool {
	if h.IsZero() {
		return true
	}
	if v, ok := h.Uint64(); ok {
		return v == 0
	}
	return h.kind == bytesHash && h.b == ""
}

// Uint64 returns an integer hash's value; ok is false for bytes hashes.
func (h Hash) Uint64() (v uint64, ok bool) {
	return h.n, h.kind == intHash
}

// Bytes returns a bytes hash's bytes; ok is false for integer hashes.
func (h Hash) Bytes() (b []byte, ok bool) {
	if h.kind != bytesHash {
		return nil, false
	}
	return []byte(h.b), true
}

// String returns the hash as a decimal integer or as hexadecimal bytes
// prefixed with "0x".
func (h Hash) String() string {
	if v, ok := h.Uint64(); ok {
		return strconv.FormatUint(v, 10)
	}
	if h.IsZero() {
		return "none"
	}
	return "0x" + hex.EncodeToString([]byte(h.b))
}
