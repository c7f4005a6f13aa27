package scheduler_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/sim"
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

// A LoRA worker that starts after the scheduler first waits in the
// pending pool, then moves to its role's: the slots its Info told the
// watcher and the adapters it holds move with it.
func TestAdapterSlotsFollowAPendingWorker(t *testing.T) {
	addr := freeAddr(t)
	wc := scheduler.WorkerConfig{Name: "w0", Address: addr}
	f := startFleetSpec(t, simfleet.Spec{Scheduler: scheduler.Config{Strategy: "kv_aware", Workers: []scheduler.WorkerConfig{wc},
		Adapters: loraAdapters, Pool: loraPool()}}) // its worker is down
	s, saddr := f.Scheduler, f.Addr
	var list []engine.Adapter
	for _, a := range loraAdapters {
		list = append(list, engine.Adapter{Name: a.Name, Base: a.BaseModel, Bytes: a.Size})
	}
	w, err := sim.Start(sim.Config{Name: "w0", TimeScale: fastScale, LoRA: sim.LoRA{Adapters: list, MaxLoRAs: 2}}, addr, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	st, err := w.Engine.Generate(context.Background(), &engine.Request{Model: "sql", Prompt: text("sql", 100), MaxTokens: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, err = st.Recv(); err == nil; _, err = st.Recv() {
	}
	st.Close()
	// As soon as it is in the pool, not at its next health check.
	var moved *pool.Worker
	eventually(t, 10*time.Second, func() error {
		if moved = s.Pool.Snapshot().Worker("w0"); moved == nil {
			return fmt.Errorf("w0 not in the pool; pending: %v", s.Pending())
		}
		return nil
	})
	if moved.AdapterSlots() != 2 {
		t.Errorf("scheduler sees w0 arrive with %d adapter slots, want 2", moved.AdapterSlots())
	}
	eventually(t, 10*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker("w0"); w == nil || !w.HoldsAdapter("sql") || w.AdapterSlots() != 2 {
			return fmt.Errorf("scheduler sees w0 as %v, want it holding sql with 2 slots", w)
		}
		return nil
	})
	if r := chat(t, oaClient(t, saddr), adapterChat("sql", text("held", 200))); !strings.HasSuffix(r.route, "adapter=held") {
		t.Errorf("route %q, want adapter=held: w0 holds sql", r.route)
	}
}
