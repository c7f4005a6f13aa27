package tlsconf_test

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// serve accepts TLS connections on a loopback port with cfg, completes
// each handshake and closes it, until the test ends.
func serve(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	l, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { l.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_ = c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	return l.Addr().String()
}

// handshake dials addr with cfg and returns the server's leaf certificate
// or the error, which a refused client certificate makes appear at the
// first read.
func handshake(addr string, cfg *tls.Config) (*x509.Certificate, error) {
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	if _, err := c.Read(make([]byte, 1)); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return c.ConnectionState().PeerCertificates[0], nil
}

func TestRotatedCertificateServedWithoutRestart(t *testing.T) {
	ca := tlstest.NewCA(t, "test")
	first := ca.Issue("localhost", "127.0.0.1")
	srv, cert, err := tlsconf.Server(tlsconf.Config{CertFile: first.CertFile, KeyFile: first.KeyFile}, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, srv)
	cli, _, err := tlsconf.Client(tlsconf.Config{CAFile: ca.File, ServerName: "localhost"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := handshake(addr, cli)
	if err != nil {
		t.Fatal(err)
	}
	if got.SerialNumber.Cmp(first.Cert.SerialNumber) != 0 {
		t.Fatalf("served serial %v, want the first certificate's %v", got.SerialNumber, first.Cert.SerialNumber)
	}

	second := ca.Issue("localhost", "127.0.0.1")
	tlstest.Replace(t, first, second)
	if got, err = handshake(addr, cli); err != nil {
		t.Fatal(err)
	}
	if got.SerialNumber.Cmp(second.Cert.SerialNumber) != 0 {
		t.Fatalf("after rotation served serial %v, want the new certificate's %v", got.SerialNumber, second.Cert.SerialNumber)
	}

	// A rotation that leaves a broken file keeps the last good pair.
	if err := os.WriteFile(first.KeyFile, []byte("not a key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err = handshake(addr, cli); err != nil {
		t.Fatal(err)
	}
	if got.SerialNumber.Cmp(second.Cert.SerialNumber) != 0 {
		t.Fatalf("after a broken rotation served serial %v, want the last good %v", got.SerialNumber, second.Cert.SerialNumber)
	}
	if err := cert.Reload(); err == nil || !strings.Contains(err.Error(), "cert_file") {
		t.Errorf("Reload of a broken pair: %v, want an error naming cert_file", err)
	}
}

func TestMutualTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "fleet")
	other := tlstest.NewCA(t, "other")
	server := ca.Issue("worker-0")
	srv, _, err := tlsconf.Server(tlsconf.Config{CertFile: server.CertFile, KeyFile: server.KeyFile, CAFile: ca.File}, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, srv)

	client := ca.Issue("scheduler")
	foreign := other.Issue("scheduler")
	cases := []struct {
		name    string
		cfg     tlsconf.Config
		wantErr string // "" for success
	}{
		{"signed client, right CA and name", tlsconf.Config{CAFile: ca.File, CertFile: client.CertFile, KeyFile: client.KeyFile, ServerName: "worker-0"}, ""},
		{"no client certificate", tlsconf.Config{CAFile: ca.File, ServerName: "worker-0"}, "certificate required"},
		{"client signed by another CA", tlsconf.Config{CAFile: ca.File, CertFile: foreign.CertFile, KeyFile: foreign.KeyFile, ServerName: "worker-0"}, "unknown certificate authority"},
		{"server not trusted: wrong CA", tlsconf.Config{CAFile: other.File, CertFile: client.CertFile, KeyFile: client.KeyFile, ServerName: "worker-0"}, "certificate signed by unknown authority"},
		{"server name not in the certificate", tlsconf.Config{CAFile: ca.File, CertFile: client.CertFile, KeyFile: client.KeyFile, ServerName: "worker-1"}, "not worker-1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cli, _, err := tlsconf.Client(tc.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, err = handshake(addr, cli)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("handshake: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("handshake: %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	ca := tlstest.NewCA(t, "test")
	p := ca.Issue("localhost")
	q := ca.Issue("localhost")
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.pem")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	cases := []struct {
		name   string
		cfg    tlsconf.Config
		server bool
		want   string // error prefix, "" for valid
	}{
		{"zero", tlsconf.Config{}, true, ""},
		{"server pair", tlsconf.Config{CertFile: p.CertFile, KeyFile: p.KeyFile}, true, ""},
		{"mutual", tlsconf.Config{CertFile: p.CertFile, KeyFile: p.KeyFile, CAFile: ca.File}, true, ""},
		{"client CA only", tlsconf.Config{CAFile: ca.File}, false, ""},
		{"server CA only", tlsconf.Config{CAFile: ca.File}, true, "tls.cert_file: required"},
		{"key without cert", tlsconf.Config{KeyFile: p.KeyFile}, false, "tls.cert_file: required with tls.key_file"},
		{"cert without key", tlsconf.Config{CertFile: p.CertFile}, false, "tls.key_file: required with tls.cert_file"},
		{"missing cert", tlsconf.Config{CertFile: missing, KeyFile: p.KeyFile}, false, "tls.cert_file: "},
		{"missing key", tlsconf.Config{CertFile: p.CertFile, KeyFile: missing}, false, "tls.key_file: "},
		{"mismatched key", tlsconf.Config{CertFile: p.CertFile, KeyFile: q.KeyFile}, false, "tls.cert_file: "},
		{"missing CA", tlsconf.Config{CAFile: missing}, false, "tls.ca_file: "},
		{"empty CA", tlsconf.Config{CAFile: empty}, false, "tls.ca_file: "},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate("tls", tc.server)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate: %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.want)):
				t.Fatalf("Validate: %v, want an error starting %q", err, tc.want)
			}
		})
	}
}
