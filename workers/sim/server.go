package sim

import (
	"context"
	"errors"
	"io"
	"slices"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// Server serves an Engine as a baton worker: the Worker gRPC service and
// the standard health service.
type Server struct {
	workerpb.UnimplementedWorkerServer
	e      *Engine
	tr     transfer.Transport
	health *health.Server
	calls  atomic.Int64 // Generate, Decode and Prefill calls running
}

// ServerOption configures NewServer.
type ServerOption func(*Server)

// WithServerTransport sets the transport Prefill pushes KV blocks over.
// Without one, Prefill fails (ErrTransfer). The server does not close it.
func WithServerTransport(tr transfer.Transport) ServerOption {
	return func(s *Server) { s.tr = tr }
}

// NewServer returns a server of e, reporting SERVING for the whole server
// ("") and for baton.worker.v1.Worker once e's start-up warm-up has ended
// (Engine.WarmupDone; NOT_SERVING until then), so that a scheduler sends
// a worker that joins no traffic before its cache is warm.
func NewServer(e *Engine, opts ...ServerOption) *Server {
	s := &Server{e: e, health: health.NewServer()}
	for _, o := range opts {
		o(s)
	}
	serving := func() {
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		s.health.SetServingStatus(workerpb.Worker_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	}
	select {
	case <-e.WarmupDone():
		serving()
	default:
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
		s.health.SetServingStatus(workerpb.Worker_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
		// Bounded by warmupTimeout; ignored after Shutdown.
		go func() {
			<-e.WarmupDone()
			serving()
		}()
	}
	return s
}

// Register registers the Worker and health services on g.
func (s *Server) Register(g *grpc.Server) {
	workerpb.RegisterWorkerServer(g, s)
	healthpb.RegisterHealthServer(g, s.health)
}

// Shutdown reports NOT_SERVING on every service, so schedulers drain the
// worker before it stops.
func (s *Server) Shutdown() { s.health.Shutdown() }

// Calls returns the Generate, Decode and Prefill calls being served.
func (s *Server) Calls() int { return int(s.calls.Load()) }

// Info describes the worker.
func (s *Server) Info(context.Context, *workerpb.InfoRequest) (*workerpb.InfoResponse, error) {
	cfg := s.e.Config()
	return &workerpb.InfoResponse{
		Name:       cfg.Name,
		Models:     append(slices.Clone(cfg.Models), s.e.Adapters()...),
		Role:       cfg.role(),
		BlockChars: blockkey.DefaultBlockChars,
		GpuBlocks:  s.e.Cache().Capacity(),
		MaxRunning: int32(cfg.Batching.MaxRunning),
		CpuBlocks:  s.e.Cache().CPUCapacity(),
		Cost:       s.e.CostParams(),
		RedisTier:  cfg.Tiers.Store != nil,
		Adapters:   adapterSet(s.e.reportedAdapters()),
		MaxLoras:   maxLoRAs(cfg.LoRA),
	}, nil
}

// maxLoRAs is the adapter slots an engine reports: none when it serves no
// adapter.
func maxLoRAs(l LoRA) int32 {
	if len(l.Adapters) == 0 {
		return 0
	}
	return int32(l.MaxLoRAs)
}

// adapterSet is the wire form of the adapters an engine holds: nil when it
// serves none.
func adapterSet(names []string) *workerpb.Adapters {
	if names == nil {
		return nil
	}
	return &workerpb.Adapters{Names: names}
}

// Generate runs one sequence and streams its tokens, then its final usage.
func (s *Server) Generate(req *workerpb.GenerateRequest, out grpc.ServerStreamingServer[workerpb.GenerateEvent]) error {
	s.calls.Add(1)
	defer s.calls.Add(-1)
	st, err := s.e.Generate(out.Context(), engineRequest(req))
	if err != nil {
		return toStatus(err)
	}
	return sendStream(st, out)
}

// Decode waits (bounded) for the request's transfer, then runs it as
// Generate does.
func (s *Server) Decode(req *workerpb.DecodeRequest, out grpc.ServerStreamingServer[workerpb.GenerateEvent]) error {
	s.calls.Add(1)
	defer s.calls.Add(-1)
	timeout := time.Duration(req.GetTransferTimeoutMs()) * time.Millisecond
	st, err := s.e.Decode(out.Context(), engineRequest(req.GetRequest()), req.GetTransferId(), timeout)
	if err != nil {
		return toStatus(err)
	}
	return sendStream(st, out)
}

// Prefill computes the request's blocks and pushes those the decode worker
// lacks to it.
func (s *Server) Prefill(ctx context.Context, req *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
	s.calls.Add(1)
	defer s.calls.Add(-1)
	res, err := s.e.Prefill(ctx, &engine.PrefillRequest{
		Request:         engineRequest(req.GetRequest()),
		TransferID:      req.GetTransferId(),
		DecodeAddr:      req.GetDecodeAddr(),
		MinRemoteTokens: int(req.GetMinRemotePrefillTokens()),
		TransferTimeout: time.Duration(req.GetTransferTimeoutMs()) * time.Millisecond,
	}, s.tr)
	if err != nil {
		return nil, toStatus(err)
	}
	return &workerpb.PrefillResult{
		Skipped:          res.Skipped,
		SkipReason:       res.SkipReason,
		PromptTokens:     int32(res.PromptTokens),
		CachedTokens:     int32(res.CachedTokens),
		DecodeHeldTokens: int32(res.DecodeHeldTokens),
		BlocksSent:       int32(res.BlocksSent),
		BlocksHeld:       int32(res.BlocksHeld),
		BytesSent:        res.BytesSent,
		QueueSeconds:     res.Queue.Seconds(),
		PrefillSeconds:   res.Prefill.Seconds(),
		TransferSeconds:  res.Transfer.Seconds(),
		BlocksRejected:   int32(res.BlocksRejected),
	}, nil
}

// engineRequest converts a request; a nil one (no request field) becomes a
// request with no model, which the engine rejects.
func engineRequest(req *workerpb.GenerateRequest) *engine.Request {
	return &engine.Request{
		ID:        req.GetRequestId(),
		Model:     req.GetModel(),
		Tenant:    req.GetTenant(),
		Prompt:    req.GetPrompt(),
		MaxTokens: int(req.GetMaxTokens()),
		Stop:      req.GetStop(),
	}
}

// sendStream relays st to out until its end.
func sendStream(st engine.Stream, out grpc.ServerStreamingServer[workerpb.GenerateEvent]) error {
	defer st.Close()
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return toStatus(err)
		}
		var msg workerpb.GenerateEvent
		if ev.Final != nil {
			msg.Event = &workerpb.GenerateEvent_Final{Final: &workerpb.Final{
				FinishReason:      ev.Final.FinishReason,
				PromptTokens:      int32(ev.Final.PromptTokens),
				CachedTokens:      int32(ev.Final.CachedTokens),
				CompletionTokens:  int32(ev.Final.CompletionTokens),
				CachedGpuTokens:   int32(ev.Final.CachedGPU),
				CachedCpuTokens:   int32(ev.Final.CachedCPU),
				CachedRedisTokens: int32(ev.Final.CachedRedis),
			}}
		} else {
			msg.Event = &workerpb.GenerateEvent_Tokens{Tokens: &workerpb.Tokens{
				Text: ev.Text, Count: int32(ev.Tokens),
			}}
		}
		if err := out.Send(&msg); err != nil {
			return err
		}
	}
}

// Watch streams a snapshot, then load reports and cache events, with
// sequence numbers from 1. A subscriber too slow to keep up gets Aborted
// and should call Watch again.
func (s *Server) Watch(_ *workerpb.WatchRequest, out grpc.ServerStreamingServer[workerpb.WatchEvent]) error {
	sub, err := s.e.Subscribe()
	if err != nil {
		return toStatus(err)
	}
	defer sub.Close()
	ctx := out.Context()
	for {
		select {
		case ev, ok := <-sub.C:
			if !ok {
				return toStatus(sub.Err())
			}
			if err := out.Send(watchEvent(ev)); err != nil {
				return err
			}
		case <-ctx.Done():
			return toStatus(ctx.Err())
		}
	}
}

func watchEvent(ev WatchEvent) *workerpb.WatchEvent {
	msg := &workerpb.WatchEvent{Seq: ev.Seq}
	switch {
	case ev.Snapshot != nil:
		// One stored event per tier holding blocks.
		snap := &workerpb.Snapshot{Load: loadReport(ev.Snapshot.Load)}
		snap.Load.Adapters = adapterSet(ev.Snapshot.Adapters)
		for _, t := range []struct {
			tier workerpb.Tier
			keys []uint64
		}{{workerpb.Tier_TIER_GPU, ev.Snapshot.Keys}, {workerpb.Tier_TIER_CPU, ev.Snapshot.CPUKeys}} {
			if len(t.keys) > 0 {
				snap.Blocks = append(snap.Blocks, &workerpb.CacheEvent{
					Kind: workerpb.CacheEvent_KIND_STORED, Tier: t.tier, Keys: t.keys,
				})
			}
		}
		msg.Event = &workerpb.WatchEvent_Snapshot{Snapshot: snap}
	case ev.Load != nil:
		l := loadReport(*ev.Load)
		l.Adapters = adapterSet(ev.Adapters)
		msg.Event = &workerpb.WatchEvent_Load{Load: l}
	case ev.Cache != nil:
		msg.Event = &workerpb.WatchEvent_Cache{Cache: cacheEvent(ev.Cache)}
	}
	return msg
}

func cacheEvent(ev *CacheEvent) *workerpb.CacheEvent {
	kind := workerpb.CacheEvent_KIND_STORED
	switch ev.Kind {
	case BlockRemoved:
		kind = workerpb.CacheEvent_KIND_REMOVED
	case BlockTierChanged:
		kind = workerpb.CacheEvent_KIND_TIER_CHANGED
	}
	return &workerpb.CacheEvent{
		Kind:     kind,
		Tier:     workerpb.Tier(ev.Tier),
		FromTier: workerpb.Tier(ev.FromTier),
		Keys:     ev.Keys,
	}
}

func loadReport(l Load) *workerpb.LoadReport {
	return &workerpb.LoadReport{
		Running:              int32(l.Running),
		Waiting:              int32(l.Waiting),
		GpuBlocksUsed:        l.BlocksUsed,
		GpuBlocksTotal:       l.BlocksTotal,
		CpuBlocksUsed:        l.CPUBlocksUsed,
		CpuBlocksTotal:       l.CPUBlocksTotal,
		WaitingPrefillTokens: l.WaitingPrefillTokens,
	}
}

// toStatus maps engine errors to gRPC status errors.
func toStatus(err error) error {
	if err == nil {
		return status.Error(codes.Canceled, "watch closed")
	}
	code := codes.Internal
	switch {
	case errors.Is(err, ErrTransfer):
		// Before the context checks: a push that timed out is the
		// transfer's failure, not the caller's deadline. Aborted tells it
		// from the worker's own unavailability (grpcworker.Client.Prefill).
		code = codes.Aborted
	case errors.Is(err, ErrRole):
		code = codes.Unimplemented
	case errors.Is(err, ErrUnknownModel):
		code = codes.NotFound
	case errors.Is(err, ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, ErrClosed), errors.Is(err, ErrDraining):
		code = codes.Unavailable
	case errors.Is(err, ErrSlowSubscriber):
		code = codes.Aborted
	case errors.Is(err, context.Canceled), errors.Is(err, errStreamClosed):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	}
	return status.Error(code, err.Error())
}

var _ workerpb.WorkerServer = (*Server)(nil)
