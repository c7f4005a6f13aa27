// Package grpcworker is the scheduler's client of a baton worker: it drives
// the worker's gRPC API (proto/worker.proto) as an engine.Client.
package grpcworker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

// ServiceName is the name under which a worker reports its health through
// the standard gRPC health service.
var ServiceName = workerpb.Worker_ServiceDesc.ServiceName

var (
	// ErrUnknownModel is returned (wrapped) when the worker does not serve
	// the requested model (gRPC NotFound). It is engine.ErrUnknownModel,
	// named here for callers of this package.
	ErrUnknownModel = engine.ErrUnknownModel
	// ErrInvalid is returned (wrapped) when the worker rejected the request
	// as malformed (gRPC InvalidArgument); retrying elsewhere will not
	// help. It is engine.ErrInvalid.
	ErrInvalid = engine.ErrInvalid
)

// DefaultKeepalive is the client keepalive used unless WithKeepalive says
// otherwise. A ping every 30 s without traffic keeps long, quiet streams
// (a sequence waiting in a worker's queue) alive through NATs and load
// balancers, and detects a dead worker within Time+Timeout.
//
// A gRPC server's default enforcement policy rejects pings more often than
// every 5 minutes, so workers must allow them: see KeepaliveEnforcement.
var DefaultKeepalive = keepalive.ClientParameters{
	Time:                30 * time.Second,
	Timeout:             10 * time.Second,
	PermitWithoutStream: false,
}

// KeepaliveEnforcement is the server-side policy a worker must install
// (grpc.KeepaliveEnforcementPolicy) to accept DefaultKeepalive's pings.
var KeepaliveEnforcement = keepalive.EnforcementPolicy{
	MinTime:             20 * time.Second,
	PermitWithoutStream: false,
}

// maxRetryBuffer bounds the request bytes gRPC keeps per call to retry it
// transparently (a call that never reached the worker). A longer request
// is not kept: a Prefill holds its call open for its whole transfer, and
// a burst of them kept a pooled copy of every prompt (1 MiB buffers for
// 32 KiB prompts). The front end retries such calls itself.
const maxRetryBuffer = 16 << 10

// connectTimeout bounds one connection attempt to a worker, TCP and the
// HTTP/2 handshake (and TLS's): calls made while it is under way wait for
// it. A worker that accepts connections and never answers would otherwise
// hold them for gRPC's default of 20 s before the front end may retry
// elsewhere. A healthy worker handshakes in milliseconds.
const connectTimeout = 3 * time.Second

// Option configures Dial.
type Option func(*options)

type options struct {
	creds     credentials.TransportCredentials
	keepalive keepalive.ClientParameters
	extra     []grpc.DialOption
}

// WithTransportCredentials sets the transport credentials, for TLS
// (credentials.NewTLS). The default is insecure: workers sit on loopback or
// on the cluster's internal network.
func WithTransportCredentials(c credentials.TransportCredentials) Option {
	return func(o *options) { o.creds = c }
}

// WithKeepalive replaces DefaultKeepalive.
func WithKeepalive(p keepalive.ClientParameters) Option {
	return func(o *options) { o.keepalive = p }
}

// WithDialOptions appends raw gRPC dial options (interceptors, stats
// handlers), applied after the ones this package sets.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.extra = append(o.extra, opts...) }
}

// Client drives one baton worker. Its methods are safe for concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	worker workerpb.WorkerClient
	health healthpb.HealthClient

	closeOnce sync.Once
	closeErr  error
}

