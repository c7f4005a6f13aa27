package scheduler_test

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/grpc/credentials"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/sim"
)

// httpsHTTP is an HTTP client trusting the CA in caFile.
func httpsHTTP(t *testing.T, caFile string) *http.Client {
	t.Helper()
	b, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(b)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// httpsClient is oaClient over HTTPS, trusting the CA in caFile; its
// transport is returned too, to drop its connections.
func httpsClient(t *testing.T, addr, caFile string) (openai.Client, *http.Transport) {
	t.Helper()
	b, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(b)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return openai.NewClient(
		option.WithBaseURL("https://"+addr+"/v1"),
		option.WithAPIKey("x"),
		option.WithMaxRetries(0),
		option.WithHTTPClient(&http.Client{Transport: tr}),
	), tr
}

// servedSerial sends one chat completion and returns the serial number
// of the certificate the front end served for it.
func servedSerial(t *testing.T, c openai.Client) string {
	t.Helper()
	var resp *http.Response
	if _, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), chatParams("hello over tls", 4), option.WithResponseInto(&resp)); err != nil {
		t.Fatalf("chat completion over HTTPS: %v", err)
	}
	if resp.TLS == nil || len(resp.TLS.PeerCertificates) == 0 {
		t.Fatal("response came without TLS")
	}
	return resp.TLS.PeerCertificates[0].SerialNumber.String()
}

func TestHTTPSFrontEndRotatesCertificate(t *testing.T) {
	ca := tlstest.NewCA(t, "front")
	first := ca.Issue("127.0.0.1")
	_, workers := startWorkers(t, 1, fastScale)
	s, addr := startScheduler(t, scheduler.Config{
		Workers: workers,
		TLS:     tlsconf.Config{CertFile: first.CertFile, KeyFile: first.KeyFile},
	})
	if !s.TLS() {
		t.Fatal("TLS() = false with tls.cert_file set")
	}
	c, tr := httpsClient(t, addr, ca.File)
	if got, want := servedSerial(t, c), first.Cert.SerialNumber.String(); got != want {
		t.Fatalf("served certificate %s, want %s", got, want)
	}

	// A certificate rotated on disk is served to the next connection,
	// without a restart.
	second := ca.Issue("127.0.0.1")
	tlstest.Replace(t, first, second)
	tr.CloseIdleConnections()
	if got, want := servedSerial(t, c), second.Cert.SerialNumber.String(); got != want {
		t.Fatalf("after rotation served certificate %s, want %s", got, want)
	}
	if err := s.ReloadCertificates(); err != nil {
		t.Errorf("ReloadCertificates: %v", err)
	}
	r := do(t, httpsHTTP(t, ca.File), http.MethodGet, "https://"+addr+"/metrics", "", nil)
	m := string(r.body)
	if v, _ := metric(m, "baton_tls_certificate_expiry_timestamp_seconds", `link="front"`); v != float64(second.Cert.NotAfter.Unix()) {
		t.Errorf("baton_tls_certificate_expiry_timestamp_seconds{link=\"front\"} = %v, want the new certificate's %d", v, second.Cert.NotAfter.Unix())
	}

	// A client that trusts another CA refuses the server.
	other := tlstest.NewCA(t, "other")
	wrong, _ := httpsClient(t, addr, other.File)
	_, err := wrong.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("hello", 4))
	if err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Errorf("client trusting another CA: %v, want an unknown authority error", err)
	}
	// Plain HTTP on the HTTPS port is refused.
	res := do(t, httpClient(t), http.MethodGet, "http://"+addr+"/healthz", "", nil)
	if res.status != http.StatusBadRequest {
		t.Errorf("plain HTTP to the HTTPS port: status %d, want 400", res.status)
	}
}

// mtlsFiles is one fleet's certificate authority and the TLS configs of
// its parts.
type mtlsFiles struct {
	ca               *tlstest.CA
	scheduler        tlsconf.Config // the scheduler's worker_tls
	workerServer     *tls.Config
	workerClient     *tls.Config
	schedulerRefused tlsconf.Config // signed by another CA
}

