package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/batonllm/baton/workers/sim"
)

// debugServer is one of the worker's own HTTP listeners (metrics, pprof).
type debugServer struct {
	srv  *http.Server
	addr string
	done chan struct{}
}

// serveDebug serves h on addr until Close.
func serveDebug(flag, addr string, h http.Handler, log *slog.Logger) (*debugServer, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--%s: %w", flag, err)
	}
	s := &debugServer{srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}, addr: l.Addr().String(), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
			log.Error("debug listener", "flag", flag, "err", err)
		}
	}()
	return s, nil
}

// Close stops the listener and waits for it; nil is a no-op.
func (s *debugServer) Close() {
	if s == nil {
		return
	}
	s.srv.Close()
	<-s.done
}

// metricsHandler serves m's registry on /metrics.
func metricsHandler(m *sim.Metrics) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}))
	return mux
}

// pprofHandler serves net/http/pprof under /debug/pprof/, on a mux of its
// own (not http.DefaultServeMux).
func pprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// loopbackAddr checks that addr (host:port) names a loopback host:
// localhost or a loopback IP. An empty host would listen on every
// interface.
func loopbackAddr(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("%q is not a loopback address (use 127.0.0.1, [::1] or localhost): profiles expose the process", addr)
}
