package scheduler_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// A vLLM engine's adapters count as held however they got there (here
// --lora-modules at its start), its max_lora gives its slots, and an
// adapter it lacks is loaded through its API: the configuration names
// neither its model's adapters nor its max_loras.
func TestAdapterVLLMReportsHeldAndSlots(t *testing.T) {
	e, err := vllmtest.New(vllmtest.Config{Model: model, TimeScale: 1000, NoEvents: true,
		LoRAModules: map[string]string{"sql": "/adapters/sql"}, MaxLoRAs: 2, RuntimeLoRA: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	s, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Pool: loraPool(), Adapters: loraAdapters,
		Workers: []scheduler.WorkerConfig{{Name: "v0", Kind: scheduler.KindVLLM, Address: e.URL, Models: []string{model},
			EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond}}}})
	eventually(t, 10*time.Second, func() error {
		w := s.Pool.Snapshot().Worker("v0")
		if !w.HoldsAdapter("sql") || w.AdapterSlots() != 2 {
			return fmt.Errorf("scheduler sees v0 holding %v with %d slots, want sql and 2", w.Adapters(), w.AdapterSlots())
		}
		return nil
	})
	c := oaClient(t, addr)
	if r := chat(t, c, adapterChat("sql", text("vsql", 200))); !strings.HasSuffix(r.route, "adapter=held") {
		t.Errorf("sql: route %q, want adapter=held", r.route)
	}
	if r := chat(t, c, adapterChat("chat", text("vchat", 200))); !strings.HasSuffix(r.route, "adapter=loaded") {
		t.Errorf("chat: route %q, want adapter=loaded", r.route)
	}
	if got := e.Adapters(); !slices.Equal(got, []string{"chat", "sql"}) {
		t.Errorf("engine serves %v, want [chat sql]", got)
	}
}

