package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc"

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

	server *Server
	grpc   *grpc.Server
	http   *http.Server
	wg     sync.WaitGroup
	once   sync.Once
}

// Start starts an engine from cfg and serves it on grpcListen and, unless
// empty, httpListen (host:port; port 0 picks a free one). A nil log
// discards.
func Start(cfg Config, grpcListen, httpListen string, log *slog.Logger) (*Worker, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
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
	w := &Worker{Engine: e, GRPCAddr: gl.Addr().String(), server: NewServer(e)}
	w.grpc = grpc.NewServer(grpc.KeepaliveEnforcementPolicy(grpcworker.KeepaliveEnforcement))
	w.server.Register(w.grpc)
	var hl net.Listener
	if httpListen != "" {
		if hl, err = net.Listen("tcp", httpListen); err != nil {
			gl.Close()
			e.Close()
			return nil, fmt.Errorf("http listener: %w", err)
		}
		w.HTTPAddr = hl.Addr().String()
		api := openai.NewServer(e.Config().Models, e.Generate, 0, log)
		w.http = &http.Server{Handler: api, ReadHeaderTimeout: 10 * time.Second}
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
			if err := w.http.Serve(hl); !errors.Is(err, http.ErrServerClosed) {
				log.Error("http serve", "err", err)
			}
		}()
	}
	return w, nil
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
		w.Engine.Close()
	})
	return nil
}
