package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/sim"
)

// TestServeDrainsOnSignal: baton serve, whose context ends as on SIGTERM,
// drains and returns nil well within its drain timeout.
func TestServeDrainsOnSignal(t *testing.T) {
	w, err := sim.Start(sim.Config{TimeScale: 500}, "127.0.0.1:0", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--listen", "127.0.0.1:0", "--worker", w.GRPCAddr, "--drain-timeout", "20s"}, io.Discard, &logs)
	}()
	logs.waitMatch(t, "scheduler listening", done)
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve ended with %v, want nil", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not end within its drain timeout")
	}
	t.Logf("drained in %v", time.Since(start))
	for _, m := range []string{"msg=draining", "msg=drained", "timeout=20s"} {
		if !strings.Contains(logs.String(), m) {
			t.Errorf("log lacks %q:\n%s", m, logs.String())
		}
	}
}

// TestServeReloadsKeysOnSIGHUP: a key added to the keys file is refused
// until SIGHUP, and served after it.
func TestServeReloadsKeysOnSIGHUP(t *testing.T) {
	w, err := sim.Start(sim.Config{TimeScale: 500}, "127.0.0.1:0", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys")
	const oldKey, newKey = "old-key-0123456789abcdef", "new-key-0123456789abcdef"
	if err := os.WriteFile(keys, []byte(oldKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "baton.yaml")
	if err := os.WriteFile(config, []byte("auth:\n  keys_file: "+keys+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--config", config, "--listen", "127.0.0.1:0", "--worker", w.GRPCAddr}, io.Discard, &logs)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve ended with %v", err)
		}
	}()
	addr := logs.waitMatch(t, `scheduler listening.* addr=(\S+)`, done)[1]
	status := func(key string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/models", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := status(oldKey); got != http.StatusOK {
		t.Fatalf("the configured key: HTTP %d, want 200", got)
	}
	if got := status(newKey); got != http.StatusUnauthorized {
		t.Fatalf("a key not yet in the file: HTTP %d, want 401", got)
	}
	if err := os.WriteFile(keys, []byte(newKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := status(newKey); got != http.StatusUnauthorized {
		t.Fatalf("a key written to the file before SIGHUP: HTTP %d, want 401", got)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	logs.waitMatch(t, "API keys reloaded on SIGHUP", done)
	if got := status(newKey); got != http.StatusOK {
		t.Errorf("the new key after SIGHUP: HTTP %d, want 200", got)
	}
	if got := status(oldKey); got != http.StatusUnauthorized {
		t.Errorf("the removed key after SIGHUP: HTTP %d, want 401", got)
	}
}
