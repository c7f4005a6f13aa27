package transfer

import (
	"context"
	"errors"
	"fmt"
	"iter"
)

// FillFunc writes the payload of block key into dst, as kvblock.Fill
// does; len(dst) is the block size. It must not retain dst.
type FillFunc func(dst []byte, key uint64)

// FillPusher is what a Transport may also implement (an optional
// interface: Transport does not require it; both of this package's
// transports do): a push whose payloads are written just before they are
// sent, into one buffer of the transport's, so a push holds one block's
// payload at a time instead of all of them. A prefill worker pushing the
// hundreds of blocks of a long prompt, for hundreds of prompts at once,
// would otherwise hold every payload of every push in memory.
type FillPusher interface {
	// PushFill pushes the blocks of keys, size bytes each, as Push does,
	// calling fill for each block, in order, on the caller's goroutine.
	PushFill(ctx context.Context, addr, transferID string, keys []uint64, size int, fill FillFunc) (PushStats, error)
}

// PushFill pushes the blocks of keys, size bytes each, over tr: with tr's
// PushFill when it is a FillPusher, else with Push, every payload written
// first.
func PushFill(ctx context.Context, tr Transport, addr, transferID string, keys []uint64, size int, fill FillFunc) (PushStats, error) {
	if fp, ok := tr.(FillPusher); ok {
		return fp.PushFill(ctx, addr, transferID, keys, size, fill)
	}
	blocks := make([]Block, len(keys))
	for i, k := range keys {
		blocks[i] = Block{Key: k, Data: make([]byte, size)}
		fill(blocks[i].Data, k)
	}
	return tr.Push(ctx, addr, transferID, blocks)
}

// checkFill rejects what PushFill cannot carry, as checkBlocks does.
func checkFill(transferID string, keys []uint64, size int) error {
	if transferID == "" {
		return errors.New("empty transfer id")
	}
	if len(keys) > 0 && (size <= 0 || int64(size) > 1<<32-1) {
		return fmt.Errorf("block size %d out of range [1, 4 GiB)", size)
	}
	return nil
}

// filled yields the blocks of keys, each filled into buf just before it is
// yielded: a block's Data is valid until the next one is asked for.
func filled(keys []uint64, buf []byte, fill FillFunc) iter.Seq[Block] {
	return func(yield func(Block) bool) {
		for _, k := range keys {
			fill(buf, k)
			if !yield(Block{Key: k, Data: buf}) {
				return
			}
		}
	}
}
