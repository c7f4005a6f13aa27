package scheduler_test

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
)

// The kind TestRegisteredKindServes registers, once per test binary (kinds
// are registered for good), and how often it connected.
var (
	testKindOnce  sync.Once
	testKindErr   error
	testKindCalls atomic.Int64
)

// A new kind of engine is one engine.Kind registered: configured, checked
// and served as the built-in kinds are, with no other change.
func TestRegisteredKindServes(t *testing.T) {
	testKindOnce.Do(func() {
		testKindErr = scheduler.RegisterKind(engine.Kind{
			Name: "test-openai", URL: true,
			Connect: func(tg engine.Target) (engine.Client, error) {
				testKindCalls.Add(1)
				return httpengine.Connect(engine.NoPD)(tg)
			},
		})
	})
	if testKindErr != nil {
		t.Fatal(testKindErr)
	}
	callsBefore := testKindCalls.Load()
	if err := scheduler.RegisterKind(engine.Kind{Name: "test-openai", Connect: httpengine.Kind.Connect}); err == nil {
		t.Error("a second kind of one name was registered")
	}

	var reg routing.Registry
	routing.RegisterBuiltins(&reg)
	// Its capabilities are what the configuration checks: no prefill
	// role for a kind without a P/D protocol, a URL for its address.
	bad := scheduler.Config{Strategy: "random", Workers: []scheduler.WorkerConfig{
		{Name: "e", Kind: "test-openai", Address: "http://127.0.0.1:1", Role: scheduler.RolePrefill, Models: []string{model}}}}
	if err := bad.Validate(&reg); err == nil || !strings.Contains(err.Error(), "workers[0].role: test-openai engines serve colocated") {
		t.Errorf("prefill role on a kind without P/D: %v", err)
	}
	bad.Workers[0].Role, bad.Workers[0].Address = "", "127.0.0.1:1"
	if err := bad.Validate(&reg); err == nil || !strings.Contains(err.Error(), "workers[0].address: the address of test-openai engines is a URL") {
		t.Errorf("host:port address of a URL kind: %v", err)
	}
	cfg := loadYAML(t, "strategy: random\nworkers: [{name: e, kind: test-openai, address: http://127.0.0.1:1, data_parallel_size: 2, models: [m]}]\n")
	if err := cfg.Validate(&reg); err == nil || !strings.Contains(err.Error(), "workers[0].data_parallel_size: only vllm and sglang workers have it (kind is test-openai)") {
		t.Errorf("data_parallel_size on a kind without ranks: %v", err)
	}

	w := startWorker(t, "e0", 1e4, "", true)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "random", Workers: []scheduler.WorkerConfig{
		{Name: "e0", Kind: "test-openai", Address: "http://" + w.HTTPAddr, Models: []string{model}}}})
	got := chat(t, oaClient(t, addr), chatParams("a new kind of engine", 4))
	if got.worker != "e0" || got.content == "" {
		t.Errorf("served by %q with %q; want e0 and some text", got.worker, got.content)
	}
	if calls := testKindCalls.Load() - callsBefore; calls != 1 {
		t.Errorf("the kind's Connect ran %d times, want 1", calls)
	}
}
