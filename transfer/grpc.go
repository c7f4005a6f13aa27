package transfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer/kvblock"
)

// GRPCTransport is the sending side over gRPC (the KVTransfer service). It
// keeps one connection per receiver address, made on first use and kept
// until Close.
//
// Flow control is HTTP/2's: a push goes as fast as the receiver's stream
// and connection windows let it, so those windows, which the receiving
// server advertises, set its throughput; see ServerOptions.
type GRPCTransport struct {
	o options

	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	closed bool
}

// NewGRPC returns a gRPC transport. It does not connect.
func NewGRPC(opts ...Option) *GRPCTransport {
	return &GRPCTransport{o: buildOptions(opts), conns: make(map[string]*grpc.ClientConn)}
}

// reconnectBackoff paces the attempts to reconnect to a receiver whose
// connection failed; until one succeeds, every call to it fails at once.
// With gRPC's default (1 s, growing by 1.6 to 2 min) a decode worker back
// from a restart was refused pushes for seconds, minutes after a long
// absence, while the scheduler, seeing it healthy, sent it requests whose
// blocks then never came. A receiver that stays away costs a dial a
// second. MinConnectTimeout is gRPC's default.
var reconnectBackoff = backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}

func (t *GRPCTransport) client(addr string) (workerpb.KVTransferClient, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, ErrClosed
	}
	if cc, ok := t.conns[addr]; ok {
		return workerpb.NewKVTransferClient(cc), nil
	}
	dialOpts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(t.o.creds),
		grpc.WithKeepaliveParams(t.o.keepalive),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: reconnectBackoff, MinConnectTimeout: 20 * time.Second}),
	}, t.o.extra...)
	cc, err := grpc.NewClient(addr, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	t.conns[addr] = cc
	return workerpb.NewKVTransferClient(cc), nil
}

// Has implements Transport.
func (t *GRPCTransport) Has(ctx context.Context, addr string, keys []uint64) ([]bool, error) {
	c, err := t.client(addr)
	if err != nil {
		return nil, fmt.Errorf("has at %s: %w", addr, err)
	}
	res, err := c.Has(ctx, &workerpb.HasRequest{Keys: keys})
	if err != nil {
		return nil, fmt.Errorf("has at %s: %w", addr, rpcError(ctx, err))
	}
	if len(res.Held) != len(keys) {
		return nil, fmt.Errorf("has at %s: %d answers for %d keys", addr, len(res.Held), len(keys))
	}
	return res.Held, nil
}

// Push implements Transport. Each block goes as chunks of at most the
// chunk size (WithChunkBytes), the first carrying its key, size and
// CRC-32C.
//
// With kvCodec, a block of at most maxEncodeAhead bytes is encoded whole
// before its first chunk is sent (encodeBlock): its data is copied once
// into pooled buffers, which gRPC owns once sent and frees when written,
// and checksummed as it is copied. The caller's bytes are read once and
// never referenced by gRPC, so nothing of them is retained after Push
// returns, however the push ends.
func (t *GRPCTransport) Push(ctx context.Context, addr, transferID string, blocks []Block) (PushStats, error) {
	if err := checkBlocks(transferID, blocks); err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	c, err := t.client(addr)
	if err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	stats, err := t.push(ctx, c, transferID, slices.Values(blocks))
	if err != nil {
		return stats, fmt.Errorf("push %s to %s: %w", transferID, addr, rpcError(ctx, err))
	}
	return stats, nil
}

// PushFill implements FillPusher: blocks are filled one at a time into a
// pooled buffer, which the push copies from as it sends (as it does the
// caller's bytes in Push).
func (t *GRPCTransport) PushFill(ctx context.Context, addr, transferID string, keys []uint64, size int, fill FillFunc) (PushStats, error) {
	if err := checkFill(transferID, keys, size); err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	c, err := t.client(addr)
	if err != nil {
		return PushStats{}, fmt.Errorf("push %s to %s: %w", transferID, addr, err)
	}
	buf := kvPool.Get(max(size, 0))
	defer kvPool.Put(buf)
	stats, err := t.push(ctx, c, transferID, filled(keys, *buf, fill))
	if err != nil {
		return stats, fmt.Errorf("push %s to %s: %w", transferID, addr, rpcError(ctx, err))
	}
	return stats, nil
}

// maxEncodeAhead bounds the block a push encodes whole before sending it;
// a larger one is checksummed first, then copied chunk by chunk as sent.
const maxEncodeAhead = 16 << 20