// Dial returns a client of the worker at addr ("host:port", or any target
// grpc.NewClient accepts). It does not connect: the connection is made on
// the first call and re-made as needed.
func Dial(addr string, opts ...Option) (*Client, error) {
	o := options{
		creds:     insecure.NewCredentials(),
		keepalive: DefaultKeepalive,
	}
	for _, opt := range opts {
		opt(&o)
	}
	dialOpts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(o.creds),
		grpc.WithKeepaliveParams(o.keepalive),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.DefaultConfig, MinConnectTimeout: connectTimeout}),
		grpc.WithDefaultCallOptions(grpc.MaxRetryRPCBufferSize(maxRetryBuffer)),
	}, o.extra...)
	conn, err := grpc.NewClient(addr, dialOpts...)
	if err != nil {
		return nil, fmt.Errorf("dialing worker %s: %w", addr, err)
	}
	return &Client{
		conn:   conn,
		worker: workerpb.NewWorkerClient(conn),
		health: healthpb.NewHealthClient(conn),
	}, nil
}

// Generate starts req on the worker. It waits for the worker's first event,
// so that a worker that cannot serve the request (unreachable, unknown
// model, invalid request) fails here, with nothing generated, and the
// caller may retry elsewhere. Cancelling ctx, or closing the stream,
// cancels the generation on the worker.
func (c *Client) Generate(ctx context.Context, req *engine.Request) (engine.Stream, error) {
	if req == nil {
		return nil, fmt.Errorf("generate: %w: nil request", ErrInvalid)
	}
	return open(ctx, "generate", func(ctx context.Context) (workerpb.Worker_GenerateClient, error) {
		return c.worker.Generate(ctx, generateRequest(req))
	})
}

// Prefill runs req's prefill on the worker (role prefill or both), which
// pushes the KV blocks the decode worker lacks straight to it. Errors are
// mapped as Generate's; a worker whose role does not serve Prefill (gRPC
// Unimplemented) gives engine.ErrUnavailable, so the caller may retry
// elsewhere; a failed transfer (the worker reports Aborted) gives
// engine.ErrTransfer and engine.ErrUnavailable.
func (c *Client) Prefill(ctx context.Context, req *engine.PrefillRequest) (*engine.PrefillResult, error) {
	if req == nil || req.Request == nil {
		return nil, fmt.Errorf("prefill: %w: nil request", ErrInvalid)
	}
	resp, err := c.worker.Prefill(ctx, &workerpb.PrefillRequest{
		Request:                generateRequest(req.Request),
		TransferId:             req.TransferID,
		DecodeAddr:             req.DecodeAddr,
		MinRemotePrefillTokens: clampInt32(req.MinRemoteTokens),
		TransferTimeoutMs:      millis(req.TransferTimeout),
	})
	if err != nil {
		if status.Code(err) == codes.Aborted {
			return nil, fmt.Errorf("prefill: %w: %w: %w", engine.ErrTransfer, engine.ErrUnavailable, err)
		}
		return nil, fmt.Errorf("prefill: %w", mapError(err))
	}
	return &engine.PrefillResult{
		Skipped:          resp.GetSkipped(),
		SkipReason:       resp.GetSkipReason(),
		PromptTokens:     int(resp.GetPromptTokens()),
		CachedTokens:     int(resp.GetCachedTokens()),
		DecodeHeldTokens: int(resp.GetDecodeHeldTokens()),
		BlocksSent:       int(resp.GetBlocksSent()),
		BlocksHeld:       int(resp.GetBlocksHeld()),
		BytesSent:        resp.GetBytesSent(),
		BlocksRejected:   int(resp.GetBlocksRejected()),
		Queue:            seconds(resp.GetQueueSeconds()),
		Prefill:          seconds(resp.GetPrefillSeconds()),
		Transfer:         seconds(resp.GetTransferSeconds()),
	}, nil
}

// Decode starts req on the worker (role decode or both) after it has
// waited, at most timeout (0: the worker's default), for transfer
// transferID (empty: none). Like Generate, it waits for the first event,
// so an error here means nothing was generated.
func (c *Client) Decode(ctx context.Context, req *engine.Request, transferID string, timeout time.Duration) (engine.Stream, error) {
	if req == nil {
		return nil, fmt.Errorf("decode: %w: nil request", ErrInvalid)
	}
	return open(ctx, "decode", func(ctx context.Context) (workerpb.Worker_DecodeClient, error) {
		return c.worker.Decode(ctx, &workerpb.DecodeRequest{
			Request:           generateRequest(req),
			TransferId:        transferID,
			TransferTimeoutMs: millis(timeout),
		})
	})
}

