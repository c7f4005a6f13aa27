package scheduler_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/httpengine"
)

// codeWorker answers every Generate with one gRPC status.
type codeWorker struct {
	workerpb.UnimplementedWorkerServer
	code codes.Code
}

func (w *codeWorker) Generate(*workerpb.GenerateRequest, workerpb.Worker_GenerateServer) error {
	return status.Error(w.code, "answered "+w.code.String())
}

func (w *codeWorker) Prefill(context.Context, *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
	return nil, status.Error(w.code, "answered "+w.code.String())
}

// TestWhichErrorsCountAgainstAWorker: over real gRPC and HTTP, the
// statuses an engine answers with, and whether each feeds the worker's
// breaker. An error caused by the request never does.
func TestWhichErrorsCountAgainstAWorker(t *testing.T) {
	t.Run("grpc", func(t *testing.T) {
		cw := &codeWorker{}
		srv := grpc.NewServer(grpc.MaxRecvMsgSize(4 << 10))
		workerpb.RegisterWorkerServer(srv, cw)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go srv.Serve(l)
		t.Cleanup(srv.Stop)
		c, err := grpcworker.Dial(l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		for _, tt := range []struct {
			code   codes.Code
			prompt int // bytes of prompt
			counts bool
		}{
			{codes.InvalidArgument, 10, false},
			{codes.NotFound, 10, false},
			{codes.OutOfRange, 10, true},
			{codes.ResourceExhausted, 10, true},       // the worker's own limits: busy
			{codes.ResourceExhausted, 8 << 10, false}, // over the message size limit: the request is too large
			{codes.Unavailable, 10, true},
			{codes.Unimplemented, 10, true},
			{codes.Internal, 10, true},
			{codes.Unknown, 10, true},
			{codes.DeadlineExceeded, 10, true},
			{codes.Canceled, 10, false},
		} {
			cw.code = tt.code
			_, err := c.Generate(context.Background(), &engine.Request{Model: "m", Prompt: strings.Repeat("x", tt.prompt), MaxTokens: 1})
			if err == nil {
				t.Fatalf("%s: Generate succeeded", tt.code)
			}
			if got := pool.IsWorkerFault(err); got != tt.counts {
				t.Errorf("%s (%d-byte prompt): counts against the worker = %t, want %t (err %v)", tt.code, tt.prompt, got, tt.counts, err)
			}
		}
	})
	t.Run("grpc prefill", func(t *testing.T) {
		cw := &codeWorker{}
		srv := grpc.NewServer()
		workerpb.RegisterWorkerServer(srv, cw)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go srv.Serve(l)
		t.Cleanup(srv.Stop)
		c, err := grpcworker.Dial(l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		for _, tt := range []struct {
			code   codes.Code
			counts bool
		}{
			{codes.Aborted, false}, // the KV transfer to the decode worker failed
			{codes.Unavailable, true},
			{codes.Internal, true},
			{codes.InvalidArgument, false},
		} {
			cw.code = tt.code
			req := &engine.PrefillRequest{Request: &engine.Request{Model: "m", Prompt: "x", MaxTokens: 1}, TransferID: "t"}
			_, err := c.Prefill(context.Background(), req)
			if err == nil {
				t.Fatalf("%s: Prefill succeeded", tt.code)
			}
			if got := pool.IsWorkerFault(err); got != tt.counts {
				t.Errorf("Prefill %s: counts against the prefill worker = %t, want %t (err %v)", tt.code, got, tt.counts, err)
			}
		}
	})
	t.Run("http", func(t *testing.T) {
		var code int
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, `{"error":{"message":"no"}}`, code)
		}))
		t.Cleanup(srv.Close)
		c, err := httpengine.New(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		for _, tt := range []struct {
			status int
			counts bool
		}{
			{400, false}, {401, false}, {403, false}, {404, false}, {413, false}, {422, false},
			{429, true}, {500, true}, {502, true}, {503, true}, {504, true},
		} {
			code = tt.status
			req := &engine.Request{Model: "m", Prompt: "hi", MaxTokens: 1, Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"hi"}`)}
			_, err := c.Generate(context.Background(), req)
			if err == nil {
				t.Fatalf("%d: Generate succeeded", tt.status)
			}
			if got := pool.IsWorkerFault(err); got != tt.counts {
				t.Errorf("HTTP %d: counts against the worker = %t, want %t (err %v)", tt.status, got, tt.counts, err)
			}
		}
	})
	t.Run("client gone", func(t *testing.T) {
		if pool.IsWorkerFault(engine.ErrClientGone) {
			t.Error("a client that hung up counts against the worker")
		}
	})
}