// push sends blocks; a block's Data need only stay valid until the next
// block is asked for, as every path copies it before then.
func (t *GRPCTransport) push(ctx context.Context, c workerpb.KVTransferClient, transferID string, blocks iter.Seq[Block]) (PushStats, error) {
	// Cancelling on return ends the stream on every path, so gRPC does not
	// leak it when we give up before CloseAndRecv.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var callOpts []grpc.CallOption
	if t.o.codec {
		callOpts = append(callOpts, grpc.CallContentSubtype(codecName))
	}
	st, err := c.Push(sctx, callOpts...)
	if err != nil {
		return PushStats{}, err
	}
	var (
		stats PushStats
		out   workerpb.BlockChunk // with the proto codec
		raw   chunkOut            // with kvCodec
		ready []chunkReady        // with kvCodec: a block's chunks, encoded
	)
	send := func(id string, key uint64, size, crc uint32, data []byte) error {
		if t.o.codec {
			raw = chunkOut{transferID: id, key: key, size: size, crc: crc, data: data}
			return st.SendMsg(&raw)
		}
		out.TransferId, out.Key, out.Size, out.Crc32C, out.Data = id, key, size, crc, data
		return st.SendMsg(&out)
	}
	// The transfer id goes alone, first, so the receiver knows the
	// transfer (and will Finish it) even if the push stalls before its
	// first block.
	if err := send(transferID, 0, 0, 0, nil); err != nil {
		return stats, sendError(st, err)
	}
	for b := range blocks {
		if t.o.delay != nil {
			if err := sleep(ctx, t.o.delay(b.Key)); err != nil {
				return stats, err
			}
		}
		if t.o.codec && t.o.fault == nil && len(b.Data) <= maxEncodeAhead {
			ready = encodeBlock(ready[:0], b.Key, b.Data, t.o.chunk)
			for i := range ready {
				if err := st.SendMsg(&ready[i]); err != nil {
					for _, r := range ready[i+1:] { // never handed to gRPC
						kvPool.Put(r.buf)
					}
					return stats, sendError(st, err)
				}
				stats.Bytes += int64(ready[i].n)
			}
			clear(ready)
			continue
		}
		crc := kvblock.Checksum(b.Data)
		data := t.o.faulted(b)
		size := uint32(len(b.Data))
		for first := true; first || len(data) > 0; first = false {
			n := min(len(data), t.o.chunk)
			var err error
			if first {
				err = send("", b.Key, size, crc, data[:n])
			} else {
				err = send("", 0, 0, 0, data[:n])
			}
			if err != nil {
				return stats, sendError(st, err)
			}
			stats.Bytes += int64(n)
			data = data[n:]
		}
	}
	res, err := st.CloseAndRecv()
	if err != nil {
		return stats, err
	}
	stats.Accepted, stats.Rejected = int(res.BlocksAccepted), int(res.BlocksRejected)
	return stats, nil
}

// sendError turns a failed send into the push's error: io.EOF means the
// stream ended, and the status the server ended it with says why.
func sendError(st grpc.ClientStreamingClient[workerpb.BlockChunk, workerpb.PushResult], err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	if _, err := st.CloseAndRecv(); err != nil {
		return err
	}
	return errors.New("stream ended before the push was sent")
}

// rpcError makes a gRPC error speak this package's language: the
// context's own error if ctx is done, context errors for deadline and
// cancellation statuses, ErrUnreachable for an unavailable receiver.
func rpcError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	switch status.Code(err) {
	case codes.DeadlineExceeded:
		return fmt.Errorf("%w (%v)", context.DeadlineExceeded, err)
	case codes.Canceled:
		return fmt.Errorf("%w (%v)", context.Canceled, err)
	case codes.Unavailable:
		return fmt.Errorf("%w: %v", ErrUnreachable, err)
	}
	return err
}

// Close closes every connection. It is idempotent; the transport's methods
// return ErrClosed afterwards.
func (t *GRPCTransport) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	var errs []error
	for addr, cc := range t.conns {
		if err := cc.Close(); err != nil {
			errs = append(errs, fmt.Errorf("closing connection to %s: %w", addr, err))
		}
	}
	t.conns = nil
	return errors.Join(errs...)
}

var (
	_ Transport  = (*GRPCTransport)(nil)
	_ FillPusher = (*GRPCTransport)(nil)
)
