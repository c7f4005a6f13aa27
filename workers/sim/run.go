package sim

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/openai"
)

// Worker is a running simulated worker: an Engine served over the worker
// gRPC API and, optionally, over an OpenAI-compatible HTTP endpoint of its
// own, so it can stand in for vLLM behind any router.
type Worker struct {
	Engine *Engine
	// GRPCAddr and HTTPAddr are the bound addresses (HTTPAddr is empty
	// without an HTTP endpoint).
	GRPCAddr string
	HTTPAddr string
	// Transport is the transport Prefill pushes KV blocks over: a gRPC
	// one the worker owns, or the one given WithTransport.
	Transport transfer.Transport

	ownTransport bool
	server       *Server
	grpc         *grpc.Server
	http         *http.Server
	wg           sync.WaitGroup
	once         sync.Once
}

// StartOption configures Start.
type StartOption func(*startOptions)

type startOptions struct {
	transport       transfer.Transport
	maxRequestBytes int
	serverTLS       *tls.Config
	clientTLS       *tls.Config
	httpTLS         *tls.Config
}

// DefaultMaxRequestBytes bounds one gRPC request a worker accepts (a
// prompt and its parameters): 64 MiB, far above the scheduler's default
// body limit (6 MiB), so that any request the scheduler accepts fits.
const DefaultMaxRequestBytes = 64 << 20

// WithMaxRequestBytes replaces DefaultMaxRequestBytes. A larger request is
// refused with gRPC ResourceExhausted, which the scheduler answers with a
// 413 and does not count against the worker.
func WithMaxRequestBytes(n int) StartOption {
	return func(o *startOptions) { o.maxRequestBytes = n }
}

// WithTLS serves the worker's gRPC API with server (tlsconf.Server; a
// ClientCAs there makes it accept only clients with a certificate the CA
// signed) and, unless WithTransport gives another transport, pushes KV
// blocks to other workers with client (tlsconf.Client: their certificates
// verified, the worker's own presented).
func WithTLS(server, client *tls.Config) StartOption {
	return func(o *startOptions) { o.serverTLS, o.clientTLS = server, client }
}

// WithHTTPTLS serves the worker's OpenAI-compatible HTTP endpoint over
// HTTPS with cfg (tlsconf.Server; a ClientCAs there makes it accept only
// clients with a certificate the CA signed). A plain-HTTP request to it is
// answered 400.
func WithHTTPTLS(cfg *tls.Config) StartOption {
	return func(o *startOptions) { o.httpTLS = cfg }
}

// WithTransport makes the worker push KV blocks (Prefill) over tr instead
// of a gRPC transport of its own, e.g. a fault-injecting one in tests. The
// caller keeps ownership: Worker.Close does not close tr.
func WithTransport(tr transfer.Transport) StartOption {
	return func(o *startOptions) { o.transport = tr }
}

