package transfer

import (
	"net"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc"

	"github.com/batonllm/baton/transfer/kvblock"
)

func TestInMem(t *testing.T) {
	testTransport(t, func(t *testing.T, recv Receiver, opts ...Option) (Transport, string) {
		n := NewInMem()
		t.Cleanup(n.Listen("decode-0", recv))
		tr := n.Transport(opts...)
		t.Cleanup(func() { tr.Close() })
		return tr, "decode-0"
	})
}

func TestGRPC(t *testing.T) {
	testTransport(t, mkGRPC())
}

// TestGRPCProtoCodec runs the suite with the standard protobuf codec, as a
// sender that is not baton's would push.
func TestGRPCProtoCodec(t *testing.T) {
	testTransport(t, mkGRPC(WithProtoCodec()))
}

// mkGRPC serves a receiver on a loopback gRPC server.
func mkGRPC(base ...Option) mkTransport {
	return func(t *testing.T, recv Receiver, opts ...Option) (Transport, string) {
		t.Helper()
		addr := serveGRPC(t, recv, ServerOptions())
		tr := NewGRPC(append(base, opts...)...)
		t.Cleanup(func() { tr.Close() })
		return tr, addr
	}
}

// serveGRPC serves recv's KVTransfer on loopback until t ends.
func serveGRPC(t testing.TB, recv Receiver, gopts []grpc.ServerOption, opts ...ServerOption) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(gopts...)
	NewGRPCServer(recv, opts...).Register(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Serve(l)
	}()
	t.Cleanup(func() {
		g.Stop()
		<-done
	})
	return l.Addr().String()
}

// plainTransport hides a transport's PushFill.
type plainTransport struct{ Transport }

// PushFill falls back to Push for a transport that is no FillPusher.
func TestPushFillFallback(t *testing.T) {
	recv := newRecorder()
	n := NewInMem()
	t.Cleanup(n.Listen("decode-0", recv))
	tr := plainTransport{n.Transport()}
	blocks := makeBlocks(3, 4<<10, 4<<10)
	got, err := PushFill(t.Context(), tr, "decode-0", "f", keysOf(blocks), 4<<10, kvblock.Fill)
	if err != nil {
		t.Fatalf("PushFill: %v", err)
	}
	if want := (PushStats{Accepted: 2, Bytes: totalBytes(blocks)}); got != want {
		t.Errorf("PushFill = %+v, want %+v", got, want)
	}
	if diff := cmp.Diff(keysOf(blocks), recv.acceptedKeys("f")); diff != "" {
		t.Errorf("accepted keys (-want +got):\n%s", diff)
	}
	recv.check(t)
}
