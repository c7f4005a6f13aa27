package transfer

import (
	"context"
	"errors"
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
)

// GRPCServer is the receiving side over gRPC: it serves the KVTransfer
// service for a Receiver.
type GRPCServer struct {
	workerpb.UnimplementedKVTransferServer
	recv     Receiver
	maxBlock int
}

// ServerOption configures NewGRPCServer.
type ServerOption func(*GRPCServer)

// WithMaxBlockBytes bounds the announced size of a block the server
// buffers (default DefaultMaxBlockBytes); a larger block is read, dropped
// and counted as rejected, never allocated.
func WithMaxBlockBytes(n int) ServerOption {
	return func(s *GRPCServer) { s.maxBlock = n }
}

// NewGRPCServer returns a KVTransfer server that hands verified blocks to
// recv.
func NewGRPCServer(recv Receiver, opts ...ServerOption) *GRPCServer {
	s := &GRPCServer{recv: recv, maxBlock: DefaultMaxBlockBytes}
	for _, opt := range opts {
		opt(s)
	}
	if s.maxBlock <= 0 {
		s.maxBlock = DefaultMaxBlockBytes
	}
	return s
}

// Register registers the KVTransfer service on g.
func (s *GRPCServer) Register(g *grpc.Server) { workerpb.RegisterKVTransferServer(g, s) }

// Window sizes a KVTransfer server should advertise (see ServerOptions).
const (
	// ServerStreamWindow is the per-stream receive window: how many bytes
	// one push may have in flight before the receiver acknowledges. 8 MiB
	// covers a 10 Gb/s link with a few ms of round trip.
	ServerStreamWindow = 8 << 20
	// ServerConnWindow is the per-connection receive window, shared by the
	// concurrent pushes from one sender: room for a few at full speed.
	ServerConnWindow = 32 << 20
	// ServerReadBufferBytes is the server's socket read buffer: larger
	// reads, fewer system calls, for a service that mostly receives bulk.
	ServerReadBufferBytes = 256 << 10
)

// ServerOptions returns the gRPC server options a server hosting
// KVTransfer should include. HTTP/2 flow control windows are advertised by
// the receiving side, so it is the server's windows, not the client's,
// that bound a push's throughput (a client's window options only govern
// what the client receives: here, a PushResult). gRPC's default window
// starts at 64 KiB and grows by BDP estimation, up to 16 MiB, over a few
// round trips; fixed large windows let a push run at full speed from its
// first byte on links with a real round trip. On loopback, where the
// round trip is microseconds, the two measure alike (BenchmarkPushTuning).
//
// The server also takes the buffers it reads frames into from a pool that
// does not zero them (gRPC's default pool does, for every 16 KiB frame):
// a frame's buffer is always filled whole from the socket before use.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(ServerStreamWindow),
		grpc.InitialConnWindowSize(ServerConnWindow),
		grpc.ReadBufferSize(ServerReadBufferBytes),
		experimental.BufferPool(kvPool),
	}
}

// Has implements workerpb.KVTransferServer.
func (s *GRPCServer) Has(_ context.Context, req *workerpb.HasRequest) (*workerpb.HasResponse, error) {
	return &workerpb.HasResponse{Held: s.recv.Has(req.Keys)}, nil
}

// Push implements workerpb.KVTransferServer. It calls the receiver's
// Finish exactly once per stream whose first message named the transfer:
// with nil once the sender has sent every chunk, or with the error that
// broke the stream off. A stream without a transfer id is refused.
func (s *GRPCServer) Push(st workerpb.KVTransfer_PushServer) error {
	a := newAssembler(s.recv, s.maxBlock)
	if usesKVCodec(st.Context()) {
		return s.pushKV(st, a)
	}
	return s.pushProto(st, a)
}

// pushKV receives with kvCodec, which decodes chunks straight into a.
func (s *GRPCServer) pushKV(st workerpb.KVTransfer_PushServer, a *assembler) error {
	in := chunkIn{a: a}
	for first := true; ; first = false {
		err := st.RecvMsg(&in)
		if first && a.id == "" {
			a.release()
			if err == nil {
				err = status.Error(codes.InvalidArgument, "first message carries no transfer id")
			}
			return refuse(err)
		}
		if err != nil {
			return s.end(st, a, err)
		}
	}
}

// pushProto receives BlockChunk messages decoded by the proto codec.
func (s *GRPCServer) pushProto(st workerpb.KVTransfer_PushServer, a *assembler) error {
	var m workerpb.BlockChunk
	for first := true; ; first = false {
		err := st.RecvMsg(&m)
		if err == nil && first {
			if m.TransferId == "" {
				a.release()
				return refuse(status.Error(codes.InvalidArgument, "first message carries no transfer id"))
			}
			a.id = m.TransferId
		}
		if err != nil {
			if first {
				a.release()
				return refuse(err)
			}
			return s.end(st, a, err)
		}
		if m.Size != 0 {
			a.begin(m.Key, m.Size, m.Crc32C)
		}
		if err := a.write(m.Data); err != nil {
			return s.end(st, a, err)
		}
	}
}

// refuse ends a stream that never named its transfer.
func refuse(err error) error {
	if errors.Is(err, io.EOF) {
		return status.Error(codes.InvalidArgument, "empty push stream")
	}
	return err
}

// end ends a push: io.EOF is the sender's end of the stream; any other
// error broke it off.
func (s *GRPCServer) end(st workerpb.KVTransfer_PushServer, a *assembler, err error) error {
	if !errors.Is(err, io.EOF) {
		if errors.Is(err, errOrphanData) {
			err = status.Error(codes.InvalidArgument, err.Error())
		}
		a.finish(err)
		return err
	}
	// Finish before answering, so that when the sender's Push returns the
	// receiver has seen the whole transfer.
	a.finish(nil)
	return st.SendAndClose(&workerpb.PushResult{
		BlocksAccepted: int32(a.accepted),
		BlocksRejected: int32(a.rejected),
		BytesReceived:  a.bytes,
	})
}

// usesKVCodec reports whether the call's content-subtype is kvCodec's.
func usesKVCodec(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	for _, ct := range md.Get("content-type") {
		if strings.HasSuffix(ct, "+"+codecName) || strings.Contains(ct, "+"+codecName+";") {
			return true
		}
	}
	return false
}

var _ workerpb.KVTransferServer = (*GRPCServer)(nil)
