package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchNamesTheTraceFile: a trace given by --trace is named in the
// report, not called the Mooncake conversation trace (or the Azure trace).
func TestBenchNamesTheTraceFile(t *testing.T) {
	dir := t.TempDir()
	mooncake := filepath.Join(dir, "agent_sessions.jsonl")
	if err := os.WriteFile(mooncake, []byte(`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 1000, "output_length": 7, "hash_ids": [0, 2]}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	azure := filepath.Join(dir, "code_2024.csv")
	if err := os.WriteFile(azure, []byte("TIMESTAMP,ContextTokens,GeneratedTokens\n"+
		"2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		workload, trace, want, notWant string
	}{
		{"mooncake", mooncake, "Mooncake-format trace agent_sessions.jsonl, first 2 records", "Mooncake conversation trace"},
		{"azure", azure, "Azure-format trace code_2024.csv, first 2 rows", "Azure trace,"},
	} {
		t.Run(tc.workload, func(t *testing.T) {
			out := filepath.Join(dir, tc.workload)
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), []string{"bench", "--workload", tc.workload, "--trace", tc.trace,
				"--virtual", "--workers", "2", "--strategies", "round_robin", "--out", out, "--quiet"}, &stdout, &stderr)
			if err != nil {
				t.Fatalf("bench: %v\n%s", err, stderr.String())
			}
			report, err := os.ReadFile(filepath.Join(out, "report.md"))
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(report), tc.want) || strings.Contains(string(report), tc.notWant) {
				t.Errorf("report.md does not name the trace file as %q (or still says %q):\n%s", tc.want, tc.notWant, head(string(report), 12))
			}
		})
	}
}

// head returns the first n lines of s.
func head(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}
