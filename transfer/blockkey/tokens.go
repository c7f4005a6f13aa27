package blockkey

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// Token keys, for engines that key their KV blocks by token ids (vLLM,
// SGLang): the same chained 64-bit hashes, over token ids instead of
// text.

// Token is a token id as engines and tokenizers give it. Ids are hashed as
// 32-bit values: every vocabulary fits.
type Token interface {
	~uint32 | ~int32 | ~int | ~int64 | ~uint64
}

// Salt joins what salts a chain's first key, so that two models, adapters
// or tenants never share a key. Any part may be empty.
func Salt(model, lora, tenant string) string {
	return model + "\x00" + lora + "\x00" + tenant
}

// TokenSeed returns the seed of a token chain's first key for salt.
func TokenSeed(salt string) uint64 { return xxhash.Sum64String(salt) }

// NextTokenKey returns the key of a block of tokens that follows the block whose
// key is prev (a TokenSeed for a chain's first block).
func NextTokenKey[T Token](prev uint64, block []T) uint64 {
	var d xxhash.Digest
	d.ResetWithSeed(prev)
	var buf [256]byte
	for len(block) > 0 {
		n := min(len(block), len(buf)/4)
		for i, t := range block[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], uint32(t))
		}
		d.Write(buf[:4*n])
		block = block[n:]
	}
	return d.Sum64()
}

// AppendTokens appends to dst the chained keys of every full block of tokens
// (blockSize tokens each, the engine's block size) and returns the extended
// slice. Key i is NextTokenKey(key i-1, block i), key 0 chained from seed. A
// trailing partial block has no key: engines cache full blocks only.
func AppendTokens[T Token](dst []uint64, seed uint64, tokens []T, blockSize int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	prev := seed
	for len(tokens) >= blockSize {
		prev = NextTokenKey(prev, tokens[:blockSize])
		dst = append(dst, prev)
		tokens = tokens[blockSize:]
	}
	return dst
}
