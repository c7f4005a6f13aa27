package scheduler_test

import (
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

// engineTLS is a private CA, an engine's server config signed by it that
// requires client certificates it signed, and the scheduler's client
// certificate.
type engineTLS struct {
	ca        *tlstest.CA
	server    *tls.Config
	scheduler tlstest.Pair
}

func newEngineTLS(t *testing.T) engineTLS {
	t.Helper()
	ca := tlstest.NewCA(t, "engines")
	p := ca.Issue("127.0.0.1")
	srv, _, err := tlsconf.Server(tlsconf.Config{CertFile: p.CertFile, KeyFile: p.KeyFile, CAFile: ca.File}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return engineTLS{ca: ca, server: srv, scheduler: ca.Issue("scheduler")}
}

// serveTLS serves h over HTTPS with cfg on a loopback port until the test
// ends, and returns its base URL. (httptest's StartTLS would serve its own
// certificate to a client that sends no server name.)
func serveTLS(t *testing.T, h http.Handler, cfg *tls.Config) string {
	t.Helper()
	l, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h, ErrorLog: log.New(io.Discard, "", 0)}
	served := make(chan struct{})
	go func() { defer close(served); hs.Serve(l) }()
	t.Cleanup(func() { hs.Close(); <-served })
	return "https://" + l.Addr().String()
}

// TestEngineOverHTTPSWithPrivateCA: vLLM and llama.cpp engines behind
// https whose certificate a private CA signed, and which require a client
// certificate. With the worker's tls naming the CA and a client
// certificate, the scheduler describes each (/v1/models), checks its
// health, scrapes its metrics, tokenizes with vLLM's /tokenize (kv_aware)
// and relays a completion from it.
func TestEngineOverHTTPSWithPrivateCA(t *testing.T) {
	et := newEngineTLS(t)
	vllmEng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	llama := llamatest.Start(t, llamatest.Config{Model: model})
	llamaURL, err := url.Parse(llama.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(llamaURL)
	proxy.FlushInterval = -1
	clientTLS := tlsconf.Config{CAFile: et.ca.File, CertFile: et.scheduler.CertFile, KeyFile: et.scheduler.KeyFile}
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "kv_aware",
		Pool:     fastPool(),
		Workers: []scheduler.WorkerConfig{ // no models: asked of /v1/models
			{Name: "vllm-0", Address: serveTLS(t, vllmEng.srv.Config.Handler, et.server), Kind: scheduler.KindVLLM, TLS: clientTLS},
			{Name: "llama-0", Address: serveTLS(t, proxy, et.server), Kind: scheduler.KindLlamaCPP, TLS: clientTLS},
		},
	})
	c, hc := oaClient(t, addr), httpClient(t)
	served := map[string]bool{}
	eventually(t, 20*time.Second, func() error {
		got := chat(t, c, chatParams(fmt.Sprintf("hello over https %d", len(served)), 4))
		if got.content == "" {
			return fmt.Errorf("empty completion from %s", got.worker)
		}
		served[got.worker] = true
		if !served["vllm-0"] || !served["llama-0"] {
			return fmt.Errorf("served by %v so far", served)
		}
		return nil
	})
	if vllmEng.tokenizeCalls() == 0 {
		t.Error("vLLM's /tokenize was never called")
	}
	eventually(t, 10*time.Second, func() error {
		m := scrape(t, hc, addr)
		for _, w := range []string{"vllm-0", "llama-0"} {
			if v, _ := metric(m, "baton_engine_scrapes_total", `worker="`+w+`"`, `outcome="ok"`); v == 0 {
				return fmt.Errorf("no scrape of %s's metrics succeeded", w)
			}
			if v, _ := metric(m, "baton_worker_healthy", `worker="`+w+`"`); v != 1 {
				return fmt.Errorf("baton_worker_healthy{worker=%q} = %v, want 1", w, v)
			}
		}
		return nil
	})
}

// TestEngineOverHTTPSRefused: without the CA, or without the client
// certificate the engine requires, the handshake fails: requests get an
// OpenAI 503, the log says why, the worker turns unhealthy and, once it
// has, requests no longer reach it, so its breaker stays still.
func TestEngineOverHTTPSRefused(t *testing.T) {
	et := newEngineTLS(t)
	cases := []struct {
		name string
		tls  tlsconf.Config
		want string // in the log
	}{
		{"no ca_file: the system roots", tlsconf.Config{}, "certificate signed by unknown authority"},
		{"no client certificate", tlsconf.Config{CAFile: et.ca.File}, "certificate required"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			eng := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
			url := serveTLS(t, eng.srv.Config.Handler, et.server)
			rec := &logRecorder{level: slog.LevelInfo}
			f := startFleetSpec(t, simfleet.Spec{Log: slog.New(rec), Scheduler: scheduler.Config{
				Pool: fastPool(),
				Workers: []scheduler.WorkerConfig{{
					Name: "vllm-0", Address: url, Kind: scheduler.KindVLLM, Models: []string{model}, TLS: tc.tls,
				}},
			}})
			hc := httpClient(t)
			body := fmt.Sprintf(`{"model":%q,"max_tokens":4,"messages":[{"role":"user","content":"hello"}]}`, model)
			res := do(t, hc, http.MethodPost, "http://"+f.Addr+"/v1/chat/completions", body, nil)
			if res.status != http.StatusServiceUnavailable {
				t.Fatalf("status %d %s, want 503", res.status, res.body)
			}
			decodeError(t, res.body)
			eventually(t, 10*time.Second, func() error {
				if v, _ := metric(scrape(t, hc, f.Addr), "baton_worker_healthy", `worker="vllm-0"`); v != 0 {
					return fmt.Errorf("baton_worker_healthy = %v, want 0", v)
				}
				return nil
			})
			if !strings.Contains(strings.Join(rec.messages(), "\n"), tc.want) {
				t.Errorf("no log says %q:\n%s", tc.want, strings.Join(rec.messages(), "\n"))
			}
			before, _ := metric(scrape(t, hc, f.Addr), "baton_breaker_transitions_total", `worker="vllm-0"`)
			// Past two breaker open timeouts: an open breaker the
			// requests kept probing would have moved meanwhile.
			deadline := time.Now().Add(2*fastPool().BreakerOpenTimeout + 100*time.Millisecond)
			for n := 0; n < 10 || time.Now().Before(deadline); n++ {
				if res := do(t, hc, http.MethodPost, "http://"+f.Addr+"/v1/chat/completions", body, nil); res.status != http.StatusServiceUnavailable {
					t.Fatalf("status %d %s, want 503", res.status, res.body)
				}
			}
			after, _ := metric(scrape(t, hc, f.Addr), "baton_breaker_transitions_total", `worker="vllm-0"`)
			if after > before+1 {
				t.Errorf("breaker transitions went from %v to %v while the worker was unhealthy", before, after)
			}
			eng.mu.Lock()
			defer eng.mu.Unlock()
			if eng.chats != 0 {
				t.Errorf("the engine served %d completions without a handshake", eng.chats)
			}
		})
	}
}
