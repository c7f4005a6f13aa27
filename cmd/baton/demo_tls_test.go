package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// TestDemoOverHTTPS: with --tls-cert-file and --tls-key-file the demo's
// front end is HTTPS: the URL it prints is https, the official client
// trusting the CA gets a completion there, and plain HTTP is refused.
func TestDemoOverHTTPS(t *testing.T) {
	ca := tlstest.NewCA(t, "demo")
	p := ca.Issue("127.0.0.1")
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"demo", "--listen", "127.0.0.1:0", "--workers", "1", "--time-scale", "100", "--log-level", "warn",
			"--tls-cert-file", p.CertFile, "--tls-key-file", p.KeyFile}, &out, io.Discard)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("demo ended with %v", err)
		}
	})
	base := out.waitMatch(t, `base URL (\S+) `, done)[1]
	if !strings.HasPrefix(base, "https://") {
		t.Fatalf("demo printed base URL %q, want an https one:\n%s", base, out.String())
	}
	got, err := chat(base, httpsClient(t, ca.File, nil))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Choices) != 1 || got.Choices[0].Message.Content == "" {
		t.Fatalf("completion %+v", got)
	}
	plain := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	defer plain.CloseIdleConnections()
	resp, err := plain.Get("http://" + strings.TrimSuffix(strings.TrimPrefix(base, "https://"), "/v1") + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("plain HTTP to the demo's HTTPS port: status %d, want 400", resp.StatusCode)
	}
}
