// Package kvstore implements transfer.Store, the fleet-wide shared KV
// tier: Redis (NewRedis) for a real fleet, an in-process LRU (NewMemory)
// when no Redis is configured, and a circuit breaker (NewBreaker) that
// skips either while it fails, so a slow or dead tier costs a recompute,
// never a request. Both stores also track the fleet's hottest prefixes
// (transfer.HotTracker, hot.go), for the warm-up of workers that join.
//
// Every value is a small header then the block's payload:
//
//	offset 0  magic 0xBA
//	offset 1  version 1
//	offset 2  2 bytes, zero
//	offset 4  CRC-32C of the payload, little endian
//	offset 8  payload length, little endian uint32
//	offset 12 payload
//
// Both stores verify a value on Get the same way (header, length, checksum,
// and that the contents are those of the key) and delete one that fails.
package kvstore

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/batonllm/baton/transfer/kvblock"
)

const (
	valueMagic   = 0xBA
	valueVersion = 1
	headerSize   = 12
)

var errHeader = errors.New("bad value header")

// valueSize is the encoded size of a payload of n bytes.
func valueSize(n int) int { return headerSize + n }

// encode writes the value of payload into dst, which has valueSize(len(payload))
// bytes, and returns it.
func encode(dst, payload []byte) []byte {
	dst = dst[:valueSize(len(payload))]
	dst[0], dst[1], dst[2], dst[3] = valueMagic, valueVersion, 0, 0
	binary.LittleEndian.PutUint32(dst[4:], kvblock.Checksum(payload))
	binary.LittleEndian.PutUint32(dst[8:], uint32(len(payload)))
	copy(dst[headerSize:], payload)
	return dst
}

// decode verifies value as block key of size bytes and returns its payload,
// a subslice of value.
func decode(key uint64, value []byte, size int) ([]byte, error) {
	if len(value) < headerSize || value[0] != valueMagic || value[1] != valueVersion {
		return nil, errHeader
	}
	crc := binary.LittleEndian.Uint32(value[4:])
	n := binary.LittleEndian.Uint32(value[8:])
	payload := value[headerSize:]
	if uint64(n) != uint64(len(payload)) {
		return nil, fmt.Errorf("%w: length %d, payload %d bytes", errHeader, n, len(payload))
	}
	// Verify checks the size, the CRC-32C and the key's contents.
	if err := kvblock.Verify(key, payload, size, crc); err != nil {
		return nil, err
	}
	return payload, nil
}
