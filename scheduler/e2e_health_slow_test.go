package scheduler_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/sim"
)

// startSlowCheckWorker starts a simulated worker in real time that can
// load loraAdapters, on a gRPC server of its own whose health checks,
// while slow is set, get no answer before their deadline: what a host
// starved of CPU does to the checks of every worker at once, which a real
// worker cannot be made to do on demand. Its other calls are served as
// usual. Each check it holds so is signalled on held, if there is room.
func startSlowCheckWorker(t *testing.T, slow *atomic.Bool, held chan<- struct{}) scheduler.WorkerConfig {
	t.Helper()
	var list []engine.Adapter
	for _, a := range loraAdapters {
		list = append(list, engine.Adapter{Name: a.Name, Base: a.BaseModel, Bytes: a.Size})
	}
	e, err := sim.New(sim.Config{TimeScale: 1, LoRA: sim.LoRA{Adapters: list, MaxLoRAs: 2}})
	if err != nil {
		t.Fatalf("sim.New: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	g := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if slow.Load() && info.FullMethod == healthpb.Health_Check_FullMethodName {
			select {
			case held <- struct{}{}:
			default:
			}
			<-ctx.Done()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return h(ctx, req)
	}))
	sim.NewServer(e).Register(g)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	go g.Serve(l)
	t.Cleanup(g.Stop)
	return scheduler.WorkerConfig{Name: "w0", Address: l.Addr().String(), MaxLoRAs: 2}
}

// Health checks that time out while the worker streams tokens do not mark
// it down: requests for its adapter are still served. Once it answers
// nothing, the same checks mark it down and such a request is a 503.
func TestHealthCheckTimeoutsWhileAnswering(t *testing.T) {
	var slow atomic.Bool
	held := make(chan struct{}, 1)
	wc := startSlowCheckWorker(t, &slow, held)
	s, addr := startScheduler(t, scheduler.Config{
		Pool:     pool.Config{HealthInterval: 250 * time.Millisecond, HealthTimeout: 200 * time.Millisecond, UnhealthyAfter: 2},
		Workers:  []scheduler.WorkerConfig{wc},
		Adapters: loraAdapters,
	})
	c := oaClient(t, addr)

	// A long stream keeps the worker answering: a token every few ms.
	ctx, cancel := context.WithCancel(ctxT(t, time.Minute))
	defer cancel()
	stream := c.Chat.Completions.NewStreaming(ctx, adapterChat("sql", "keep answering"), option.WithJSONSet("max_tokens", 8000))
	if !stream.Next() {
		t.Fatalf("stream: no first chunk: %v", stream.Err())
	}
	streamed := make(chan struct{})
	go func() {
		defer close(streamed)
		for stream.Next() {
		}
	}()
	w := s.Pool.Snapshot().Workers[0]

	slow.Store(true)
	// Rounds of checks never overlap: when a check is held, the one
	// before it has timed out and been counted. Twice UnhealthyAfter.
	for i := range 5 {
		select {
		case <-held:
		case <-time.After(10 * time.Second):
			t.Fatalf("health check %d never came", i+1)
		}
		if !w.Healthy() {
			t.Fatalf("the worker was marked down by %d health checks that timed out while it streamed tokens", i)
		}
	}
	if _, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), adapterChat("sql", "a question")); err != nil {
		t.Fatalf("request while the checks time out: %v", err)
	}

	// The stream ends: the worker answers nothing, and the checks that
	// time out count.
	cancel()
	<-streamed
	stream.Close()
	eventually(t, 10*time.Second, func() error {
		if w.Healthy() {
			return errors.New("the worker is still healthy: its checks time out and it answers nothing")
		}
		return nil
	})
	_, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), adapterChat("sql", "a question"))
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("request with the worker down: got %v, want a 503", err)
	}
}