// newMTLS makes a CA, certificates for the workers naming names, and the
// configs of a fleet in mutual TLS. serverName, if set, is what clients
// expect in workers' certificates.
func newMTLS(t *testing.T, serverName string, names ...string) mtlsFiles {
	t.Helper()
	ca := tlstest.NewCA(t, "fleet")
	w := ca.Issue(names...)
	sched := ca.Issue("scheduler")
	srv, _, err := tlsconf.Server(tlsconf.Config{CertFile: w.CertFile, KeyFile: w.KeyFile, CAFile: ca.File}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cli, _, err := tlsconf.Client(tlsconf.Config{CertFile: w.CertFile, KeyFile: w.KeyFile, CAFile: ca.File, ServerName: serverName}, nil)
	if err != nil {
		t.Fatal(err)
	}
	foreign := tlstest.NewCA(t, "foreign").Issue("scheduler")
	return mtlsFiles{
		ca:               ca,
		scheduler:        tlsconf.Config{CAFile: ca.File, CertFile: sched.CertFile, KeyFile: sched.KeyFile, ServerName: serverName},
		workerServer:     srv,
		workerClient:     cli,
		schedulerRefused: tlsconf.Config{CAFile: ca.File, CertFile: foreign.CertFile, KeyFile: foreign.KeyFile, ServerName: serverName},
	}
}

// TestMutualTLSDisaggregated: a prefill and a decode worker that accept
// only clients the fleet's CA signed, a scheduler that verifies their
// certificates, over HTTPS: a request is prefilled on one worker, its KV
// blocks pushed to the other over mutual TLS, and decoded there.
func TestMutualTLSDisaggregated(t *testing.T) {
	for _, tc := range []struct{ name, serverName string }{
		{"address host", ""},
		{"server_name", "worker.baton.test"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			names := []string{"127.0.0.1"}
			if tc.serverName != "" {
				names = []string{tc.serverName} // the address's host is not in it
			}
			m := newMTLS(t, tc.serverName, names...)
			front := m.ca.Issue("127.0.0.1")
			f := startFleetSpec(t, simfleet.Spec{
				Prefill: 1, Decode: 1, Name: shortName,
				Config: func(string, string) sim.Config { return sim.Config{TimeScale: fastScale} },
				StartOptions: func(string, string) []sim.StartOption {
					return []sim.StartOption{sim.WithTLS(m.workerServer, m.workerClient)}
				},
				Scheduler: scheduler.Config{
					Strategy:  "prefix_aware",
					Pool:      fastPool(),
					TLS:       tlsconf.Config{CertFile: front.CertFile, KeyFile: front.KeyFile},
					WorkerTLS: m.scheduler,
				},
			})
			waitDescribed(t, f.Scheduler)
			c, _ := httpsClient(t, f.Addr, m.ca.File)
			prompt := text("mtls", 6000) // about 1,500 tokens: prefilled remotely
			got := chat(t, c, chatParams(prompt, 20))
			if !strings.HasPrefix(got.prefill, "p") || !strings.HasPrefix(got.worker, "d") || !strings.Contains(got.route, "prefill=remote") {
				t.Fatalf("prefill worker %q, decode worker %q, route %q: want a remote prefill", got.prefill, got.worker, got.route)
			}
			keys := userKeys(prompt)
			if n := f.Workers[1].Engine.Cache().Lookup(keys); n != len(keys) {
				t.Errorf("decode worker holds %d of %d blocks pushed over mutual TLS", n, len(keys))
			}
			r, err := streamChat(t, c, chatParams(text("mtls-stream", 6000), 20))
			if err != nil || r.content == "" {
				t.Fatalf("stream over mutual TLS: %+v, %v", r, err)
			}
		})
	}
}

