// Package transfer moves KV blocks between workers: a prefill worker pushes
// the blocks of a prompt straight to the decode worker that will generate
// from them. A Transport is the sending side, a Receiver the receiving
// side (implemented by decode engines); implementations move real payload
// bytes (kvblock) and verify every block before the receiver sees it.
//
// Two transports share one behaviour, checked by one test suite: gRPC
// streaming (KVTransfer service, proto/worker.proto) for real fleets, and
// in-memory for tests.
package transfer

import (
	"context"
	"errors"
)

// Block is one KV block in flight.
type Block struct {
	// Key is the block's chained key (transfer/blockkey).
	Key uint64
	// Data is the payload (kvblock.Fill); the sender computes its checksum.
	Data []byte
}

// PushStats is what one push moved.
type PushStats struct {
	// Accepted blocks were verified and handed to the receiver; Rejected
	// ones failed verification and were dropped.
	Accepted, Rejected int
	// Bytes is the payload bytes sent.
	Bytes int64
}

// Transport is the sending side. Its methods are safe for concurrent use
// and honour ctx's deadline and cancellation.
type Transport interface {
	// Has asks the receiver at addr which of keys it holds.
	Has(ctx context.Context, addr string, keys []uint64) ([]bool, error)
	// Push sends blocks to the receiver at addr under transferID and
	// returns once the receiver has processed every block (verified and
	// accepted, or rejected). The receiver's Finish is called exactly once
	// per push, whatever happens. The caller keeps ownership of the
	// blocks' Data; Push does not retain it after returning.
	Push(ctx context.Context, addr, transferID string, blocks []Block) (PushStats, error)
	// Close releases connections. It is idempotent.
	Close() error
}

// Receiver is the receiving side, implemented by a decode engine. Its
// methods are called from transport goroutines, concurrently for different
// transfers, and must not block for long.
type Receiver interface {
	// Has reports, for each key, whether the receiver holds the block.
	Has(keys []uint64) []bool
	// Accept hands over one verified block of a transfer, in push order.
	// The data is valid only during the call.
	Accept(transferID string, key uint64, data []byte)
	// Finish ends a transfer: err is nil if every block arrived (some may
	// have been rejected), else why the push broke off.
	Finish(transferID string, accepted, rejected int, err error)
}

// ErrUnreachable is returned (wrapped) when the receiver cannot be reached.
var ErrUnreachable = errors.New("transfer receiver unreachable")