// open starts a streaming call and waits for its first event.
func open(ctx context.Context, op string, call func(context.Context) (workerpb.Worker_GenerateClient, error)) (engine.Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	st, err := call(ctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("%s: %w", op, mapError(err))
	}
	first, err := st.Recv()
	if err != nil {
		cancel()
		if errors.Is(err, io.EOF) {
			// The worker ended the stream without a single event: nothing
			// was generated, so another worker may do better.
			return nil, fmt.Errorf("%s: %w: stream ended before its first event: %w", op, engine.ErrUnavailable, io.ErrUnexpectedEOF)
		}
		return nil, fmt.Errorf("%s: %w", op, mapError(err))
	}
	return &stream{st: st, cancel: cancel, first: first, op: op}, nil
}

func generateRequest(req *engine.Request) *workerpb.GenerateRequest {
	return &workerpb.GenerateRequest{
		RequestId: req.ID,
		Model:     req.Model,
		Tenant:    req.Tenant,
		Prompt:    req.Prompt,
		MaxTokens: clampInt32(req.MaxTokens),
		Stop:      req.Stop,
	}
}

// millis converts d to whole milliseconds for the wire, rounding a
// positive sub-millisecond duration up so it does not become "default".
func millis(d time.Duration) int32 {
	if d <= 0 {
		return 0
	}
	return clampInt32(int((d + time.Millisecond - 1) / time.Millisecond))
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// Check asks the worker's gRPC health service about ServiceName. It returns
// nil when the worker is SERVING; otherwise an error wrapping
// engine.ErrUnavailable (or ctx's error when ctx ended).
func (c *Client) Check(ctx context.Context) error {
	resp, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: ServiceName})
	if err != nil {
		switch status.Code(err) {
		case codes.Canceled, codes.DeadlineExceeded:
			return fmt.Errorf("health check: %w", mapError(err))
		}
		return fmt.Errorf("health check: %w: %w", engine.ErrUnavailable, err)
	}
	if s := resp.GetStatus(); s != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health check: %w: worker is %s", engine.ErrUnavailable, s)
	}
	return nil
}

// Info returns the worker's description. Errors are mapped as Generate's.
func (c *Client) Info(ctx context.Context) (*workerpb.InfoResponse, error) {
	resp, err := c.worker.Info(ctx, &workerpb.InfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("info: %w", mapError(err))
	}
	return resp, nil
}

// Describe returns the models the worker serves, its role and the LoRA
// adapters it holds, from Info.
func (c *Client) Describe(ctx context.Context) (engine.Description, error) {
	info, err := c.Info(ctx)
	if err != nil {
		return engine.Description{}, err
	}
	role := "both"
	switch info.GetRole() {
	case workerpb.Role_ROLE_PREFILL:
		role = "prefill"
	case workerpb.Role_ROLE_DECODE:
		role = "decode"
	}
	d := engine.Description{Models: info.GetModels(), Role: role, MaxLoRAs: int(info.GetMaxLoras())}
	if a := info.GetAdapters(); a != nil {
		d.Adapters = append([]string{}, a.GetNames()...)
	}
	return d, nil
}

// Watch subscribes to the worker's load reports and cache events. The
// stream lives until ctx is cancelled or the worker ends it; the caller
// must cancel ctx when done with it.
func (c *Client) Watch(ctx context.Context) (workerpb.Worker_WatchClient, error) {
	st, err := c.worker.Watch(ctx, &workerpb.WatchRequest{})
	if err != nil {
		return nil, fmt.Errorf("watch: %w", mapError(err))
	}
	return st, nil
}

// Close closes the connection; calls in flight fail. It is idempotent.
func (c *Client) Close() error {
	c.closeOnce.Do(func() { c.closeErr = c.conn.Close() })
	return c.closeErr
}

