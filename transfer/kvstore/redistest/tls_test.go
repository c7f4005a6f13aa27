package redistest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

func TestStartWithPasswordAndTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "redis")
	p := ca.Issue("127.0.0.1")
	s := StartWith(t, Options{Password: "pw", TLS: &TLS{CertFile: p.CertFile, KeyFile: p.KeyFile, CAFile: ca.File, ClientCerts: true}})
	if err := s.ping(startTimeout); err != nil {
		t.Fatalf("PING with the password over TLS: %v", err)
	}
	// Neither plaintext nor a TLS client without the password is served.
	if err := ping(s.Addr(), startTimeout); err == nil {
		t.Error("plaintext PING answered by a TLS server")
	}
	noPass := &Server{port: s.port, opts: Options{TLS: s.opts.TLS}}
	if err := noPass.ping(startTimeout); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("PING without the password: %v, want NOAUTH", err)
	}
}

// A redis-server built without TLS (a fake: Debian's has TLS) makes
// StartWith skip, saying why, rather than fail or pass.
func TestStartWithTLSSkipsWithoutTLSSupport(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "redis-server")
	script := "#!/bin/sh\necho '# Cannot configure TLS - this Redis was not built with TLS support'\nexit 1\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvServer, bin)
	ca := tlstest.NewCA(t, "redis")
	p := ca.Issue("127.0.0.1")
	var skipped bool
	t.Run("tls", func(t *testing.T) {
		defer func() { skipped = t.Skipped() }()
		StartWith(t, Options{TLS: &TLS{CertFile: p.CertFile, KeyFile: p.KeyFile, CAFile: ca.File}})
	})
	if !skipped {
		t.Error("StartWith did not skip with a redis-server without TLS")
	}
}
