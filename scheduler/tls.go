package scheduler

import (
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"

	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/workers/grpcworker"
)

// tlsState is the scheduler's TLS: the front end's server config and the
// credentials grpc workers are dialled with.
type tlsState struct {
	front       *tls.Config // nil: plain HTTP
	workerCreds credentials.TransportCredentials
	certs       []*tlsconf.Certificate // what ReloadCertificates re-reads
}

// setupTLS builds s.tls from cfg's tls and worker_tls. Its errors name the
// field.
func (s *Scheduler) setupTLS(cfg Config) error {
	if cfg.TLS.Enabled() {
		front, cert, err := tlsconf.Server(cfg.TLS, s.log)
		if err != nil {
			return fmt.Errorf("tls.%w", err)
		}
		s.tls.front = front
		s.tls.certs = append(s.tls.certs, cert)
		s.certExpiry("front", cert)
	}
	if cfg.WorkerTLS.Enabled() {
		client, cert, err := tlsconf.Client(cfg.WorkerTLS, s.log)
		if err != nil {
			return fmt.Errorf("worker_tls.%w", err)
		}
		s.tls.workerCreds = credentials.NewTLS(client)
		if cert != nil {
			s.tls.certs = append(s.tls.certs, cert)
			s.certExpiry("workers", cert)
		}
	}
	return nil
}

// engineTLS returns the tls.Config an http, vllm, sglang or llamacpp
// worker's https engine is reached with, from its tls (a private CA, a
// client certificate): for its requests, health checks, model list, LoRA
// loads, metrics and tokenizer alike. Nil without tls: an https engine is
// then verified against the system roots.
func (s *Scheduler) engineTLS(wc WorkerConfig) (*tls.Config, error) {
	if wc.TLS == (tlsconf.Config{}) || !kindOfWorker(wc).URL {
		return nil, nil
	}
	cfg, _, err := tlsconf.Client(wc.TLS, s.log)
	if err != nil {
		return nil, fmt.Errorf("worker %s: tls.%w", wc.Name, err)
	}
	return cfg, nil
}

// certExpiry exports when cert, the one link uses, expires, so that an
// alert can fire before a rotation that never happened matters.
func (s *Scheduler) certExpiry(link string, cert *tlsconf.Certificate) {
	s.Metrics.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "baton_tls_certificate_expiry_timestamp_seconds",
		Help:        "When the TLS certificate in use expires (its NotAfter), in Unix seconds; link is front (HTTPS) or workers (the client certificate presented to workers).",
		ConstLabels: prometheus.Labels{"link": link},
	}, func() float64 { return float64(cert.Leaf().NotAfter.Unix()) }))
}

// workerDialOptions returns the options grpc workers are dialled with.
func (s *Scheduler) workerDialOptions() []grpcworker.Option {
	if s.tls.workerCreds == nil {
		return nil
	}
	return []grpcworker.Option{grpcworker.WithTransportCredentials(s.tls.workerCreds)}
}

// ReloadCertificates reads the front end's and the worker client's
// certificates again (baton serve does on SIGHUP; they are also re-read
// when their files change). On error the certificates in use stay.
func (s *Scheduler) ReloadCertificates() error {
	var errs []error
	for _, c := range s.tls.certs {
		if err := c.Reload(); err != nil {
			s.log.Error("tls certificate not reloaded; the previous one stays", "err", err)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// TLS reports whether the HTTP API is served over HTTPS.
func (s *Scheduler) TLS() bool { return s.tls.front != nil }
