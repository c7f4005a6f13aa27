package transfer

import (
	"context"
	"fmt"
	"iter"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/batonllm/baton/transfer/kvblock"
)

// InMem is an in-memory network of receivers, for tests: receivers listen
// on made-up addresses and transports push to them without sockets. It
// behaves like the gRPC transport: blocks are copied as a wire would copy
// them, verified by the same code, and subject to the same fault hooks.
type InMem struct {
	mu        sync.RWMutex
	listeners map[string]*inmemListener
}

type inmemListener struct{ recv Receiver }

// NewInMem returns an empty network.
func NewInMem() *InMem {
	return &InMem{listeners: make(map[string]*inmemListener)}
}

// Listen makes recv reachable at addr until close is called (close is
// idempotent). Listening on an address in use panics.
func (n *InMem) Listen(addr string, recv Receiver) (close func()) {
	l := &inmemListener{recv: recv}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.listeners[addr]; ok {
		panic(fmt.Sprintf("transfer: in-memory address %q already in use", addr))
	}
	n.listeners[addr] = l
	return func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		if n.listeners[addr] == l {
			delete(n.listeners, addr)
		}
	}
}

func (n *InMem) lookup(addr string) (Receiver, error) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	l, ok := n.listeners[addr]
	if !ok {
		return nil, fmt.Errorf("%w: nothing listens on %q", ErrUnreachable, addr)
	}
	return l.recv, nil
}

// Transport returns a sending transport on the network. Of the options,
// only WithFault and WithDelay have an effect.
func (n *InMem) Transport(opts ...Option) Transport {
	return &inmemTransport{net: n, o: buildOptions(opts)}
}

type inmemTransport struct {
	net    *InMem
	o      options
	closed atomic.Bool
}

func (t *inmemTransport) receiver(addr string) (Receiver, error) {
	if t.closed.Load() {
		return nil, ErrClosed
	}
	return t.net.lookup(addr)
}

func (t *inmemTransport) Has(ctx context.Context, addr string, keys []uint64) ([]bool, error) {
	recv, err := t.receiver(addr)
	if err != nil {
		return nil, fmt.Errorf("has at %s: %w", addr, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("has at %s: %w", addr, err)
	}
	return recv.Has(keys), nil
}

func (t *inmemTransport) Push(ctx context.Context, addr, transferID string, blocks []Block) (PushStats, error) {
	if err := checkBlocks(transferID, blocks); err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	return t.push(ctx, addr, transferID, slices.Values(blocks))
}

// PushFill implements FillPusher, filling one buffer block after block.
func (t *inmemTransport) PushFill(ctx context.Context, addr, transferID string, keys []uint64, size int, fill FillFunc) (PushStats, error) {
	if err := checkFill(transferID, keys, size); err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	return t.push(ctx, addr, transferID, filled(keys, make([]byte, max(size, 0)), fill))
}

// push delivers blocks; a block's Data need only stay valid until the next
// block is asked for (the assembler copies it).
func (t *inmemTransport) push(ctx context.Context, addr, transferID string, blocks iter.Seq[Block]) (PushStats, error) {
	recv, err := t.receiver(addr)
	if err == nil {
		err = ctx.Err()
	}
	if err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	a := newAssembler(recv, DefaultMaxBlockBytes)
	a.id = transferID
	var stats PushStats
	for b := range blocks {
		if t.o.delay != nil {
			err = sleep(ctx, t.o.delay(b.Key))
		}
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			a.finish(err)
			return stats, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
		}
		crc := kvblock.Checksum(b.Data)
		data := t.o.faulted(b)
		a.begin(b.Key, uint32(len(b.Data)), crc)
		if err := a.write(data); err != nil { // copies, as a wire would
			a.finish(err)
			return stats, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
		}
		stats.Bytes += int64(len(data))
	}
	a.finish(nil)
	stats.Accepted, stats.Rejected = a.accepted, a.rejected
	return stats, nil
}

// Close implements Transport; it is idempotent.
func (t *inmemTransport) Close() error {
	t.closed.Store(true)
	return nil
}

var (
	_ Transport  = (*inmemTransport)(nil)
	_ FillPusher = (*inmemTransport)(nil)
)
