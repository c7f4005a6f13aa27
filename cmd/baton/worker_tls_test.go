package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// httpsClient returns an HTTP client that trusts ca's certificate file
// and, if cert is not nil, presents it.
func httpsClient(t *testing.T, caFile string, cert *tlstest.Pair) *http.Client {
	t.Helper()
	b, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(b)
	cfg := &tls.Config{RootCAs: roots}
	if cert != nil {
		pair, err := tls.LoadX509KeyPair(cert.CertFile, cert.KeyFile)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	tr := &http.Transport{TLSClientConfig: cfg}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// chat asks for a short completion at baseURL with the official client.
func chat(baseURL string, hc *http.Client) (*openai.ChatCompletion, error) {
	c := openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey("x"),
		option.WithHTTPClient(hc), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "llama-3.1-8b",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello over HTTPS")},
		MaxTokens: openai.Int(4),
	})
}

// TestWorkerHTTPSEndpoint: baton worker's own OpenAI endpoint over HTTPS
// with client certificates required: the official client with the right
// CA and a certificate it signed gets a completion; one without a
// certificate, one that trusts another CA and one speaking plain HTTP are
// refused. A rotated certificate is served without a restart.
func TestWorkerHTTPSEndpoint(t *testing.T) {
	ca, other := tlstest.NewCA(t, "engines"), tlstest.NewCA(t, "other")
	srv, client := ca.Issue("127.0.0.1"), ca.Issue("scheduler")
	addr := runCommand(t, `http=(\S+)`, "worker", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--time-scale", "500",
		"--http-tls-cert-file", srv.CertFile, "--http-tls-key-file", srv.KeyFile, "--http-tls-ca-file", ca.File)

	got, err := chat("https://"+addr+"/v1", httpsClient(t, ca.File, &client))
	if err != nil {
		t.Fatalf("right CA, signed client certificate: %v", err)
	}
	if len(got.Choices) != 1 || got.Choices[0].Message.Content == "" {
		t.Fatalf("completion %+v", got)
	}

	refused := []struct {
		name string
		hc   *http.Client
		want string
	}{
		{"no client certificate", httpsClient(t, ca.File, nil), "certificate required"},
		{"server not trusted: wrong CA", httpsClient(t, other.File, &client), "certificate signed by unknown authority"},
	}
	for _, c := range refused {
		_, err := chat("https://"+addr+"/v1", c.hc)
		// Under TLS 1.3 the client may write its request before the
		// server's alert for the missing certificate arrives: it then
		// sees the connection closed rather than the alert.
		if err == nil || !(strings.Contains(err.Error(), c.want) ||
			c.name == "no client certificate" && closedEarly(err)) {
			t.Errorf("%s: got %v, want an error with %q", c.name, err, c.want)
		}
	}

	plain := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	defer plain.CloseIdleConnections()
	resp, err := plain.Get("http://" + addr + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "HTTPS") {
		t.Errorf("plain HTTP: status %d %q, want 400 saying the server is HTTPS", resp.StatusCode, body)
	}

	next := ca.Issue("127.0.0.1")
	tlstest.Replace(t, srv, next)
	hc := httpsClient(t, ca.File, &client)
	resp, err = hc.Get("https://" + addr + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if s := resp.TLS.PeerCertificates[0].SerialNumber; s.Cmp(next.Cert.SerialNumber) != 0 {
		t.Errorf("after rotation served serial %v, want the new certificate's %v", s, next.Cert.SerialNumber)
	}
}

// TestWorkerHTTPSWithoutClientCertificates: without --http-tls-ca-file any
// client that trusts the server is served.
func TestWorkerHTTPSWithoutClientCertificates(t *testing.T) {
	ca := tlstest.NewCA(t, "engines")
	srv := ca.Issue("127.0.0.1")
	addr := runCommand(t, `http=(\S+)`, "worker", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--time-scale", "500",
		"--http-tls-cert-file", srv.CertFile, "--http-tls-key-file", srv.KeyFile)
	if _, err := chat("https://"+addr+"/v1", httpsClient(t, ca.File, nil)); err != nil {
		t.Fatal(err)
	}
}

func TestWorkerHTTPSFlagErrors(t *testing.T) {
	ca := tlstest.NewCA(t, "flags")
	p := ca.Issue("127.0.0.1")
	missing := filepath.Join(t.TempDir(), "missing.pem")
	http := []string{"worker", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"}
	cases := []struct {
		args []string
		want string
	}{
		{append(http, "--http-tls-key-file", p.KeyFile), "--http-tls-cert-file: required"},
		{append(http, "--http-tls-cert-file", p.CertFile), "--http-tls-key-file: required"},
		{append(http, "--http-tls-cert-file", missing, "--http-tls-key-file", p.KeyFile), "--http-tls-cert-file: "},
		{append(http, "--http-tls-cert-file", p.CertFile, "--http-tls-key-file", p.KeyFile, "--http-tls-ca-file", missing), "--http-tls-ca-file: "},
		{append(http, "--http-tls-ca-file", ca.File), "--http-tls-cert-file: required"},
		{[]string{"worker", "--listen", "127.0.0.1:0", "--http-tls-cert-file", p.CertFile, "--http-tls-key-file", p.KeyFile}, "--http-tls-cert-file: set without --http-listen"},
	}
	for _, c := range cases {
		err := run(context.Background(), c.args, io.Discard, io.Discard)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v, want an error starting %q", c.args, err, c.want)
		}
	}
}

// TestWorkerReloadsCertificatesOnSIGHUP: SIGHUP has a worker read its
// certificates again, as baton serve does, rather than end it.
func TestWorkerReloadsCertificatesOnSIGHUP(t *testing.T) {
	ca := tlstest.NewCA(t, "engines")
	srv := ca.Issue("127.0.0.1")
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"worker", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
			"--http-tls-cert-file", srv.CertFile, "--http-tls-key-file", srv.KeyFile}, io.Discard, &logs)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker ended with %v", err)
		}
	}()
	logs.waitMatch(t, "worker listening", done) // its SIGHUP handler is in place
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	logs.waitMatch(t, "TLS certificates reloaded on SIGHUP", done)
}

// closedEarly reports whether err is a client's write or read on a
// connection the server closed during the handshake.
func closedEarly(err error) bool {
	for _, s := range []string{"use of closed network connection", "broken pipe", "connection reset by peer", "EOF"} {
		if strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}