// stream is a Generate call in progress.
type stream struct {
	st     workerpb.Worker_GenerateClient
	cancel context.CancelFunc
	op     string // "generate" or "decode", for errors

	first    *workerpb.GenerateEvent // buffered by Generate, returned by the first Recv
	finished bool                    // Final returned: Recv returns io.EOF

	closeOnce sync.Once
}

// Recv returns the next event: io.EOF after the one carrying Final.
func (s *stream) Recv() (engine.Event, error) {
	if s.finished {
		return engine.Event{}, io.EOF
	}
	ev := s.first
	s.first = nil
	if ev == nil {
		var err error
		ev, err = s.st.Recv()
		if err != nil {
			s.cancel()
			if errors.Is(err, io.EOF) {
				return engine.Event{}, fmt.Errorf("%s: stream ended without a final event: %w", s.op, io.ErrUnexpectedEOF)
			}
			return engine.Event{}, fmt.Errorf("%s: %w", s.op, mapError(err))
		}
	}
	switch e := ev.GetEvent().(type) {
	case *workerpb.GenerateEvent_Tokens:
		return engine.Event{Text: e.Tokens.GetText(), Tokens: int(e.Tokens.GetCount())}, nil
	case *workerpb.GenerateEvent_Final:
		// The worker ends the call after Final; releasing our side now
		// frees the stream even if the caller never calls Close.
		s.finished = true
		s.cancel()
		f := e.Final
		return engine.Event{Final: &engine.Final{
			FinishReason:     f.GetFinishReason(),
			PromptTokens:     int(f.GetPromptTokens()),
			CachedTokens:     int(f.GetCachedTokens()),
			CompletionTokens: int(f.GetCompletionTokens()),
			CachedGPU:        int(f.GetCachedGpuTokens()),
			CachedCPU:        int(f.GetCachedCpuTokens()),
			CachedRedis:      int(f.GetCachedRedisTokens()),
		}}, nil
	default:
		s.cancel()
		return engine.Event{}, fmt.Errorf("%s: unknown event %T", s.op, e)
	}
}

// Close cancels the call if it is still running. It is idempotent and may
// be called from another goroutine than Recv's.
func (s *stream) Close() error {
	s.closeOnce.Do(s.cancel)
	return nil
}

// mapError maps a gRPC error to the errors callers branch on. The gRPC
// status stays in the chain, so status.Code still works on the result.
func mapError(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		// Not a gRPC status: the context's own error, or a transport one.
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		return fmt.Errorf("%w: %w", engine.ErrUnavailable, err)
	}
	switch st.Code() {
	case codes.ResourceExhausted:
		if strings.Contains(st.Message(), "larger than max") {
			// The message exceeded a gRPC size limit, the worker's or
			// ours: the request is too large, for every worker alike.
			return fmt.Errorf("%w: %w", engine.ErrTooLarge, err)
		}
		return fmt.Errorf("%w: %w", engine.ErrUnavailable, err)
	case codes.Unavailable, codes.Unimplemented:
		// Unimplemented: the worker's role (or version) does not serve
		// the call; another worker may.
		return fmt.Errorf("%w: %w", engine.ErrUnavailable, err)
	case codes.NotFound:
		return fmt.Errorf("%w: %w", ErrUnknownModel, err)
	case codes.InvalidArgument:
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	case codes.DeadlineExceeded:
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	case codes.Canceled:
		return fmt.Errorf("%w: %w", context.Canceled, err)
	}
	return err
}

func clampInt32(n int) int32 {
	switch {
	case n > math.MaxInt32:
		return math.MaxInt32
	case n < 0:
		return 0
	}
	return int32(n)
}

var _ engine.Client = (*Client)(nil)
var _ engine.Disaggregator = (*Client)(nil)
var _ engine.Describer = (*Client)(nil)
var _ engine.Stream = (*stream)(nil)
