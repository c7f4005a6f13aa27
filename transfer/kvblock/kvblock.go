// Package kvblock is the payload of a KV block as it moves between workers
// and tiers: bytes sized like the real attention state of the block's
// tokens, with contents derived from the block key, so a receiver can check
// that a block is the one its key names, and a CRC-32C checksum.
package kvblock

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
)

// DefaultScale is the default divisor of real KV sizes (see Size): a
// Llama-3.1-8B block of 16 tokens is 2 MiB of KV; scaled by 64 it is
// 32 KiB, small enough that a loopback fleet moves thousands of them.
const DefaultScale = 64

// Size returns the payload bytes of one block: kvBytesPerToken ×
// tokensPerBlock / scale, at least 64 and a multiple of 8. scale ≤ 0 means
// DefaultScale; scale 1 gives real sizes.
func Size(kvBytesPerToken int64, tokensPerBlock int, scale int) int {
	if scale <= 0 {
		scale = DefaultScale
	}
	n := kvBytesPerToken * int64(tokensPerBlock) / int64(scale)
	n &^= 7
	if n < 64 {
		n = 64
	}
	return int(n)
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC-32C of data.
func Checksum(data []byte) uint32 { return crc32.Checksum(data, castagnoli) }

// UpdateChecksum returns the CRC-32C of the bytes summed by crc followed by
// p: Checksum(a+b) == UpdateChecksum(Checksum(a), b), and
// UpdateChecksum(0, p) == Checksum(p). It lets a receiver checksum a block
// piece by piece as it arrives, while the bytes are in cache.
func UpdateChecksum(crc uint32, p []byte) uint32 { return crc32.Update(crc, castagnoli, p) }

// Fill writes the contents of block key into dst: a splitmix64 stream
// seeded by the key, 8 bytes at a time (a short tail takes the stream's
// leading bytes). len(dst) is the block size.
func Fill(dst []byte, key uint64) {
	x := key
	i := 0
	for ; i+8 <= len(dst); i += 8 {
		x += 0x9e3779b97f4a7c15
		binary.LittleEndian.PutUint64(dst[i:], mix(x))
	}
	if i < len(dst) {
		var tail [8]byte
		x += 0x9e3779b97f4a7c15
		binary.LittleEndian.PutUint64(tail[:], mix(x))
		copy(dst[i:], tail[:])
	}
}

func mix(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Errors of Verify.
var (
	ErrChecksum = errors.New("block checksum mismatch")
	ErrSize     = errors.New("block size mismatch")
	ErrContents = errors.New("block contents do not match its key")
)

// Verify checks a received block: its size, its checksum, and that its
// contents are those of key. It does not allocate.
func Verify(key uint64, data []byte, size int, crc uint32) error {
	if len(data) != size {
		return fmt.Errorf("%w: got %d bytes, want %d", ErrSize, len(data), size)
	}
	return VerifySum(key, data, size, crc, Checksum(data))
}

// VerifySum is Verify for a caller that has already computed the CRC-32C
// of data (sum, e.g. with UpdateChecksum as the bytes arrived): it checks
// the size, that sum is the expected crc, and the key's contents, without
// reading data a second time for the checksum. sum must be the checksum of
// exactly data. It does not allocate.
func VerifySum(key uint64, data []byte, size int, crc, sum uint32) error {
	if len(data) != size {
		return fmt.Errorf("%w: got %d bytes, want %d", ErrSize, len(data), size)
	}
	if sum != crc {
		return ErrChecksum
	}
	// A block with the right checksum but another key's contents would mean
	// a sender bug; check the first and last full words, which is cheap.
	if n := uint64(len(data) / 8); n > 0 {
		const golden = 0x9e3779b97f4a7c15
		if binary.LittleEndian.Uint64(data) != mix(key+golden) ||
			binary.LittleEndian.Uint64(data[(n-1)*8:]) != mix(key+n*golden) {
			return ErrContents
		}
	}
	return nil
}
