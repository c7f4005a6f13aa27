package scheduler_test

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
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
			{"chat", chatSrv, []llamatest.LoRA{{ID: 1, Scale: 1}}},
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
	if got := reqs[len(reqs)-1].LoRA; got == nil || len(got) != 0 {
		t.Errorf("base-model request: server applied lora %v, want [] (none)", got)
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
