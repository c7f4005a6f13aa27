package transfer

import (
	"context"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
)

// TestGRPCReconnectsSoonAfterTheReceiverReturns: a receiver that died (a
// call to it failed) and is back on its address takes calls again within
// a fraction of a second, not after gRPC's default reconnection backoff
// (1 s after one failure, growing to 2 min), during which every push to
// a decode worker that is back would fail.
func TestGRPCReconnectsSoonAfterTheReceiverReturns(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	serve := func(l net.Listener) func() {
		g := grpc.NewServer(ServerOptions()...)
		NewGRPCServer(newRecorder()).Register(g)
		done := make(chan struct{})
		go func() {
			defer close(done)
			g.Serve(l)
		}()
		return func() { g.Stop(); <-done }
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	stop := serve(l)
	tr := NewGRPC()
	defer tr.Close()
	keys := []uint64{1, 2, 3}
	if _, err := tr.Has(ctx, addr, keys); err != nil {
		t.Fatalf("Has: %v", err)
	}
	stop() // the receiver dies
	// Until an attempt to reconnect has failed.
	tr.mu.Lock()
	cc := tr.conns[addr]
	tr.mu.Unlock()
	for st := cc.GetState(); st != connectivity.TransientFailure; st = cc.GetState() {
		if st == connectivity.Idle {
			cc.Connect()
		}
		if !cc.WaitForStateChange(ctx, st) {
			t.Fatalf("the connection is still %s", st)
		}
	}
	if _, err := tr.Has(ctx, addr, keys); err == nil {
		t.Fatal("Has succeeded with nothing listening")
	}
	if l, err = net.Listen("tcp", addr); err != nil {
		t.Fatalf("listening again on %s: %v", addr, err)
	}
	defer serve(l)()
	back := time.Now()
	for st := cc.GetState(); st != connectivity.Ready; st = cc.GetState() {
		if st == connectivity.Idle {
			cc.Connect()
		}
		if !cc.WaitForStateChange(ctx, st) {
			t.Fatalf("the connection is still %s %s after the receiver came back", st, time.Since(back))
		}
	}
	if took := time.Since(back); took > 500*time.Millisecond {
		t.Errorf("the connection was down for %s after the receiver came back, want under 500ms", took.Round(time.Millisecond))
	}
	if _, err := tr.Has(ctx, addr, keys); err != nil {
		t.Errorf("Has once the connection is back: %v", err)
	}
}
