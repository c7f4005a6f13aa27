package scheduler_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
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
