package scheduler_test

import (
	"runtime"
	"testing"

	"github.com/batonllm/baton/scheduler"
)

// Beside each routing decision's wall time, the scheduler reports the CPU
// time its thread spent on it (Linux), no more than the wall time and the
// two reads of the thread's clock around it.
func TestDecisionCPUTime(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("thread CPU time is read on Linux only")
	}
	_, workers := startWorkers(t, 2, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "kv_aware", Workers: workers, Pool: fastPool()})
	c := oaClient(t, addr)
	const n = 5
	for i := range n {
		chat(t, c, chatParams(text("decision", 200+i), 4))
	}
	m := scrape(t, httpClient(t), addr)
	decisions, _ := metric(m, "baton_routing_decision_seconds_count", `strategy="kv_aware"`)
	cpu, ok := metric(m, "baton_routing_decision_cpu_seconds_count", `strategy="kv_aware"`)
	if !ok || cpu < 1 || cpu > decisions {
		t.Fatalf("baton_routing_decision_cpu_seconds_count = %v (found %v), want 1 to %v (the decisions)", cpu, ok, decisions)
	}
	cpuSum, _ := metric(m, "baton_routing_decision_cpu_seconds_sum", `strategy="kv_aware"`)
	if cpuSum <= 0 || cpuSum > 0.1 {
		t.Errorf("baton_routing_decision_cpu_seconds_sum = %v s over %v decisions, want above 0 and far under 0.1 s", cpuSum, cpu)
	}
}
