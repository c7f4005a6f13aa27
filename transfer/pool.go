package transfer

import (
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
)

// Tiers of dirtyPool: powers of two from 256 B to 8 MiB.
const (
	minPoolShift = 8
	maxPoolShift = 23
)

// dirtyPool is a mem.BufferPool of power-of-two sized buffers that, unlike
// gRPC's default pool, does not zero the buffers it hands out: every user
// here overwrites a buffer whole before reading it (a message being
// encoded, a frame being read from the socket), so zeroing only burns
// memory bandwidth on the bulk path. Buffers larger than the largest tier
// are allocated and left to the garbage collector.
type dirtyPool struct {
	tiers [maxPoolShift - minPoolShift + 1]sync.Pool // of *[]byte
}

// kvPool is the pool of the sender's messages and, through ServerOptions,
// of the receiving server's frames.
var kvPool = new(dirtyPool)

var _ mem.BufferPool = (*dirtyPool)(nil)

// tier returns the index of the smallest tier that holds n bytes, or -1.
func tier(n int) int {
	shift := minPoolShift
	if n > 1<<minPoolShift {
		shift = bits.Len(uint(n - 1))
	}
	if shift > maxPoolShift {
		return -1
	}
	return shift - minPoolShift
}

// Get returns a buffer of length n with unspecified contents.
func (p *dirtyPool) Get(n int) *[]byte {
	i := tier(n)
	if i < 0 {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.tiers[i].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<(i+minPoolShift))
	return &b
}

// Put returns a buffer obtained from Get to the pool.
func (p *dirtyPool) Put(b *[]byte) {
	c := cap(*b)
	i := tier(c)
	if i < 0 || c != 1<<(i+minPoolShift) {
		return // not one of ours
	}
	*b = (*b)[:c]
	p.tiers[i].Put(b)
}
