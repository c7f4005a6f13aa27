package scheduler_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/workers/sim"
)

// freeAddr returns a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// listModels returns the ids of GET /v1/models.
func listModels(t *testing.T, hc *http.Client, addr string) []string {
	t.Helper()
	r := do(t, hc, http.MethodGet, "http://"+addr+"/v1/models", "", nil)
	if r.status != http.StatusOK {
		t.Fatalf("GET /v1/models: %d %s", r.status, r.body)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(r.body, &list); err != nil {
		t.Fatalf("GET /v1/models: %v", err)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	return ids
}

// TestSchedulerStartedBeforeItsWorkers: workers that are not up when the
// scheduler starts are not routed to until they answer; then they join the
// pools of their roles, disaggregation turns on, and /v1/models lists what
// they serve.
func TestSchedulerStartedBeforeItsWorkers(t *testing.T) {
	cfg := scheduler.Config{Strategy: "prefix_aware", Pool: fastPool()}
	addrs := map[string]string{}
	for _, name := range []string{"p0", "d0"} {
		addrs[name] = freeAddr(t)
		cfg.Workers = append(cfg.Workers, scheduler.WorkerConfig{Name: name, Address: addrs[name]})
	}
	f := startFleetSpec(t, simfleet.Spec{Scheduler: cfg}) // its workers are down
	s, addr := f.Scheduler, f.Addr
	hc := httpClient(t)
	if r := do(t, hc, http.MethodGet, "http://"+addr+"/readyz", "", nil); r.status != http.StatusServiceUnavailable {
		t.Errorf("/readyz with no worker up: %d, want 503", r.status)
	}
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`
	if r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil); r.status != http.StatusServiceUnavailable {
		t.Errorf("chat with no worker up: %d, want 503: %s", r.status, r.body)
	}

	for name, role := range map[string]string{"p0": sim.RolePrefill, "d0": sim.RoleDecode} {
		w, err := sim.Start(sim.Config{Name: name, Role: role, TimeScale: fastScale}, addrs[name], "", nil)
		if err != nil {
			t.Fatalf("sim.Start(%s): %v", name, err)
		}
		t.Cleanup(func() { w.Close() })
	}
	eventually(t, 10*time.Second, func() error {
		if n := len(s.PrefillPool.Snapshot().Workers); n != 1 {
			return fmt.Errorf("%d prefill workers, want 1", n)
		}
		if n := len(s.Pool.Snapshot().Workers); n != 1 {
			return fmt.Errorf("%d decode workers, want 1", n)
		}
		return nil
	})
	if got := listModels(t, hc, addr); !slices.Equal(got, []string{model}) {
		t.Errorf("/v1/models = %v, want [%s]", got, model)
	}
	c := oaClient(t, addr)
	res := chat(t, c, chatParams(text("a long document", 4000), 4))
	if res.worker != "d0" || res.prefill != "p0" {
		t.Errorf("served by %q, prefilled on %q; want decode d0 and prefill p0 (route %q)", res.worker, res.prefill, res.route)
	}
}

// TestHTTPEngineModels: /v1/models lists what OpenAI-compatible engines
// serve, from their own /v1/models, and follows it as it changes.
func TestHTTPEngineModels(t *testing.T) {
	w := startWorker(t, "e0", fastScale, "127.0.0.1:0", true)
	var served atomic.Value
	served.Store(`{"object":"list","data":[{"id":"base","object":"model"}]}`)
	fake := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
		case "/v1/models":
			rw.Header().Set("Content-Type", "application/json")
			fmt.Fprint(rw, served.Load().(string))
		default:
			http.NotFound(rw, r)
		}
	}))
	t.Cleanup(fake.Close)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "random", Pool: fastPool(), Workers: []scheduler.WorkerConfig{
		{Name: "e0", Kind: "http", Address: "http://" + w.HTTPAddr},
		{Name: "e1", Kind: "http", Address: fake.URL},
	}})
	hc := httpClient(t)
	if got, want := listModels(t, hc, addr), []string{model, "base"}; !sameSet(got, want) {
		t.Errorf("/v1/models = %v, want %v", got, want)
	}
	served.Store(`{"object":"list","data":[{"id":"base","object":"model"},{"id":"base-lora","object":"model","parent":"base"}]}`)
	eventually(t, 5*time.Second, func() error {
		if got, want := listModels(t, hc, addr), []string{model, "base", "base-lora"}; !sameSet(got, want) {
			return fmt.Errorf("/v1/models = %v, want %v", got, want)
		}
		return nil
	})
}

func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}
