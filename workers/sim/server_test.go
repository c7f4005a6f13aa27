package sim

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer/blockkey"
)

// serve runs e behind a real gRPC server on loopback and returns a client
// connection to it.
func serve(t *testing.T, e *Engine) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	NewServer(e).Register(g)
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Serve(lis)
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		g.Stop()
		<-done
	})
	return conn
}

func TestServerInfo(t *testing.T) {
	e := newEngine(t, Config{Name: "w1", Models: []string{"a", "b"}, Tiers: Tiers{GPUBlocks: 123}})
	c := workerpb.NewWorkerClient(serve(t, e))
	got, err := c.Info(context.Background(), &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetName() != "w1" || strings.Join(got.GetModels(), ",") != "a,b" || got.GetRole() != workerpb.Role_ROLE_BOTH ||
		got.GetBlockChars() != 64 || got.GetGpuBlocks() != 123 || got.GetMaxRunning() != 256 {
		t.Errorf("Info() = %v", got)
	}
}

func TestServerGenerate(t *testing.T) {
	e := newEngine(t, Config{})
	c := workerpb.NewWorkerClient(serve(t, e))
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 20)
	run := func() (string, *workerpb.Final) {
		t.Helper()
		st, err := c.Generate(context.Background(), &workerpb.GenerateRequest{
			RequestId: "r1", Model: testModel, Prompt: prompt, MaxTokens: 20,
		})
		if err != nil {
			t.Fatal(err)
		}
		var text string
		var count int32
		var final *workerpb.Final
		for {
			ev, err := st.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("Recv: %v", err)
			}
			if final != nil {
				t.Fatalf("event after final: %v", ev)
			}
			if tok := ev.GetTokens(); tok != nil {
				text += tok.GetText()
				count += tok.GetCount()
			}
			final = ev.GetFinal()
		}
		if final == nil {
			t.Fatal("no final event")
		}
		if count != final.GetCompletionTokens() {
			t.Errorf("tokens events count %d, final says %d", count, final.GetCompletionTokens())
		}
		return text, final
	}
	text1, f1 := run()
	text2, f2 := run()
	if text1 != text2 || len(text1) != 80 {
		t.Errorf("texts %q and %q, want equal, 20 tokens", text1, text2)
	}
	if f1.GetFinishReason() != "length" || f1.GetCompletionTokens() != 20 ||
		f1.GetPromptTokens() != int32(blockkey.Tokens(len(prompt))) || f1.GetCachedTokens() != 0 {
		t.Errorf("first final %v", f1)
	}
	if want := int32(len(prompt) / 64 * 16); f2.GetCachedTokens() != want {
		t.Errorf("second request cached %d, want %d", f2.GetCachedTokens(), want)
	}
}

func TestServerGenerateErrors(t *testing.T) {
	e := newEngine(t, Config{TimeScale: 1})
	c := workerpb.NewWorkerClient(serve(t, e))
	tests := []struct {
		name string
		req  *workerpb.GenerateRequest
		want codes.Code
	}{
		{"unknown model", &workerpb.GenerateRequest{Model: "nope", Prompt: "hi"}, codes.NotFound},
		{"empty prompt", &workerpb.GenerateRequest{Model: testModel}, codes.InvalidArgument},
		{"negative max tokens", &workerpb.GenerateRequest{Model: testModel, Prompt: "hi", MaxTokens: -2}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, err := c.Generate(context.Background(), tt.req)
			if err == nil {
				_, err = st.Recv()
			}
			if status.Code(err) != tt.want {
				t.Errorf("error %v, want code %v", err, tt.want)
			}
		})
	}

	t.Run("client cancels", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		st, err := c.Generate(ctx, &workerpb.GenerateRequest{Model: testModel, Prompt: "a long story", MaxTokens: 1000})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		cancel()
		for err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.Canceled {
			t.Errorf("error %v, want Canceled", err)
		}
		waitIdle(t, e)
	})

	t.Run("engine closed", func(t *testing.T) {
		e.Close()
		st, err := c.Generate(context.Background(), &workerpb.GenerateRequest{Model: testModel, Prompt: "hi"})
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.Unavailable {
			t.Errorf("error %v, want Unavailable", err)
		}
	})
}

func TestServerWatch(t *testing.T) {
	// TimeScale 1: the request runs long enough for a load report (every
	// 5 ms, when the load changed) to see it.
	e := newEngine(t, Config{LoadInterval: 5 * time.Millisecond, TimeScale: 1})
	conn := serve(t, e)
	c := workerpb.NewWorkerClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := c.Watch(ctx, &workerpb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil {
		t.Fatal(err)
	}
	snap := first.GetSnapshot()
	if first.GetSeq() != 1 || snap == nil || snap.GetLoad().GetGpuBlocksTotal() != e.Cache().Capacity() || len(snap.GetBlocks()) != 0 {
		t.Fatalf("first event %v, want an empty snapshot with seq 1", first)
	}

	prompt := strings.Repeat("w", 64*3)
	if _, err := c.Generate(ctx, &workerpb.GenerateRequest{Model: testModel, Prompt: prompt, MaxTokens: 20}); err != nil {
		t.Fatal(err)
	}
	want := blockkey.Append(nil, blockkey.Seed(testModel, ""), prompt, 64)
	seq := first.GetSeq()
	var stored []uint64
	loads := 0
	for len(stored) < len(want) || loads == 0 {
		ev, err := w.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.GetSeq() != seq+1 {
			t.Fatalf("seq %d after %d", ev.GetSeq(), seq)
		}
		seq = ev.GetSeq()
		if ce := ev.GetCache(); ce != nil {
			if ce.GetKind() != workerpb.CacheEvent_KIND_STORED || ce.GetTier() != workerpb.Tier_TIER_GPU {
				t.Errorf("cache event %v", ce)
			}
			stored = append(stored, ce.GetKeys()...)
		}
		if ev.GetLoad() != nil {
			loads++
		}
	}
	if len(stored) != 3 || stored[0] != want[0] || stored[2] != want[2] {
		t.Errorf("stored keys %v, want %v", stored, want)
	}

	// A second watcher's snapshot holds the blocks.
	w2, err := c.Watch(ctx, &workerpb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ev, err := w2.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if b := ev.GetSnapshot().GetBlocks(); len(b) != 1 || len(b[0].GetKeys()) != 3 || b[0].GetTier() != workerpb.Tier_TIER_GPU {
		t.Errorf("second snapshot blocks %v", b)
	}

	cancel()
	for err == nil { // events sent before the cancel may still arrive
		_, err = w.Recv()
	}
	if status.Code(err) != codes.Canceled {
		t.Errorf("Recv after cancel: %v, want Canceled", err)
	}
}

func TestServerHealth(t *testing.T) {
	e := newEngine(t, Config{})
	h := healthpb.NewHealthClient(serve(t, e))
	for _, svc := range []string{"", "baton.worker.v1.Worker"} {
		resp, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatalf("Check(%q): %v", svc, err)
		}
		if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("Check(%q) = %v, want SERVING", svc, resp.GetStatus())
		}
	}
}
