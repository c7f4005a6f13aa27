package scheduler

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// TestEngineTLSConfig: a worker's tls is checked at start, its errors
// naming the field: only https engines have it, and its files must hold
// what they should.
func TestEngineTLSConfig(t *testing.T) {
	ca := tlstest.NewCA(t, "engines")
	p := ca.Issue("scheduler")
	notPEM := filepath.Join(t.TempDir(), "not.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing.pem")
	good := tlsconf.Config{CAFile: ca.File, CertFile: p.CertFile, KeyFile: p.KeyFile, ServerName: "vllm.internal"}
	valid := func() Config {
		return Config{Workers: []WorkerConfig{{Address: "127.0.0.1:9000"},
			{Name: "v", Address: "https://127.0.0.1:8000", Kind: KindVLLM, TLS: good}}}
	}
	if err := valid().Validate(registry()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	cases := []struct {
		name string
		tls  tlsconf.Config
		edit func(*Config)
		want string
	}{
		{"grpc worker", good, func(c *Config) { c.Workers[0].TLS = c.Workers[1].TLS }, "workers[0].tls: grpc workers are reached with worker_tls"},
		{"http address", good, func(c *Config) { c.Workers[1].Address = "http://127.0.0.1:8000" }, "workers[1].tls: set, but the address"},
		{"missing CA file", tlsconf.Config{CAFile: missing}, nil, "workers[1].tls.ca_file: "},
		{"CA file without PEM", tlsconf.Config{CAFile: notPEM}, nil, "workers[1].tls.ca_file: " + notPEM + ": no PEM certificate"},
		{"certificate without key", tlsconf.Config{CertFile: p.CertFile}, nil, "workers[1].tls.key_file: required with workers[1].tls.cert_file"},
		{"key without certificate", tlsconf.Config{KeyFile: p.KeyFile}, nil, "workers[1].tls.cert_file: required with workers[1].tls.key_file"},
		{"key of another certificate", tlsconf.Config{CertFile: p.CertFile, KeyFile: ca.Issue("other").KeyFile}, nil, "workers[1].tls.cert_file: "},
		{"missing certificate", tlsconf.Config{CertFile: missing, KeyFile: p.KeyFile}, nil, "workers[1].tls.cert_file: "},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := valid()
			c.Workers[1].TLS = tc.tls
			if tc.edit != nil {
				tc.edit(&c)
			}
			err := c.Validate(registry())
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error starting %q", err, tc.want)
			}
		})
	}

	// Discovered engines: the template's tls makes their addresses https.
	d := Config{Discovery: DiscoveryConfig{Mode: DiscoveryDNS, DNS: discovery.DNSConfig{Name: "vllm.default.svc", Port: 8000},
		Worker: WorkerConfig{Kind: KindVLLM, TLS: good}}}
	if err := d.Validate(registry()); err != nil {
		t.Errorf("dns discovery with the workers' tls: %v", err)
	}
	d.Discovery.Worker.TLS = tlsconf.Config{CAFile: notPEM}
	if err := d.Validate(registry()); err == nil || !strings.HasPrefix(err.Error(), "discovery.worker.tls.ca_file: ") {
		t.Errorf("dns discovery with a bad CA file: got %v, want an error naming discovery.worker.tls.ca_file", err)
	}
	wc, err := memberConfig(discovery.Member{Name: "w", Address: "10.0.0.7:8000"}, WorkerConfig{Kind: KindVLLM, TLS: good})
	if err != nil || wc.Address != "https://10.0.0.7:8000" {
		t.Errorf("discovered worker: address %q, %v; want https://10.0.0.7:8000", wc.Address, err)
	}
}

func TestEngineTLSFromYAML(t *testing.T) {
	ca := tlstest.NewCA(t, "engines")
	path := filepath.Join(t.TempDir(), "baton.yaml")
	yaml := "workers:\n  - address: https://vllm-0.internal:8000\n    kind: vllm\n    tls:\n      ca_file: " + ca.File + "\n      server_name: vllm.internal\n"
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.Workers[0].TLS, (tlsconf.Config{CAFile: ca.File, ServerName: "vllm.internal"}); got != want {
		t.Errorf("workers[0].tls = %+v, want %+v", got, want)
	}
	if err := c.Validate(registry()); err != nil {
		t.Errorf("Validate: %v", err)
	}
}
