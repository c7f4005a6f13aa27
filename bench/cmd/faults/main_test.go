package main

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// TestRedisDownSmoke runs the matrix's redis-down fault on a real fleet
// with short windows: every request the clients sent ends, none hangs,
// none is cut short, none gets a 503 (the tier is bypassed).
func TestRedisDownSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds baton and runs a fleet of processes")
	}
	redis, err := redistest.Binary()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(redistest.EnvServer, redis)
	bin := filepath.Join(t.TempDir(), "baton")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/batonllm/baton/cmd/baton").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	// A loaded machine slows everything: a generous client deadline, so
	// that a hang means one.
	err = run(ctx, []string{"-baton", bin, "-faults", "redis-down", "-clients", "2",
		"-before", "1s", "-during", "2s", "-after", "1s", "-deadline", "30s"}, &out)
	report := out.String()
	if err != nil {
		t.Fatalf("run: %v\n%s", err, report)
	}
	var row []string
	for _, line := range strings.Split(report, "\n") {
		if strings.HasPrefix(line, "| redis-down |") {
			row = strings.Split(line, " | ")
		}
	}
	if len(row) < 11 {
		t.Fatalf("no redis-down row in the report:\n%s", report)
	}
	for i, col := range map[int]string{5: "429", 6: "503", 7: "error events", 8: "truncated", 9: "hangs", 10: "other"} {
		if row[i] != "0" {
			t.Errorf("%s: got %s, want 0\n%s", col, row[i], report)
		}
	}
	if row[2] == "0" || row[3] != row[2] {
		t.Errorf("sent %s, ok %s: want all of some ok\n%s", row[2], row[3], report)
	}
	if !strings.Contains(report, "(0 still open") {
		t.Errorf("requests still open at the end:\n%s", report)
	}
}
