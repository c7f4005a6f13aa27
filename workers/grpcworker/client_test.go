package grpcworker

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeWorker is a workerpb.WorkerServer whose Generate is set per test.
type fakeWorker struct {
	workerpb.UnimplementedWorkerServer
	generate func(*workerpb.GenerateRequest, workerpb.Worker_GenerateServer) error
	info     *workerpb.InfoResponse
	prefill  func(context.Context, *workerpb.PrefillRequest) (*workerpb.PrefillResult, error)
	decode   func(*workerpb.DecodeRequest, workerpb.Worker_DecodeServer) error
}

func (f *fakeWorker) Prefill(ctx context.Context, req *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
	return f.prefill(ctx, req)
}

func (f *fakeWorker) Decode(req *workerpb.DecodeRequest, st workerpb.Worker_DecodeServer) error {
	return f.decode(req, st)
}

func (f *fakeWorker) Generate(req *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
	return f.generate(req, st)
}

func (f *fakeWorker) Info(context.Context, *workerpb.InfoRequest) (*workerpb.InfoResponse, error) {
	return f.info, nil
}

type testServer struct {
	addr   string
	health *health.Server
	srv    *grpc.Server
}

// startServer serves w and a health service reporting SERVING on a
// loopback listener, stopped at the end of the test.
func startServer(t *testing.T, w *fakeWorker) *testServer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.KeepaliveEnforcementPolicy(KeepaliveEnforcement))
	workerpb.RegisterWorkerServer(srv, w)
	hs := health.NewServer()
	hs.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return &testServer{addr: lis.Addr().String(), health: hs, srv: srv}
}

func dial(t *testing.T, addr string) *Client {
	t.Helper()
	c, err := Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func tokens(text string, n int32) *workerpb.GenerateEvent {
	return &workerpb.GenerateEvent{Event: &workerpb.GenerateEvent_Tokens{Tokens: &workerpb.Tokens{Text: text, Count: n}}}
}

func TestGenerateStreamsEvents(t *testing.T) {
	var gotReq *workerpb.GenerateRequest
	w := &fakeWorker{generate: func(req *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
		gotReq = req
		for _, ev := range []*workerpb.GenerateEvent{
			tokens("Hel", 1),
			tokens("lo, world", 3),
			{Event: &workerpb.GenerateEvent_Final{Final: &workerpb.Final{
				FinishReason: "stop", PromptTokens: 12, CachedTokens: 8, CompletionTokens: 4,
			}}},
		} {
			if err := st.Send(ev); err != nil {
				return err
			}
		}
		return nil
	}}
	c := dial(t, startServer(t, w).addr)

	req := &engine.Request{ID: "r1", Model: "m", Tenant: "t", Prompt: "hi", MaxTokens: 16, Stop: []string{"\n"}}
	s, err := c.Generate(testContext(t), req)
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer s.Close()

	var got []engine.Event
	for {
		ev, err := s.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		got = append(got, ev)
	}
	want := []engine.Event{
		{Text: "Hel", Tokens: 1},
		{Text: "lo, world", Tokens: 3},
		{Final: &engine.Final{FinishReason: "stop", PromptTokens: 12, CachedTokens: 8, CompletionTokens: 4}},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if _, err := s.Recv(); err != io.EOF {
		t.Errorf("Recv after EOF = %v, want io.EOF", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}

	wantReq := &workerpb.GenerateRequest{RequestId: "r1", Model: "m", Tenant: "t", Prompt: "hi", MaxTokens: 16, Stop: []string{"\n"}}
	if gotReq.GetRequestId() != wantReq.RequestId || gotReq.GetModel() != wantReq.Model ||
		gotReq.GetTenant() != wantReq.Tenant || gotReq.GetPrompt() != wantReq.Prompt ||
		gotReq.GetMaxTokens() != wantReq.MaxTokens || !cmp.Equal(gotReq.GetStop(), wantReq.Stop) {
		t.Errorf("worker got request %v, want %v", gotReq, wantReq)
	}
}

func TestGenerateErrorsBeforeFirstEvent(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want error
		code codes.Code
	}{
		{"unavailable", status.Error(codes.Unavailable, "draining"), engine.ErrUnavailable, codes.Unavailable},
		{"resource exhausted", status.Error(codes.ResourceExhausted, "queue full"), engine.ErrUnavailable, codes.ResourceExhausted},
		{"unknown model", status.Error(codes.NotFound, "no model x"), ErrUnknownModel, codes.NotFound},
		{"invalid", status.Error(codes.InvalidArgument, "empty prompt"), ErrInvalid, codes.InvalidArgument},
		{"deadline", status.Error(codes.DeadlineExceeded, "too slow"), context.DeadlineExceeded, codes.DeadlineExceeded},
		{"canceled", status.Error(codes.Canceled, "gone"), context.Canceled, codes.Canceled},
		{"no events", nil, engine.ErrUnavailable, codes.Unknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &fakeWorker{generate: func(*workerpb.GenerateRequest, workerpb.Worker_GenerateServer) error {
				return tt.err
			}}
			c := dial(t, startServer(t, w).addr)
			s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "p"})
			if err == nil {
				s.Close()
				t.Fatal("Generate succeeded, want an error from Generate itself")
			}
			if !errors.Is(err, tt.want) {
				t.Errorf("Generate error = %v, want it to wrap %v", err, tt.want)
			}
			if tt.err != nil {
				if got := status.Code(err); got != tt.code {
					t.Errorf("status.Code(err) = %v, want %v (status kept in the chain)", got, tt.code)
				}
			}
		})
	}
}

