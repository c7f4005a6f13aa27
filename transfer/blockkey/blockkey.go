// Package blockkey computes the identity of KV blocks: chained 64-bit hashes
// over fixed-size chunks of routing text. The scheduler and the workers use
// these same functions, so a key the scheduler predicts is the key a worker
// stores.
//
// Text is cut into chunks of BlockChars characters (runes). Key i is the
// xxHash64 of chunk i seeded with key i-1; key 0's seed is Seed(model,
// tenant). Equal keys therefore mean equal model, tenant and text up to and
// including that block.
//
// Engines that key their blocks by token ids (vLLM, SGLang) are keyed the
// same way over token ids (AppendTokens, tokens.go): key 0's seed is
// TokenSeed(Salt(model, adapter, tenant)), and each key the xxHash64 of a
// block's ids as 32-bit little-endian values seeded with the key before it.
package blockkey

import (
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// DefaultBlockChars is the default block size in characters: about 16
// tokens at 4 characters a token, vLLM's default block size.
const DefaultBlockChars = 64

// CharsPerToken is how many characters the simulated engine counts as one
// token (rounded up) for cost and usage.
const CharsPerToken = 4

// Tokens returns the token count of n characters: ceil(n / CharsPerToken).
func Tokens(chars int) int { return (chars + CharsPerToken - 1) / CharsPerToken }

// Seed returns the seed of a chain: the hash of model and tenant. It is the
// tenant salt of every key of the chain.
func Seed(model, tenant string) uint64 {
	var d xxhash.Digest
	d.Reset()
	d.WriteString(model)
	d.Write([]byte{0})
	d.WriteString(tenant)
	return d.Sum64()
}

// Append appends to dst the chained keys of every full block of text and
// returns the extended slice. A trailing partial block has no key: engines
// cache full blocks only.
func Append(dst []uint64, seed uint64, text string, blockChars int) []uint64 {
	if blockChars <= 0 {
		blockChars = DefaultBlockChars
	}
	var d xxhash.Digest
	prev := seed
	for len(text) > 0 {
		n := byteLen(text, blockChars)
		if n < 0 {
			break // partial block
		}
		d.ResetWithSeed(prev)
		d.WriteString(text[:n])
		prev = d.Sum64()
		dst = append(dst, prev)
		text = text[n:]
	}
	return dst
}

// Prefix returns the hash of the first maxChars characters of text (all of
// it if shorter), seeded with seed. It is the routing key of prefix-aware
// routing: requests whose first maxChars characters are equal share it.
func Prefix(seed uint64, text string, maxChars int) uint64 {
	if n := byteLen(text, maxChars); n >= 0 {
		text = text[:n]
	}
	return xxhash.Sum64String(text) ^ seed*0x9e3779b97f4a7c15
}

// PrefixBytes is Prefix over raw bytes, counting bytes rather than
// characters (the native route hashes the request body as it came).
func PrefixBytes(seed uint64, body []byte, maxBytes int) uint64 {
	if len(body) > maxBytes {
		body = body[:maxBytes]
	}
	return xxhash.Sum64(body) ^ seed*0x9e3779b97f4a7c15
}

// byteLen returns the byte length of the first n characters of s, or -1 if s
// has fewer than n characters.
func byteLen(s string, n int) int {
	// Fast path: ASCII text has one byte per character.
	if len(s) < n {
		// Even all-ASCII, s is too short; multi-byte runes only shrink the count.
		return -1
	}
	if isASCII(s[:n]) {
		return n
	}
	i := 0
	for c := 0; c < n; c++ {
		if i >= len(s) {
			return -1
		}
		if s[i] < utf8.RuneSelf {
			i++
			continue
		}
		_, size := utf8.DecodeRuneInString(s[i:])
		i += size
	}
	return i
}

// isASCII reports whether every byte of s is below utf8.RuneSelf, reading
// eight at a time.
func isASCII(s string) bool {
	i := 0
	for ; i+8 <= len(s); i += 8 {
		if (s[i]|s[i+1]|s[i+2]|s[i+3]|s[i+4]|s[i+5]|s[i+6]|s[i+7])&0x80 != 0 {
			return false
		}
	}
	for ; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// Chars returns the number of characters (runes) in s.
func Chars(s string) int { return utf8.RuneCountInString(s) }