// TestMutualTLSRefusals: a worker in mutual TLS refuses clients without a
// certificate or with one another CA signed, on its worker API and its
// KV transfer service alike; a client refuses a worker its CA did not
// sign or whose certificate does not name it.
func TestMutualTLSRefusals(t *testing.T) {
	m := newMTLS(t, "", "127.0.0.1")
	w, err := sim.Start(sim.Config{TimeScale: fastScale}, "127.0.0.1:0", "", nil, sim.WithTLS(m.workerServer, m.workerClient))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	other := tlstest.NewCA(t, "other")

	noCert := m.scheduler
	noCert.CertFile, noCert.KeyFile = "", ""
	wrongCA := m.scheduler
	wrongCA.CAFile = other.File
	wrongName := m.scheduler
	wrongName.ServerName = "worker.baton.test"
	cases := []struct {
		name    string
		cfg     tlsconf.Config
		wantErr string // "" for success, "*" for any error
	}{
		{"signed client", m.scheduler, ""},
		// In TLS 1.3 the client learns of a refused certificate after its
		// side of the handshake, as an alert or as a broken connection,
		// whichever comes first: any error.
		{"no client certificate", noCert, "*"},
		{"client signed by another CA", m.schedulerRefused, "*"},
		{"worker signed by another CA", wrongCA, "certificate signed by unknown authority"},
		{"worker certificate names another host", wrongName, "worker.baton.test"},
		{"plaintext", tlsconf.Config{}, "*"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var creds credentials.TransportCredentials
			if tc.cfg.Enabled() {
				cli, _, err := tlsconf.Client(tc.cfg, nil)
				if err != nil {
					t.Fatal(err)
				}
				creds = credentials.NewTLS(cli)
			}
			var opts []grpcworker.Option
			var topts []transfer.Option
			if creds != nil {
				opts = append(opts, grpcworker.WithTransportCredentials(creds))
				topts = append(topts, transfer.WithTransportCredentials(creds))
			}
			c, err := grpcworker.Dial(w.GRPCAddr, opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			tr := transfer.NewGRPC(topts...)
			defer tr.Close()
			_, derr := c.Describe(ctxT(t, 10*time.Second))
			_, herr := tr.Has(ctxT(t, 10*time.Second), w.GRPCAddr, []uint64{1})
			for what, err := range map[string]error{"worker API": derr, "KV transfer": herr} {
				switch {
				case tc.wantErr == "" && err != nil:
					t.Errorf("%s: %v", what, err)
				case tc.wantErr == "*" && err == nil:
					t.Errorf("%s: served, want an error", what)
				case tc.wantErr != "" && tc.wantErr != "*" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
					t.Errorf("%s: %v, want an error with %q", what, err, tc.wantErr)
				}
			}
		})
	}
}

// TestTLSConfigErrors: bad TLS settings fail New with the field named.
func TestTLSConfigErrors(t *testing.T) {
	ca := tlstest.NewCA(t, "cfg")
	p := ca.Issue("127.0.0.1")
	missing := t.TempDir() + "/missing.pem"
	workers := []scheduler.WorkerConfig{{Address: "127.0.0.1:1"}}
	cases := []struct {
		name string
		edit func(*scheduler.Config)
		want string
	}{
		{"front key missing", func(c *scheduler.Config) { c.TLS.CertFile = p.CertFile }, "tls.key_file: required"},
		{"front cert unreadable", func(c *scheduler.Config) { c.TLS = tlsconf.Config{CertFile: missing, KeyFile: p.KeyFile} }, "tls.cert_file: "},
		{"front CA only", func(c *scheduler.Config) { c.TLS.CAFile = ca.File }, "tls.cert_file: required"},
		{"front server_name", func(c *scheduler.Config) {
			c.TLS = tlsconf.Config{CertFile: p.CertFile, KeyFile: p.KeyFile, ServerName: "x"}
		}, "tls.server_name: "},
		{"worker CA unreadable", func(c *scheduler.Config) { c.WorkerTLS.CAFile = missing }, "worker_tls.ca_file: "},
		{"worker cert without key", func(c *scheduler.Config) { c.WorkerTLS.CertFile = p.CertFile }, "worker_tls.key_file: required"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := scheduler.Config{Workers: workers}
			tc.edit(&cfg)
			reg := &routing.Registry{}
			routing.RegisterBuiltins(reg)
			s, err := scheduler.New(cfg, reg, nil)
			if err == nil {
				s.Close()
				t.Fatalf("New accepted %+v", cfg)
			}
			if !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error starting %q", err, tc.want)
			}
		})
	}
}

// TestHTTPSClientCertificates: with tls.ca_file the front end serves only
// clients whose certificate that CA signed.
func TestHTTPSClientCertificates(t *testing.T) {
	ca := tlstest.NewCA(t, "front")
	srv := ca.Issue("127.0.0.1")
	_, workers := startWorkers(t, 1, fastScale)
	_, addr := startScheduler(t, scheduler.Config{
		Workers: workers,
		TLS:     tlsconf.Config{CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.File},
	})
	signed, foreign := ca.Issue("client"), tlstest.NewCA(t, "other").Issue("client")
	for _, tc := range []struct {
		name   string
		pair   *tlstest.Pair
		served bool
	}{
		{"signed client certificate", &signed, true},
		{"no client certificate", nil, false},
		{"client certificate another CA signed", &foreign, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, tr := httpsClient(t, addr, ca.File)
			if tc.pair != nil {
				pair, err := tls.LoadX509KeyPair(tc.pair.CertFile, tc.pair.KeyFile)
				if err != nil {
					t.Fatal(err)
				}
				tr.TLSClientConfig.Certificates = []tls.Certificate{pair}
			}
			_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("hello", 4))
			if tc.served && err != nil {
				t.Fatalf("chat completion: %v", err)
			}
			if !tc.served && err == nil {
				t.Fatal("chat completion served")
			}
		})
	}
}