// Start starts an engine from cfg and serves it on grpcListen and, unless
// empty, httpListen (host:port; port 0 picks a free one). A nil log
// discards.
//
// The gRPC server carries the Worker service, the health service and the
// KVTransfer service (the engine receives pushed KV blocks on every role).
// Prefill pushes over one transfer.NewGRPC transport, closed by Close,
// unless WithTransport gives another.
func Start(cfg Config, grpcListen, httpListen string, log *slog.Logger, opts ...StartOption) (*Worker, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var o startOptions
	for _, opt := range opts {
		opt(&o)
	}
	e, err := New(cfg)
	if err != nil {
		return nil, err
	}
	gl, err := net.Listen("tcp", grpcListen)
	if err != nil {
		e.Close()
		return nil, fmt.Errorf("grpc listener: %w", err)
	}
	var hl net.Listener
	if httpListen != "" {
		if hl, err = net.Listen("tcp", httpListen); err != nil {
			gl.Close()
			e.Close()
			return nil, fmt.Errorf("http listener: %w", err)
		}
	}
	w := &Worker{Engine: e, GRPCAddr: gl.Addr().String(), Transport: o.transport}
	if w.Transport == nil {
		var topts []transfer.Option
		if o.clientTLS != nil {
			topts = append(topts, transfer.WithTransportCredentials(credentials.NewTLS(o.clientTLS)))
		}
		w.Transport, w.ownTransport = transfer.NewGRPC(topts...), true
	}
	w.server = NewServer(e, WithServerTransport(w.Transport))
	maxReq := o.maxRequestBytes
	if maxReq <= 0 {
		maxReq = DefaultMaxRequestBytes
	}
	sopts := append(transfer.ServerOptions(),
		grpc.KeepaliveEnforcementPolicy(grpcworker.KeepaliveEnforcement),
		grpc.MaxRecvMsgSize(maxReq))
	if o.serverTLS != nil {
		sopts = append(sopts, grpc.Creds(credentials.NewTLS(o.serverTLS)))
	}
	w.grpc = grpc.NewServer(sopts...)
	w.server.Register(w.grpc)
	transfer.NewGRPCServer(e).Register(w.grpc)
	if hl != nil {
		w.HTTPAddr = hl.Addr().String()
		api := openai.NewServer(e.Config().Models, e.Generate, 0, log)
		w.http = &http.Server{Handler: api, ReadHeaderTimeout: 10 * time.Second, TLSConfig: o.httpTLS}
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		if err := w.grpc.Serve(gl); err != nil {
			log.Error("grpc serve", "err", err)
		}
	}()
	if hl != nil {
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			serve := w.http.Serve
			if o.httpTLS != nil {
				serve = func(l net.Listener) error { return w.http.ServeTLS(l, "", "") }
			}
			if err := serve(hl); !errors.Is(err, http.ErrServerClosed) {
				log.Error("http serve", "err", err)
			}
		}()
	}
	return w, nil
}

// DrainWriteTimeout bounds, after a drain, the writing of the worker's
// hottest blocks to the shared tier.
const DrainWriteTimeout = 5 * time.Second

// DrainResult is what a drain did.
type DrainResult struct {
	// Left is the calls (gRPC Generate, Decode, Prefill) still running
	// when the drain's context ended; 0 when every one finished.
	Left int
	// HotBlocks is the blocks written to the shared tier.
	HotBlocks int
}

// Drain stops the worker gracefully, before Close: its gRPC health turns
// NOT_SERVING (schedulers stop routing to it), new sequences are refused
// with gRPC Unavailable (ErrDraining; a scheduler retries them on another
// worker) and those running go on until they end or ctx does. Then, with
// a shared tier, it writes up to Config.Tiers.StoreQueue of its most
// recently used blocks there (Engine.WriteHot), within DrainWriteTimeout.
func (w *Worker) Drain(ctx context.Context) DrainResult {
	w.server.Shutdown()
	w.Engine.Drain()
	httpDone := make(chan struct{})
	go func() {
		defer close(httpDone)
		if w.http != nil {
			w.http.Shutdown(ctx) // its requests are sequences too
		}
	}()
	var res DrainResult
	if !w.waitIdle(ctx) {
		res.Left = w.server.Calls()
	}
	<-httpDone
	wctx, cancel := context.WithTimeout(context.Background(), DrainWriteTimeout)
	defer cancel()
	res.HotBlocks = w.Engine.WriteHot(wctx, w.Engine.Config().Tiers.StoreQueue)
	return res
}

// waitIdle waits until the engine runs no sequence and no call is being
// answered, or ctx ends; it reports whether the worker became idle.
func (w *Worker) waitIdle(ctx context.Context) bool {
	t := time.NewTicker(drainPoll)
	defer t.Stop()
	for !w.Engine.Idle() || w.server.Calls() > 0 {
		select {
		case <-t.C:
		case <-ctx.Done():
			return false
		}
	}
	return true
}

// Close stops serving at once (in-flight streams fail, as when a worker
// dies) and closes the engine. It is idempotent.
func (w *Worker) Close() error {
	w.once.Do(func() {
		w.server.Shutdown()
		w.grpc.Stop()
		if w.http != nil {
			w.http.Close()
		}
		w.wg.Wait()
		if w.ownTransport {
			w.Transport.Close()
		}
		w.Engine.Close()
	})
	return nil
}
