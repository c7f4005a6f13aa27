package transfer

import (
	"errors"
	"fmt"
	"sync"

	"github.com/batonllm/baton/transfer/kvblock"
)

// DefaultMaxBlockBytes bounds the size a receiver accepts for one block
// (see WithMaxBlockBytes). A real Llama-3.1-70B block of 16 tokens is
// 5 MiB of KV; 64 MiB leaves room for larger models and block sizes while
// keeping a corrupt or hostile header from making a receiver allocate
// without bound.
const DefaultMaxBlockBytes = 64 << 20

// errOrphanData is a protocol error: payload bytes that belong to no block
// (no first chunk announced a block before them).
var errOrphanData = errors.New("block data before any block header")

// bufPool holds block reassembly buffers across streams, so a steady flow
// of pushes allocates nothing per block or per push.
var bufPool sync.Pool // of *[]byte

// An assembler reassembles the blocks of one push from their chunks,
// verifies each block and hands the good ones to the receiver. Both
// transports receive through it, so they verify alike. It is used by one
// goroutine.
//
// A block ends when the next block's first chunk arrives or the stream
// ends, not when its announced size is reached: a block that is longer
// than announced must be rejected, not accepted with its tail mistaken for
// the next block.
type assembler struct {
	recv     Receiver
	id       string
	maxBlock int

	buf *[]byte // reassembly buffer, from bufPool

	open    bool   // a block is in progress
	discard bool   // its announced size exceeds maxBlock: count, do not keep
	key     uint64 // the block in progress
	size    int
	crc     uint32
	n       int    // bytes received of it, possibly more than size
	sum     uint32 // CRC-32C of the bytes kept so far, buf[:n] while n <= size

	accepted, rejected int
	bytes              int64
	finished           bool
}

func newAssembler(recv Receiver, maxBlock int) *assembler {
	if maxBlock <= 0 {
		maxBlock = DefaultMaxBlockBytes
	}
	a := &assembler{recv: recv, maxBlock: maxBlock}
	if b, ok := bufPool.Get().(*[]byte); ok {
		a.buf = b
	} else {
		a.buf = new([]byte)
	}
	return a
}

// begin starts a block announced by its first chunk, ending the one in
// progress.
func (a *assembler) begin(key uint64, size, crc uint32) {
	a.endBlock()
	a.open, a.key, a.size, a.crc, a.n, a.sum = true, key, int(size), crc, 0, 0
	a.discard = int64(size) > int64(a.maxBlock)
	if !a.discard && cap(*a.buf) < a.size {
		*a.buf = make([]byte, a.size)
	}
}

// reserve accounts for n more payload bytes of the block in progress and
// returns where to copy them, or nil if they are to be dropped (the block
// is oversized or already longer than announced, and will be rejected).
// The caller copies them there and passes them to sum, in order.
func (a *assembler) reserve(n int) ([]byte, error) {
	if n == 0 {
		return nil, nil
	}
	if !a.open {
		return nil, errOrphanData
	}
	a.bytes += int64(n)
	off := a.n
	a.n += n
	if a.discard || a.n > a.size {
		return nil, nil
	}
	return (*a.buf)[off:a.n], nil
}

// sumPiece is the most bytes copied before they are checksummed: small
// enough that they are still in cache when the checksum reads them.
const sumPiece = 32 << 10

// summed adds bytes just copied into the block in progress (a slice
// returned by reserve) to its checksum, so that endBlock need not read
// the block again to verify it.
func (a *assembler) summed(p []byte) { a.sum = kvblock.UpdateChecksum(a.sum, p) }

// write copies p into the block in progress.
func (a *assembler) write(p []byte) error {
	dst, err := a.reserve(len(p))
	for len(dst) > 0 {
		n := copy(dst[:min(len(dst), sumPiece)], p)
		a.summed(dst[:n])
		dst, p = dst[n:], p[n:]
	}
	return err
}

// endBlock verifies the block in progress, if any, and hands it over.
func (a *assembler) endBlock() {
	if !a.open {
		return
	}
	a.open = false
	if a.discard || a.n != a.size {
		a.rejected++
		return
	}
	data := (*a.buf)[:a.size]
	// The checksum was computed as the bytes were copied in (summed).
	if err := kvblock.VerifySum(a.key, data, a.size, a.crc, a.sum); err != nil {
		a.rejected++
		return
	}
	a.recv.Accept(a.id, a.key, data)
	a.accepted++
}

// finish ends the push: with err == nil the last block is verified, else
// it is dropped uncounted (it may be incomplete). It calls the receiver's
// Finish, once, and releases the buffer.
func (a *assembler) finish(err error) {
	if a.finished {
		return
	}
	a.finished = true
	if err == nil {
		a.endBlock()
	}
	a.open = false
	a.recv.Finish(a.id, a.accepted, a.rejected, err)
	a.release()
}

// release returns the buffer to the pool; the assembler is not used again.
func (a *assembler) release() {
	if a.buf != nil {
		bufPool.Put(a.buf)
		a.buf = nil
	}
}

// checkBlocks rejects what a push cannot carry: a block of no bytes (its
// first chunk could not be told from a continuation) or of more than
// 4 GiB - 1 (the wire's size field).
func checkBlocks(transferID string, blocks []Block) error {
	if transferID == "" {
		return errors.New("empty transfer id")
	}
	for i, b := range blocks {
		if len(b.Data) == 0 || int64(len(b.Data)) > 1<<32-1 {
			return fmt.Errorf("block %d (key %x): size %d out of range [1, 4 GiB)", i, b.Key, len(b.Data))
		}
	}
	return nil
}