func TestGenerateErrorAfterFirstEventComesFromRecv(t *testing.T) {
	w := &fakeWorker{generate: func(_ *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
		if err := st.Send(tokens("a", 1)); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "crashed")
	}}
	c := dial(t, startServer(t, w).addr)
	s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "p"})
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer s.Close()
	if ev, err := s.Recv(); err != nil || ev.Text != "a" {
		t.Fatalf("first Recv = %+v, %v; want text a", ev, err)
	}
	if _, err := s.Recv(); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("second Recv error = %v, want ErrUnavailable", err)
	}
}

func TestGenerateStreamEndsWithoutFinal(t *testing.T) {
	w := &fakeWorker{generate: func(_ *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
		return st.Send(tokens("a", 1))
	}}
	c := dial(t, startServer(t, w).addr)
	s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "p"})
	if err != nil {
		t.Fatalf("Generate: %v", err)
	}
	defer s.Close()
	if _, err := s.Recv(); err != nil {
		t.Fatalf("first Recv: %v", err)
	}
	if _, err := s.Recv(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("Recv error = %v, want io.ErrUnexpectedEOF", err)
	}
}

// TestGenerateWaitsForFirstEvent checks that Generate returns only once the
// worker has sent its first event.
func TestGenerateWaitsForFirstEvent(t *testing.T) {
	release := make(chan struct{})
	w := &fakeWorker{generate: func(_ *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
		select {
		case <-release:
		case <-st.Context().Done():
			return st.Context().Err()
		}
		return st.Send(&workerpb.GenerateEvent{Event: &workerpb.GenerateEvent_Final{Final: &workerpb.Final{FinishReason: "length"}}})
	}}
	c := dial(t, startServer(t, w).addr)

	type result struct {
		s   engine.Stream
		err error
	}
	done := make(chan result, 1)
	go func() {
		s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "p"})
		done <- result{s, err}
	}()
	select {
	case r := <-done:
		if r.s != nil {
			r.s.Close()
		}
		t.Fatalf("Generate returned (%v) before the worker's first event", r.err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	r := <-done
	if r.err != nil {
		t.Fatalf("Generate: %v", r.err)
	}
	defer r.s.Close()
	ev, err := r.s.Recv()
	if err != nil || ev.Final == nil || ev.Final.FinishReason != "length" {
		t.Errorf("Recv = %+v, %v; want the buffered final event", ev, err)
	}
}

func TestGenerateConnectionRefused(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()

	c := dial(t, addr)
	s, err := c.Generate(testContext(t), &engine.Request{Model: "m", Prompt: "p"})
	if err == nil {
		s.Close()
		t.Fatal("Generate succeeded against a closed port")
	}
	if !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Generate error = %v, want ErrUnavailable", err)
	}
}

