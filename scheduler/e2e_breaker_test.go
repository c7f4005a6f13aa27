package scheduler_test

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/scheduler"
)

// TestWorkerFailover: a worker that stops mid-run costs no request (the
// front end retries, on another worker, a call that failed before its
// first token); its breaker opens; and once a worker is back on the same
// address, it serves again with its breaker closed.
func TestWorkerFailover(t *testing.T) {
	ws, workers := startWorkers(t, 3, fastScale)
	logs := &logRecorder{level: slog.LevelInfo}
	// Requests, not health checks, find the stopped worker: a health
	// check every 100 ms would often mark it down first on a loaded
	// machine, and no request would fail on it. Its breaker then stays
	// open long enough to be seen.
	pc := fastPool()
	pc.HealthInterval, pc.BreakerOpenTimeout = 10*time.Second, time.Second
	s, addr := startSchedulerLog(t, scheduler.Config{Strategy: "round_robin", Workers: workers, Pool: pc}, slog.New(logs))
	c := oaClient(t, addr)
	hc := httpClient(t)
	const victim = "w1"
	victimAddr := ws[1].GRPCAddr

	served := map[string]int{}
	for i := range 60 {
		if i == 15 {
			ws[1].Close() // between two requests of the loop
		}
		got := chat(t, c, chatParams(fmt.Sprintf("failover request %d", i), 4))
		served[got.worker]++
	}
	if served[victim] == 0 || served["w0"] == 0 || served["w2"] == 0 {
		t.Errorf("requests served per worker = %v, want every worker before the stop", served)
	}

	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_breaker_transitions_total", `worker="`+victim+`"`, `to="open"`); v < 1 {
		t.Errorf(`baton_breaker_transitions_total{worker=%q,to="open"} = %v, want >= 1`, victim, v)
	}
	if v, _ := metric(m, "baton_retries_total", `reason="worker_error"`); v < 1 {
		t.Errorf(`baton_retries_total{reason="worker_error"} = %v, want >= 1`, v)
	}
	if v, _ := metric(m, "baton_requests_failed_total"); v != 0 {
		t.Errorf("baton_requests_failed_total = %v, want 0", v)
	}
	// Out of rotation: its breaker open, or half-open once its open
	// timeout (1 s) has passed — on a loaded machine the loop above can
	// outlast it — which lets one probe through, not the traffic.
	eventually(t, 5*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker(victim); w.Available() && w.BreakerState() == gobreaker.StateClosed {
			return fmt.Errorf("stopped worker %s is still available (healthy %v, breaker %v)", victim, w.Healthy(), w.BreakerState())
		}
		return nil
	})

	startWorker(t, victim, fastScale, victimAddr, false)
	i := 0
	eventually(t, 20*time.Second, func() error {
		i++
		got := chat(t, c, chatParams(fmt.Sprintf("after restart %d", i), 4))
		w := s.Pool.Snapshot().Worker(victim)
		if got.worker != victim {
			return fmt.Errorf("restarted worker %s serves no requests yet (healthy %v, breaker %v)", victim, w.Healthy(), w.BreakerState())
		}
		if st := w.BreakerState(); st != gobreaker.StateClosed {
			return fmt.Errorf("restarted worker %s served, but its breaker is %v", victim, st)
		}
		return nil
	})
	m = scrapeSettled(t, hc, addr)
	if v, ok := metric(m, "baton_worker_breaker_state", `worker="`+victim+`"`); !ok || v != 0 {
		t.Errorf(`baton_worker_breaker_state{worker=%q} = %v (present %v), want 0 (closed)`, victim, v, ok)
	}
	if v, _ := metric(m, "baton_worker_healthy", `worker="`+victim+`"`); v != 1 {
		t.Errorf(`baton_worker_healthy{worker=%q} = %v, want 1`, victim, v)
	}
	// Failures are warnings; recoveries are news, not warnings.
	var opened, closed bool
	for _, l := range logs.messages() {
		switch {
		case strings.Contains(l, "breaker changed") && strings.Contains(l, "to=open"):
			opened = true
			if !strings.HasPrefix(l, "WARN ") {
				t.Errorf("breaker opening logged as %q, want WARN", l)
			}
		case strings.Contains(l, "to=closed"), strings.Contains(l, "healthy=true"):
			closed = true
			if !strings.HasPrefix(l, "INFO ") {
				t.Errorf("recovery logged as %q, want INFO", l)
			}
		}
	}
	if !opened || !closed {
		t.Errorf("logs lack the breaker opening (%t) or the recovery (%t):\n%s", opened, closed, strings.Join(logs.messages(), "\n"))
	}
}
