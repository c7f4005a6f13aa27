package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// baton tune and baton bench --virtual on small workloads: reports on
// stdout, files in --out, progress on stderr.
func TestTuneAndVirtualBench(t *testing.T) {
	trace := filepath.Join("..", "..", "bench", "workload", "testdata", "mooncake_conversation_head.jsonl")
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	err := run(context.Background(), []string{"tune", "--trace", trace, "--requests", "40", "--gpus", "2",
		"--strategies", "random,kv_aware", "--thresholds", "16", "--min-remote", "512", "--out", dir}, &stdout, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"## Best on", "strategy: ", "| colocated:2 random |"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("tune report lacks %q", want)
		}
	}
	if !strings.Contains(stderr.String(), "baton tune: shape [") {
		t.Errorf("no progress on stderr: %.200q", stderr.String())
	}
	for _, f := range []string{"report.md", "candidates.csv", "best.yaml", "goodput.png"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}

	stdout.Reset()
	err = run(context.Background(), []string{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--requests", "40",
		"--workers", "2", "--strategies", "random,kv_aware", "--quiet", "--out", t.TempDir()}, &stdout, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| TTFT p50 (ms) |", "virtual clock", "Belady's MIN"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("virtual bench report lacks %q", want)
		}
	}
}

// --dispatch delays every request on the virtual clock, for bench and
// tune alike, and names itself when it is malformed or has no virtual
// clock to apply to.
func TestDispatchFlag(t *testing.T) {
	trace := filepath.Join("..", "..", "bench", "workload", "testdata", "mooncake_conversation_head.jsonl")
	p50 := func(extra ...string) string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		args := append([]string{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--requests", "10",
			"--workers", "2", "--strategies", "kv_aware", "--quiet", "--out", t.TempDir()}, extra...)
		if err := run(context.Background(), args, &stdout, &stderr); err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(stdout.String(), "\n") {
			if strings.HasPrefix(l, "| TTFT p50 (ms) |") {
				return l
			}
		}
		t.Fatalf("no TTFT p50 in %q", stdout.String())
		return ""
	}
	a, b := p50(), p50("--dispatch", "1s,1s")
	if a == b {
		t.Errorf("a 1 s dispatch delay left the report's %q", a)
	}
	if c := p50("--dispatch", "1s,1s,10us"); c == b {
		t.Errorf("10 µs a prompt token on top of 1 s left the report's %q", c)
	}
	for _, args := range [][]string{
		{"bench", "--workload", "mooncake", "--trace", trace, "--dispatch", "7ms,48ms"},
		{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--dispatch", "7ms"},
		{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--dispatch", "48ms,7ms"},
		{"tune", "--trace", trace, "--dispatch", "0s,7ms"},
		{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--dispatch", "1ms,2ms,-1ns"},
		{"bench", "--virtual", "--workload", "mooncake", "--trace", trace, "--dispatch", "1ms,2ms,3ns,4ns,5ns"},
	} {
		var stdout, stderr bytes.Buffer
		err := run(context.Background(), append(args, "--out", t.TempDir()), &stdout, &stderr)
		if err == nil || !strings.Contains(err.Error(), "--dispatch") {
			t.Errorf("%v: error %v, want one naming --dispatch", args, err)
		}
	}
}
