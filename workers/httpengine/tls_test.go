package httpengine

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
	"github.com/batonllm/baton/workers/engine"
)

// TestEngineBehindHTTPSWithPrivateCA: an engine whose certificate a
// private CA signed and which requires client certificates. WithTLS
// (the CA and a client certificate) reaches it on every call: health,
// the model list, LoRA load and unload, completions. Without it, or
// with the CA alone, each call fails as the engine being unavailable,
// saying why.
func TestEngineBehindHTTPSWithPrivateCA(t *testing.T) {
	ca := tlstest.NewCA(t, "engines")
	srvPair, cliPair := ca.Issue("127.0.0.1"), ca.Issue("scheduler")
	srvTLS, _, err := tlsconf.Server(tlsconf.Config{CertFile: srvPair.CertFile, KeyFile: srvPair.KeyFile, CAFile: ca.File}, nil)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"m"}]}`)
	})
	mux.HandleFunc("POST "+LoadAdapterPath, func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST "+UnloadAdapterPath, func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	// httptest's StartTLS would serve its own certificate: a client that
	// sends no server name (an IP address) gets Certificates[0].
	l, err := tls.Listen("tcp", "127.0.0.1:0", srvTLS)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: mux, ErrorLog: log.New(io.Discard, "", 0)}
	served := make(chan struct{})
	go func() { defer close(served); hs.Serve(l) }()
	t.Cleanup(func() { hs.Close(); <-served })
	baseURL := "https://" + l.Addr().String()

	calls := func(c *Client) map[string]error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, describe := c.Describe(ctx)
		_, proxy := c.Proxy(ctx, &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{"model":"m"}`)}, httptest.NewRecorder(), nil)
		return map[string]error{
			"health":   c.Check(ctx),
			"models":   describe,
			"load":     c.LoadAdapter(ctx, engine.Adapter{Name: "a", Source: "/a"}),
			"unload":   c.UnloadAdapter(ctx, "a"),
			"complete": proxy,
		}
	}
	client := func(cfg tlsconf.Config) *Client {
		var opts []Option
		if cfg != (tlsconf.Config{}) {
			tc, _, err := tlsconf.Client(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			opts = append(opts, WithTLS(tc))
		}
		c, err := New(baseURL, opts...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}

	for call, err := range calls(client(tlsconf.Config{CAFile: ca.File, CertFile: cliPair.CertFile, KeyFile: cliPair.KeyFile})) {
		if err != nil {
			t.Errorf("%s with the CA and a client certificate: %v", call, err)
		}
	}
	refused := []struct {
		name string
		cfg  tlsconf.Config
		want string
	}{
		{"system roots", tlsconf.Config{}, "certificate signed by unknown authority"},
		{"CA without a client certificate", tlsconf.Config{CAFile: ca.File}, "certificate required"},
	}
	for _, r := range refused {
		for call, err := range calls(client(r.cfg)) {
			if !errors.Is(err, engine.ErrUnavailable) || !strings.Contains(err.Error(), r.want) {
				t.Errorf("%s, %s: got %v, want engine.ErrUnavailable saying %q", r.name, call, err, r.want)
			}
		}
	}
}
