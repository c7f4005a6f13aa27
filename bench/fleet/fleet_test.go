package fleet

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/workers/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fast runs the simulated clock fast enough that a completion takes
// milliseconds.
func fast(name, role string) sim.Config { return sim.Config{TimeScale: 500} }

func TestStartNamesAndRoles(t *testing.T) {
	short := func(role string, i int) string { return fmt.Sprintf("%c%d", role[0], i) }
	cases := []struct {
		name string
		spec Spec
		want []scheduler.WorkerConfig
	}{
		{"colocated", Spec{Workers: 2}, []scheduler.WorkerConfig{
			{Name: "both-0", Role: sim.RoleBoth}, {Name: "both-1", Role: sim.RoleBoth}}},
		{"disaggregated", Spec{Prefill: 1, Decode: 2}, []scheduler.WorkerConfig{
			{Name: "prefill-0", Role: sim.RolePrefill}, {Name: "decode-0", Role: sim.RoleDecode}, {Name: "decode-1", Role: sim.RoleDecode}}},
		{"named", Spec{Prefill: 1, Decode: 1, Name: short}, []scheduler.WorkerConfig{
			{Name: "p0", Role: sim.RolePrefill}, {Name: "d0", Role: sim.RoleDecode}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.spec.Config = fast
			f, err := Start(c.spec)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var got []scheduler.WorkerConfig
			for i, wc := range f.Configs {
				if wc.Address != f.Workers[i].GRPCAddr {
					t.Errorf("worker %s: address %s, its server is at %s", wc.Name, wc.Address, f.Workers[i].GRPCAddr)
				}
				if n := f.Workers[i].Engine.Config().Name; n != wc.Name {
					t.Errorf("worker %s: engine named %q", wc.Name, n)
				}
				wc.Address = ""
				got = append(got, wc)
			}
			if diff := cmp.Diff(c.want, got, cmp.AllowUnexported(scheduler.WorkerConfig{})); diff != "" {
				t.Errorf("configs (-want +got):\n%s", diff)
			}
		})
	}
}

// A started fleet is ready and serves a completion; Close is idempotent
// and returns Serve's nil.
func TestStartServes(t *testing.T) {
	f, err := Start(Spec{Workers: 1, Config: fast, Scheduler: scheduler.Config{Strategy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	body := `{"model":"llama-3.1-8b","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	resp, err := hc.Post(f.URL()+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Baton-Worker") != "both-0" {
		t.Errorf("status %d, worker %q: %s", resp.StatusCode, resp.Header.Get("X-Baton-Worker"), b)
	}
	for range 2 {
		if err := f.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}
}

// Replicas are schedulers of their own in front of the same workers,
// each ready and serving; Close closes them all.
func TestStartReplicas(t *testing.T) {
	f, err := Start(Spec{Workers: 2, Config: fast, Replicas: 3, Scheduler: scheduler.Config{Strategy: "kv_aware"}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if len(f.Replicas) != 3 || f.Scheduler != f.Replicas[0].Scheduler || f.Addr != f.Replicas[0].Addr {
		t.Fatalf("%d replicas, first %v at %s; want 3, the first being Scheduler at Addr", len(f.Replicas), f.Replicas[0].Scheduler, f.Replicas[0].Addr)
	}
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	body := `{"model":"llama-3.1-8b","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	addrs := map[string]bool{}
	for i, r := range f.Replicas {
		addrs[r.Addr] = true
		resp, err := hc.Post(r.URL()+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Baton-Worker") == "" {
			t.Errorf("replica %d: status %d, worker %q: %s", i, resp.StatusCode, resp.Header.Get("X-Baton-Worker"), b)
		}
	}
	if len(addrs) != 3 {
		t.Errorf("replicas serve at %v, want 3 addresses", addrs)
	}
	if err := f.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}

func TestStartWorkersOnly(t *testing.T) {
	f, err := StartWorkers(Spec{Workers: 1, Config: fast,
		Listen: func(string, string) (string, string) { return "127.0.0.1:0", "127.0.0.1:0" }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Scheduler != nil || f.Addr != "" {
		t.Errorf("scheduler %v at %q, want none", f.Scheduler, f.Addr)
	}
	if len(f.Workers) != 1 || f.Workers[0].HTTPAddr == "" {
		t.Errorf("workers %v, want one with its own HTTP endpoint", f.Workers)
	}
}

func TestStartFails(t *testing.T) {
	cases := []struct {
		name string
		spec Spec
		want string
	}{
		{"bad worker", Spec{Workers: 1, Config: func(string, string) sim.Config { return sim.Config{TimeScale: -1} }}, "worker both-0: "},
		{"bad strategy", Spec{Workers: 1, Config: fast, Scheduler: scheduler.Config{Strategy: "fastest"}}, "scheduler: "},
		{"never ready", Spec{ReadyTimeout: 100 * time.Millisecond,
			Scheduler: scheduler.Config{Workers: []scheduler.WorkerConfig{{Name: "down", Address: "127.0.0.1:1"}}}}, "scheduler not ready after 100ms"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f, err := Start(c.spec)
			if err == nil {
				f.Close()
				t.Fatal("no error")
			}
			if !strings.HasPrefix(err.Error(), c.want) {
				t.Errorf("error %q, want it to start %q", err, c.want)
			}
		})
	}
}
