package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

func TestTLSFlagErrors(t *testing.T) {
	ca := tlstest.NewCA(t, "flags")
	p := ca.Issue("127.0.0.1")
	missing := filepath.Join(t.TempDir(), "missing.pem")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--worker", "127.0.0.1:1", "--tls-cert-file", missing, "--tls-key-file", p.KeyFile}, "--tls-cert-file: "},
		{[]string{"serve", "--worker", "127.0.0.1:1", "--tls-cert-file", p.CertFile, "--tls-key-file", missing}, "--tls-key-file: "},
		{[]string{"serve", "--worker", "127.0.0.1:1", "--tls-key-file", p.KeyFile}, "--tls-cert-file: required"},
		{[]string{"worker", "--listen", "127.0.0.1:0", "--tls-ca-file", ca.File}, "--tls-cert-file: required"},
		{[]string{"worker", "--listen", "127.0.0.1:0", "--tls-cert-file", p.CertFile, "--tls-key-file", p.KeyFile, "--tls-ca-file", missing}, "--tls-ca-file: "},
		{[]string{"worker", "--listen", "127.0.0.1:0", "--tls-cert-file", p.CertFile, "--tls-key-file", ca.File}, "--tls-cert-file: "},
	}
	for _, c := range cases {
		err := run(context.Background(), c.args, io.Discard, io.Discard)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v, want an error starting %q", c.args, err, c.want)
		}
	}
}

// runCommand runs baton with args until the test ends and returns the
// first match of re's group 1 in its logs.
func runCommand(t *testing.T, re string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, io.Discard, &logs) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s ended with %v", args[0], err)
		}
	})
	return logs.waitMatch(t, re, done)[1]
}

// TestServeAndWorkerOverMutualTLS: baton worker with its TLS flags, baton
// serve with worker_tls in its config file and HTTPS by flags; the
// official client gets a completion over HTTPS through the scheduler.
func TestServeAndWorkerOverMutualTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "fleet")
	wp, sp, fp := ca.Issue("127.0.0.1"), ca.Issue("scheduler"), ca.Issue("127.0.0.1")
	worker := runCommand(t, `grpc=(\S+)`, "worker", "--listen", "127.0.0.1:0", "--time-scale", "500",
		"--tls-cert-file", wp.CertFile, "--tls-key-file", wp.KeyFile, "--tls-ca-file", ca.File)

	config := filepath.Join(t.TempDir(), "baton.yaml")
	yaml := fmt.Sprintf("worker_tls:\n  ca_file: %s\n  cert_file: %s\n  key_file: %s\nworkers:\n  - address: %s\n",
		ca.File, sp.CertFile, sp.KeyFile, worker)
	if err := os.WriteFile(config, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := runCommand(t, `scheduler listening" addr=(\S+) tls=true`, "serve", "--listen", "127.0.0.1:0", "--config", config,
		"--tls-cert-file", fp.CertFile, "--tls-key-file", fp.KeyFile)

	b, err := os.ReadFile(ca.File)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(b)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	defer tr.CloseIdleConnections()
	c := openai.NewClient(option.WithBaseURL("https://"+addr+"/v1"), option.WithAPIKey("x"),
		option.WithHTTPClient(&http.Client{Transport: tr}), option.WithMaxRetries(0))
	// The scheduler learns the worker's model once their handshake is
	// done; until then the model is unknown (404) or no worker is
	// available.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	retry := time.NewTicker(50 * time.Millisecond)
	defer retry.Stop()
	for {
		got, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:     "llama-3.1-8b",
			Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello over mutual TLS")},
			MaxTokens: openai.Int(4),
		})
		if err == nil {
			if len(got.Choices) != 1 || got.Choices[0].Message.Content == "" {
				t.Fatalf("completion %+v", got)
			}
			return
		}
		select {
		case <-retry.C:
		case <-ctx.Done():
			t.Fatalf("no completion over mutual TLS: %v", err)
		}
	}
}

// TestWorkerRedisCredentials: a worker whose Redis refuses its password or
// its TLS settings does not start, and says which flag is at fault; with
// the right ones it starts with the tier.
func TestWorkerRedisCredentials(t *testing.T) {
	const password = "worker-pass"
	ca := tlstest.NewCA(t, "redis")
	srv := ca.Issue("127.0.0.1")
	plain := redistest.StartWith(t, redistest.Options{Password: password})
	secure := redistest.StartWith(t, redistest.Options{Password: password, TLS: &redistest.TLS{
		CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.File,
	}})
	other := tlstest.NewCA(t, "other")
	refused := []struct {
		args []string
		want string
	}{
		{[]string{"--redis", "redis://:wrong-one@" + plain.Addr()}, "--redis: redis refused the client: password: WRONGPASS"},
		{[]string{"--redis", "redis://" + plain.Addr()}, "--redis: redis refused the client: password: NOAUTH"},
		{[]string{"--redis", "rediss://:" + password + "@" + secure.Addr(), "--redis-ca-file", other.File}, "--redis: redis refused the client: tls:"},
		{[]string{"--redis", "redis://" + plain.Addr(), "--redis-ca-file", ca.File}, "--redis-ca-file: set without redis.tls"},
		{[]string{"--redis-ca-file", ca.File}, "--redis-ca-file, --redis-cert-file, --redis-key-file: set without --redis"},
	}
	for _, c := range refused {
		args := append([]string{"worker", "--listen", "127.0.0.1:0"}, c.args...)
		err := run(context.Background(), args, io.Discard, io.Discard)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v, want an error starting %q", c.args, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "wrong-one") {
			t.Errorf("%v: the error shows the password: %v", c.args, err)
		}
	}
	for _, args := range [][]string{
		{"--redis", "redis://:" + password + "@" + plain.Addr()},
		{"--redis", "rediss://:" + password + "@" + secure.Addr(), "--redis-ca-file", ca.File},
	} {
		runCommand(t, `(redis_tier=true)`, append([]string{"worker", "--listen", "127.0.0.1:0"}, args...)...)
	}
}