// llama-servers hold the adapters they were started with (--lora), read
// from /lora-adapters: a request for one goes to a server holding it,
// which applies it by its id; a base-model request applies none; a request
// for an adapter no server holds is a 404, never a load.
func TestAdapterLlamaCPP(t *testing.T) {
	sqlSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/sql"}})
	chatSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/math", "/adapters/chat"}})
	adapters := append(slices.Clone(loraAdapters), scheduler.AdapterConfig{Name: "ghost", BaseModel: model, Source: "/adapters/ghost"})
	var workers []scheduler.WorkerConfig
	for i, srv := range []*llamatest.Server{sqlSrv, chatSrv} {
		workers = append(workers, scheduler.WorkerConfig{Name: fmt.Sprintf("l%d", i), Kind: scheduler.KindLlamaCPP, Address: srv.URL,
			Models: []string{model}})
	}
	s, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Pool: loraPool(), Workers: workers, Adapters: adapters})
	eventually(t, 10*time.Second, func() error {
		snap := s.Pool.Snapshot()
		if !snap.Worker("l0").HoldsAdapter("sql") || !snap.Worker("l1").HoldsAdapter("chat") {
			return fmt.Errorf("scheduler sees l0 holding %v, l1 %v", snap.Worker("l0").Adapters(), snap.Worker("l1").Adapters())
		}
		return nil
	})
	c := oaClient(t, addr)
	for i := range 4 {
		for _, tc := range []struct {
			adapter string
			srv     *llamatest.Server
			want    []llamatest.LoRA
		}{
			{"sql", sqlSrv, []llamatest.LoRA{{ID: 0, Scale: 1}}},
			{"chat", chatSrv, []llamatest.LoRA{{ID: 0, Scale: 0}, {ID: 1, Scale: 1}}},
		} {
			before := len(tc.srv.Requests())
			r := chat(t, c, adapterChat(tc.adapter, text(fmt.Sprint(tc.adapter, i), 200)))
			if !strings.HasSuffix(r.route, "adapter=held") {
				t.Errorf("%s: route %q, want adapter=held", tc.adapter, r.route)
			}
			reqs := tc.srv.Requests()
			if len(reqs) != before+1 {
				t.Fatalf("%s went to worker %s, not the server holding it", tc.adapter, r.worker)
			}
			if got := reqs[len(reqs)-1].LoRA; !slices.Equal(got, tc.want) {
				t.Errorf("%s: server applied lora %v, want %v", tc.adapter, got, tc.want)
			}
		}
	}
	n0 := len(sqlSrv.Requests())
	chat(t, c, chatParams(text("base", 200), 4))
	srv := chatSrv
	if len(sqlSrv.Requests()) > n0 {
		srv = sqlSrv
	}
	reqs := srv.Requests()
	if got := reqs[len(reqs)-1].Applied; got != nil {
		t.Errorf("base-model request: server applied %v, want none", got)
	}

	n := len(sqlSrv.Requests()) + len(chatSrv.Requests())
	res := do(t, httpClient(t), http.MethodPost, "http://"+addr+"/v1/chat/completions",
		`{"model":"ghost","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, nil)
	if res.status != http.StatusNotFound {
		t.Errorf("adapter no server holds: status %d, want 404", res.status)
	}
	if _, _, code, _ := decodeError(t, res.body); code != "model_not_found" {
		t.Errorf("adapter no server holds: code %q, want model_not_found", code)
	}
	if got := len(sqlSrv.Requests()) + len(chatSrv.Requests()); got != n {
		t.Errorf("servers got %d requests for an adapter none holds", got-n)
	}
}

// Two llama-servers, each started with one adapter not applied by
// default (--lora-init-without-apply), under the strategies that route by
// prefix: base-model requests get the base model's output from either,
// streamed or not, and adapter requests their adapter's.
func TestAdapterLlamaCPPBaseModel(t *testing.T) {
	for _, strategy := range []string{"kv_aware", "prefix_aware"} {
		t.Run(strategy, func(t *testing.T) {
			sqlSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/sql"}, LoRAInitWithoutApply: true})
			chatSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/chat"}, LoRAInitWithoutApply: true})
			workers := []scheduler.WorkerConfig{
				{Name: "l0", Kind: scheduler.KindLlamaCPP, Address: sqlSrv.URL, Models: []string{model}},
				{Name: "l1", Kind: scheduler.KindLlamaCPP, Address: chatSrv.URL, Models: []string{model}},
			}
			s, addr := startScheduler(t, scheduler.Config{Strategy: strategy, Pool: loraPool(), Workers: workers, Adapters: loraAdapters})
			eventually(t, 10*time.Second, func() error {
				snap := s.Pool.Snapshot()
				if !snap.Worker("l0").HoldsAdapter("sql") || !snap.Worker("l1").HoldsAdapter("chat") {
					return fmt.Errorf("scheduler sees l0 holding %v, l1 %v", snap.Worker("l0").Adapters(), snap.Worker("l1").Adapters())
				}
				return nil
			})
			c := oaClient(t, addr)
			const base = "ok ok ok ok "
			served := map[string]int{}
			for i := 0; i < 40 && (i < 6 || served["l0"] == 0 || served["l1"] == 0); i++ {
				p := chatParams(text(fmt.Sprint("base", i), 200), 4)
				r := chat(t, c, p)
				if r.content != base {
					t.Errorf("base-model request %d on %s: %q, want %q", i, r.worker, r.content, base)
				}
				served[r.worker]++
				sr, err := streamChat(t, c, p)
				if err != nil || sr.content != base {
					t.Errorf("streamed base-model request %d on %s: %q, %v; want %q", i, sr.worker, sr.content, err, base)
				}
				served[sr.worker]++
			}
			if served["l0"] == 0 || served["l1"] == 0 {
				t.Errorf("base-model requests went to %v, want both servers", served)
			}
			for _, tc := range []struct{ adapter, want string }{{"sql", "sql sql sql sql "}, {"chat", "chat chat chat chat "}} {
				r := chat(t, c, adapterChat(tc.adapter, text(tc.adapter, 200)))
				if r.content != tc.want || r.model != tc.adapter {
					t.Errorf("%s on %s: %q from model %q, want %q from %q", tc.adapter, r.worker, r.content, r.model, tc.want, tc.adapter)
				}
				sr, err := streamChat(t, c, adapterChat(tc.adapter, text(tc.adapter+"s", 200)))
				if err != nil || sr.content != tc.want || sr.model != tc.adapter {
					t.Errorf("streamed %s on %s: %q from model %q, %v; want %q from %q", tc.adapter, sr.worker, sr.content, sr.model, err, tc.want, tc.adapter)
				}
			}
		})
	}
}

// While the only server holding an adapter is down, a request for it is a
// 503 with Retry-After, whose message does not say where the server is;
// one for an adapter no server holds, or a model nobody serves, is a 404.
func TestAdapterLlamaCPPHolderDown(t *testing.T) {
	sqlSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/sql"}, LoRAInitWithoutApply: true})
	chatSrv := llamatest.Start(t, llamatest.Config{Model: model, LoRA: []string{"/adapters/chat"}, LoRAInitWithoutApply: true})
	workers := []scheduler.WorkerConfig{
		{Name: "l0", Kind: scheduler.KindLlamaCPP, Address: sqlSrv.URL, Models: []string{model}},
		{Name: "l1", Kind: scheduler.KindLlamaCPP, Address: chatSrv.URL, Models: []string{model}},
	}
	adapters := append(slices.Clone(loraAdapters), scheduler.AdapterConfig{Name: "ghost", BaseModel: model, Source: "/adapters/ghost"})
	s, addr := startScheduler(t, scheduler.Config{Strategy: "kv_aware", Workers: workers, Adapters: adapters,
		Pool: pool.Config{HealthInterval: 200 * time.Millisecond, HealthTimeout: 200 * time.Millisecond, UnhealthyAfter: 1}})
	eventually(t, 10*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker("l0"); !w.HoldsAdapter("sql") {
			return fmt.Errorf("scheduler sees l0 holding %v", w.Adapters())
		}
		return nil
	})
	hc := httpClient(t)
	ask := func(name string) rawResult {
		return do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions",
			`{"model":"`+name+`","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`, nil)
	}
	if res := ask("sql"); res.status != http.StatusOK {
		t.Fatalf("sql while its server is up: status %d: %s", res.status, res.body)
	}
	host := strings.TrimPrefix(sqlSrv.URL, "http://")
	sqlSrv.Close()
	// At once (the scheduler still counts the server available, and its
	// connection is refused), then once the health checks saw it down.
	check := func(when string) {
		res := ask("sql")
		if res.status != http.StatusServiceUnavailable || res.header.Get("Retry-After") == "" {
			t.Errorf("sql %s: status %d, Retry-After %q; want 503 with Retry-After", when, res.status, res.header.Get("Retry-After"))
		}
		_, _, code, msg := decodeError(t, res.body)
		if code != "no_worker_available" {
			t.Errorf("sql %s: code %q, want no_worker_available", when, code)
		}
		port := host[strings.LastIndex(host, ":"):]
		if strings.Contains(string(res.body), "127.0.0.1") || strings.Contains(string(res.body), port) || strings.Contains(msg, "dial") {
			t.Errorf("sql %s: the client reads where the server is: %s", when, res.body)
		}
	}
	check("with its server just gone")
	eventually(t, 10*time.Second, func() error {
		if s.Pool.Snapshot().Worker("l0").Available() {
			return fmt.Errorf("l0 still available")
		}
		return nil
	})
	check("with its server seen down")
	for _, name := range []string{"ghost", "nobody"} {
		res := ask(name)
		if _, _, code, _ := decodeError(t, res.body); res.status != http.StatusNotFound || code != "model_not_found" {
			t.Errorf("%s: status %d, code %q; want 404 model_not_found", name, res.status, code)
		}
	}
}