// A worker that accepts connections and never answers (a hung process,
// a black-holing proxy) fails a call once the connection attempt times
// out, so that the front end can retry elsewhere long before the request's
// deadline.
func TestGenerateHungWorkerFailsAtConnectTimeout(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c) // held open, never read
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})

	c := dial(t, lis.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 4*connectTimeout)
	defer cancel()
	start := time.Now()
	s, err := c.Generate(ctx, &engine.Request{Model: "m", Prompt: "p"})
	if err == nil {
		s.Close()
		t.Fatal("Generate succeeded against a worker that never answers")
	}
	if !errors.Is(err, engine.ErrUnavailable) || ctx.Err() != nil {
		t.Errorf("Generate error = %v after %s, want ErrUnavailable before the call's deadline", err, time.Since(start))
	}
}

func TestCancelPropagatesToWorker(t *testing.T) {
	for _, how := range []string{"context", "close"} {
		t.Run(how, func(t *testing.T) {
			serverDone := make(chan error, 1)
			w := &fakeWorker{generate: func(_ *workerpb.GenerateRequest, st workerpb.Worker_GenerateServer) error {
				if err := st.Send(tokens("a", 1)); err != nil {
					return err
				}
				select {
				case <-st.Context().Done():
					serverDone <- st.Context().Err()
				case <-time.After(5 * time.Second):
					serverDone <- errors.New("stream context never done")
				}
				return nil
			}}
			c := dial(t, startServer(t, w).addr)
			ctx, cancel := context.WithCancel(testContext(t))
			defer cancel()
			s, err := c.Generate(ctx, &engine.Request{Model: "m", Prompt: "p"})
			if err != nil {
				t.Fatalf("Generate: %v", err)
			}
			defer s.Close()
			if _, err := s.Recv(); err != nil {
				t.Fatalf("Recv: %v", err)
			}
			if how == "context" {
				cancel()
			} else {
				s.Close()
			}
			if err := <-serverDone; !errors.Is(err, context.Canceled) {
				t.Errorf("worker saw %v, want context.Canceled", err)
			}
			if how == "context" {
				if _, err := s.Recv(); !errors.Is(err, context.Canceled) {
					t.Errorf("Recv after cancel = %v, want context.Canceled", err)
				}
			}
		})
	}
}

func TestCheck(t *testing.T) {
	ts := startServer(t, &fakeWorker{})
	c := dial(t, ts.addr)
	ctx := testContext(t)

	if err := c.Check(ctx); err != nil {
		t.Errorf("Check while SERVING = %v, want nil", err)
	}
	ts.health.SetServingStatus(ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
	if err := c.Check(ctx); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Check while NOT_SERVING = %v, want ErrUnavailable", err)
	}
	ts.srv.Stop()
	if err := c.Check(ctx); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Check after the server stopped = %v, want ErrUnavailable", err)
	}
}

func TestCheckUnknownService(t *testing.T) {
	// A server with a health service that knows nothing of ServiceName
	// answers NotFound.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	c := dial(t, lis.Addr().String())
	if err := c.Check(testContext(t)); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Check of an unregistered service = %v, want ErrUnavailable", err)
	}
}

func TestInfo(t *testing.T) {
	want := &workerpb.InfoResponse{Name: "w0", Models: []string{"m"}, Role: workerpb.Role_ROLE_BOTH, BlockChars: 64}
	c := dial(t, startServer(t, &fakeWorker{info: want}).addr)
	got, err := c.Info(testContext(t))
	if err != nil {
		t.Fatalf("Info: %v", err)
	}
	if got.GetName() != "w0" || got.GetRole() != workerpb.Role_ROLE_BOTH || got.GetBlockChars() != 64 || !cmp.Equal(got.GetModels(), want.Models) {
		t.Errorf("Info = %v, want %v", got, want)
	}
}

func TestCloseIdempotent(t *testing.T) {
	c, err := Dial("127.0.0.1:1")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.Close()
		}()
	}
	wg.Wait()
	if err := c.Close(); err != nil {
		t.Errorf("Close after Close = %v, want the first result (nil)", err)
	}
}
