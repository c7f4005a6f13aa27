package scheduler_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
)

// The scheduler follows the adapters a baton worker loads and evicts by
// itself (requests from elsewhere, a restart): from its load reports when
// it watches the worker (kv_aware), from its Info at health checks
// otherwise, even when the configuration names the worker's model and
// role.
func TestAdapterReportsFollowTheWorker(t *testing.T) {
	for _, tc := range []struct {
		name, strategy string
		pool           pool.Config
	}{
		{"load reports", "kv_aware", pool.Config{HealthInterval: time.Minute, HealthTimeout: 2 * time.Second}},
		{"info", "least_outstanding", pool.Config{HealthInterval: 200 * time.Millisecond, HealthTimeout: 200 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			workers, cfgs := startLoRAWorkers(t, 1, 1)
			// Its model and role configured, its slots left to it.
			cfgs[0].Models, cfgs[0].Role, cfgs[0].MaxLoRAs = []string{model}, scheduler.RoleBoth, 0
			s, addr := startScheduler(t, scheduler.Config{Strategy: tc.strategy, Pool: tc.pool, Workers: cfgs, Adapters: loraAdapters})
			holds := func(want string) {
				t.Helper()
				eventually(t, 10*time.Second, func() error {
					w := s.Pool.Snapshot().Worker(cfgs[0].Name)
					if got := strings.Join(w.Adapters(), ","); got != want {
						return fmt.Errorf("scheduler sees %s holding %q, want %q", w.Name, got, want)
					}
					return nil
				})
			}
			// The worker loads sql, then chat into its one slot, for
			// requests the scheduler never saw.
			for _, a := range []string{"sql", "chat"} {
				st, err := workers[0].Engine.Generate(context.Background(), &engine.Request{Model: a, Prompt: text(a, 100), MaxTokens: 2})
				if err != nil {
					t.Fatal(err)
				}
				for _, err = st.Recv(); err == nil; _, err = st.Recv() {
				}
				st.Close()
				holds(a)
			}
			r := chat(t, oaClient(t, addr), adapterChat("chat", text("held", 200)))
			if !strings.HasSuffix(r.route, "adapter=held") {
				t.Errorf("route %q, want adapter=held: the worker holds chat", r.route)
			}
			if w := s.Pool.Snapshot().Worker(cfgs[0].Name); w.AdapterSlots() != 1 {
				t.Errorf("adapter slots %d, want the worker's 1", w.AdapterSlots())
			}
		})
	}
}
