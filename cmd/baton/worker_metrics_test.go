package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestWorkerPprofMustBeLoopback(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:6060", ":6060", "10.1.2.3:6060", "example.com:6060", "nonsense"} {
		err := run(context.Background(), []string{"worker", "--listen", "127.0.0.1:0", "--pprof-listen", addr}, io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "pprof-listen") {
			t.Errorf("--pprof-listen %s: error %v, want one naming the flag", addr, err)
		}
	}
}

// A worker serves /metrics and pprof on the listeners its flags name.
func TestWorkerMetricsAndPprof(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"worker", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
			"--pprof-listen", "127.0.0.1:0", "--kv-blocks", "1000"}, io.Discard, &logs)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("worker ended with %v", err)
		}
	})
	m := logs.waitMatch(t, `metrics=(\S+) pprof=(\S+)`, done)
	metricsAddr, pprofAddr := m[1], m[2]
	get := func(url string) string {
		t.Helper()
		res, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		if err != nil || res.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %v", url, res.StatusCode, err)
		}
		return string(b)
	}
	body := get("http://" + metricsAddr + "/metrics")
	for _, want := range []string{
		`baton_worker_kv_blocks_capacity{tier="gpu"} 1000`,
		`baton_worker_sequences{state="running"} 0`,
		`baton_worker_transfers_total{direction="sent"} 0`,
		"process_resident_memory_bytes ",
		"go_goroutines ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if body := get("http://" + pprofAddr + "/debug/pprof/"); !strings.Contains(body, "heap") {
		t.Errorf("/debug/pprof/ lists no heap profile")
	}
}

// baton serve (and demo) serve pprof on --pprof-listen, a loopback
// address only.
func TestServePprof(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:6060", ":6060", "nonsense"} {
		for _, args := range [][]string{{"serve", "--worker", "127.0.0.1:1"}, {"demo", "--workers", "1"}} {
			err := run(context.Background(), append(args, "--listen", "127.0.0.1:0", "--pprof-listen", addr), io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), "pprof-listen") {
				t.Errorf("%s --pprof-listen %s: error %v, want one naming the flag", args[0], addr, err)
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--worker", "127.0.0.1:1", "--pprof-listen", "127.0.0.1:0"}, io.Discard, &logs)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve ended with %v", err)
		}
	})
	addr := logs.waitMatch(t, `msg="pprof listening" addr=(\S+)`, done)[1]
	res, err := http.Get("http://" + addr + "/debug/pprof/")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if b, _ := io.ReadAll(res.Body); res.StatusCode != http.StatusOK || !strings.Contains(string(b), "heap") {
		t.Errorf("GET /debug/pprof/: %d, lists no heap profile", res.StatusCode)
	}
}
