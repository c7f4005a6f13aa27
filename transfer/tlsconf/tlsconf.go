// Package tlsconf builds the tls.Configs of baton's links from PEM files:
// HTTPS on the scheduler's front end, mutual TLS between the scheduler and
// baton workers and between workers (KV transfer), and TLS to Redis.
//
// A certificate and its key are read again when either file changes
// (checked at each handshake, by inode, modification time and size, so a
// rename or a Kubernetes Secret's symlink swap counts) or when
// Reload is called, so a rotated certificate is served without a restart.
// A rotation that leaves the files unreadable or mismatched keeps the last
// good pair in use.
package tlsconf

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Config names the PEM files of one end of a link. The zero value means
// no TLS.
type Config struct {
	// CertFile and KeyFile are this end's certificate (chain) and private
	// key: a server's certificate, or a client's for mutual TLS. Set both
	// or neither.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// CAFile holds the CA certificates that sign the peer's certificate. On
	// a server it turns on mutual TLS: only clients with a certificate the
	// CA signed are accepted. On a client it replaces the system roots.
	CAFile string `yaml:"ca_file"`
	// ServerName is the name a client expects in the server's certificate.
	// Default: the host of the address dialled.
	ServerName string `yaml:"server_name"`
}

// Enabled reports whether any file is set.
func (c Config) Enabled() bool { return c.CertFile != "" || c.KeyFile != "" || c.CAFile != "" }

// Validate checks the files exist and hold what they should (a matching
// certificate and key; at least one CA certificate). field prefixes its
// errors, as "tls" gives "tls.cert_file: …". server requires a
// certificate.
func (c Config) Validate(field string, server bool) error {
	switch {
	case c.CertFile == "" && c.KeyFile != "":
		return fmt.Errorf("%s.cert_file: required with %s.key_file", field, field)
	case c.CertFile != "" && c.KeyFile == "":
		return fmt.Errorf("%s.key_file: required with %s.cert_file", field, field)
	case server && c.CertFile == "" && c.Enabled():
		return fmt.Errorf("%s.cert_file: required: a server needs a certificate", field)
	}
	if c.CertFile != "" {
		if _, err := loadPair(c.CertFile, c.KeyFile); err != nil {
			return fmt.Errorf("%s.%w", field, err)
		}
	}
	if c.CAFile != "" {
		if _, err := loadCA(c.CAFile); err != nil {
			return fmt.Errorf("%s.ca_file: %w", field, err)
		}
	}
	return nil
}

// Server returns the tls.Config of a server: its certificate re-read when
// the files change and, with a CA file, client certificates required and
// verified. The Certificate is returned too, for Reload. A nil log
// discards.
func Server(c Config, log *slog.Logger) (*tls.Config, *Certificate, error) {
	if c.CertFile == "" {
		return nil, nil, errors.New("cert_file: required: a server needs a certificate")
	}
	cert, err := NewCertificate(c.CertFile, c.KeyFile, log)
	if err != nil {
		return nil, nil, err
	}
	cfg := &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: cert.GetCertificate,
	}
	if c.CAFile != "" {
		pool, err := loadCA(c.CAFile)
		if err != nil {
			return nil, nil, fmt.Errorf("ca_file: %w", err)
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, cert, nil
}

// Client returns the tls.Config of a client: the server verified against
// the CA file (else the system roots) under ServerName (else the host
// dialled: gRPC and go-redis fill it in), and, with a certificate, that
// certificate presented, re-read when its files change. A nil log
// discards.
func Client(c Config, log *slog.Logger) (*tls.Config, *Certificate, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: c.ServerName}
	if c.CAFile != "" {
		pool, err := loadCA(c.CAFile)
		if err != nil {
			return nil, nil, fmt.Errorf("ca_file: %w", err)
		}
		cfg.RootCAs = pool
	}
	var cert *Certificate
	if c.CertFile != "" {
		var err error
		if cert, err = NewCertificate(c.CertFile, c.KeyFile, log); err != nil {
			return nil, nil, err
		}
		cfg.GetClientCertificate = cert.GetClientCertificate
	}
	return cfg, cert, nil
}

// Certificate is a certificate and key read from files, read again when
// they change. Safe for concurrent use.
type Certificate struct {
	certFile, keyFile string
	log               *slog.Logger

	mu      sync.Mutex
	pair    *tls.Certificate
	version [2]fileVersion // of certFile, keyFile when pair was read
}

// fileVersion tells one version of a file from the next.
type fileVersion struct {
	mod   time.Time
	size  int64
	inode uint64
}

// NewCertificate reads the pair. A nil log discards.
func NewCertificate(certFile, keyFile string, log *slog.Logger) (*Certificate, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Certificate{certFile: certFile, keyFile: keyFile, log: log}
	if err := c.Reload(); err != nil {
		return nil, err
	}
	return c, nil
}

// Reload reads the files again, whether or not they changed. On error the
// pair in use stays.
func (c *Certificate) Reload() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reload(c.stat())
}

// reload reads the pair, recording v as its files' versions. c.mu is held.
func (c *Certificate) reload(v [2]fileVersion) error {
	pair, err := loadPair(c.certFile, c.keyFile)
	if err != nil {
		return err
	}
	c.pair, c.version = pair, v
	return nil
}

// stat returns the files' versions; a file that cannot be stat'ed has the
// zero version.
func (c *Certificate) stat() [2]fileVersion {
	var v [2]fileVersion
	for i, name := range []string{c.certFile, c.keyFile} {
		if fi, err := os.Stat(name); err == nil {
			v[i] = fileVersion{fi.ModTime(), fi.Size(), inode(fi)}
		}
	}
	return v
}

// current returns the pair, read again first if its files changed.
func (c *Certificate) current() *tls.Certificate {
	c.mu.Lock()
	defer c.mu.Unlock()
	if v := c.stat(); v != c.version {
		if err := c.reload(v); err != nil {
			// Logged once per version: a half-written rotation is
			// retried at the next handshake after the files change.
			c.version = v
			c.log.Error("tls certificate not reloaded; the previous one stays", "cert_file", c.certFile, "err", err)
		} else {
			c.log.Info("tls certificate reloaded", "cert_file", c.certFile, "not_after", c.pair.Leaf.NotAfter)
		}
	}
	return c.pair
}

// Leaf returns the certificate in use (for logs and tests).
func (c *Certificate) Leaf() *x509.Certificate { return c.current().Leaf }

// GetCertificate is a tls.Config.GetCertificate.
func (c *Certificate) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return c.current(), nil
}

// GetClientCertificate is a tls.Config.GetClientCertificate.
func (c *Certificate) GetClientCertificate(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return c.current(), nil
}

// loadPair reads a certificate and its key; its errors start with the
// field at fault.
func loadPair(certFile, keyFile string) (*tls.Certificate, error) {
	if _, err := os.Stat(certFile); err != nil {
		return nil, fmt.Errorf("cert_file: %w", err)
	}
	if _, err := os.Stat(keyFile); err != nil {
		return nil, fmt.Errorf("key_file: %w", err)
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("cert_file: %s with key_file %s: %w", certFile, keyFile, err)
	}
	return &pair, nil // Leaf is set by LoadX509KeyPair
}

// loadCA reads a PEM file of CA certificates.
func loadCA(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("%s: no PEM certificate in it", file)
	}
	return pool, nil
}
