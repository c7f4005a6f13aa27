package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Help asked for, in any spelling, is printed on stdout and exits 0.
func TestHelpExitsZero(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"-h"}, "Usage:\n  baton serve"},
		{[]string{"--help"}, "Usage:\n  baton serve"},
		{[]string{"help"}, "Usage:\n  baton serve"},
		{[]string{"help", "worker"}, "Usage: baton worker [flags]"},
		{[]string{"serve", "-h"}, "Usage: baton serve [flags]"},
		{[]string{"serve", "--help"}, "Usage: baton serve [flags]"},
		{[]string{"worker", "-help"}, "Usage: baton worker [flags]"},
		{[]string{"demo", "--help"}, "Usage: baton demo [flags]"},
		{[]string{"bench", "-h"}, "Usage: baton bench [flags]"},
		{[]string{"tune", "-h"}, "Usage: baton tune [flags]"},
	}
	for _, c := range cases {
		var stdout, stderr bytes.Buffer
		code := exitCode(run(context.Background(), c.args, &stdout, &stderr), &stderr)
		if code != 0 || !strings.Contains(stdout.String(), c.want) || stderr.Len() != 0 {
			t.Errorf("%v: exit %d, stdout %.60q, stderr %.60q; want exit 0 and %q on stdout only", c.args, code, stdout.String(), stderr.String(), c.want)
		}
	}
}

// Bad flags and commands exit 2, with the error on stderr.
func TestErrorsExitTwo(t *testing.T) {
	for _, args := range [][]string{nil, {"frobnicate"}, {"serve", "--nope"}, {"worker", "--tp", "x"}, {"serve", "extra"}} {
		var stdout, stderr bytes.Buffer
		code := exitCode(run(context.Background(), args, &stdout, &stderr), &stderr)
		if code != 2 || !strings.Contains(stderr.String(), "baton: ") {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and the error on stderr", args, code, stderr.String())
		}
	}
}

// --strategy's help lists every strategy and the command's own default.
func TestStrategyHelp(t *testing.T) {
	for cmd, def := range map[string]string{"serve": "random", "demo": "prefix_aware"} {
		var stdout bytes.Buffer
		run(context.Background(), []string{cmd, "-h"}, &stdout, io.Discard)
		want := `routing strategy, by name: kv_aware, least_outstanding, prefix_aware, random, round_robin (default "` + def + `")`
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("%s -h:\n%s\nwant %q", cmd, stdout.String(), want)
		}
	}
}

// Flag errors name the flag, whether the command line or the validation of
// the configuration the flag went into finds them.
func TestFlagErrorsNameTheFlag(t *testing.T) {
	dir := t.TempDir()
	badStrategy := filepath.Join(dir, "strategy.yaml")
	os.WriteFile(badStrategy, []byte("strategy: fastest\n"), 0o600)
	badPool := filepath.Join(dir, "pool.yaml")
	os.WriteFile(badPool, []byte("pool:\n  breaker_failures: -1\n"), 0o600)
	w := []string{"--worker", "127.0.0.1:1"}
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"worker", "--time-scale", "0"}, "--time-scale: must be positive, got 0"},
		{[]string{"worker", "--tp", "0"}, "--tp: must be at least 1, got 0"},
		{[]string{"worker", "--max-running", "0"}, "--max-running: must be at least 1, got 0"},
		{[]string{"worker", "--max-batched-tokens", "-5"}, "--max-batched-tokens: must be at least 1, got -5"},
		{[]string{"worker", "--kv-scale", "0"}, "--kv-scale: must be at least 1, got 0"},
		{[]string{"worker", "--mfu", "1.5"}, "--mfu: must be in (0, 1], got 1.5"},
		{[]string{"worker", "--cpu-blocks", "-7"}, "--cpu-blocks: must be at least 1, or -1 for no CPU tier, got -7"},
		{[]string{"worker", "--cpu-blocks", "0"}, "--cpu-blocks: must be at least 1, or -1 for no CPU tier, got 0"},
		{[]string{"worker", "--kv-blocks", "-3"}, "--kv-blocks: must be at least 1, got -3"},
		{[]string{"worker", "--drain-timeout", "0s"}, "--drain-timeout: must be positive, got 0s"},
		{[]string{"worker", "--model-preset", "gpt-9"}, "--model-preset: "},
		{[]string{"worker", "--gpu", "a4"}, "--gpu: "},
		{[]string{"worker", "--served-model-name", "a,a"}, `--served-model-name: "a" listed twice`},
		{[]string{"worker", "--role", "verifier"}, "--role: "},
		{[]string{"worker", "--log-level", "loud"}, `--log-level: must be debug, info, warn or error, got "loud"`},
		{[]string{"demo", "--time-scale", "0"}, "--time-scale: must be positive, got 0"},
		{[]string{"demo", "--strategy", "fastest"}, `--strategy: unknown strategy "fastest"`},
		{[]string{"demo", "--log-level", "loud"}, `--log-level: must be debug, info, warn or error, got "loud"`},
		{append([]string{"serve", "--strategy", "fastest"}, w...), `--strategy: unknown strategy "fastest"`},
		{append([]string{"serve", "--prefix-length", "10"}, w...), "--prefix-length: must be 1024–65536, got 10"},
		{append([]string{"serve", "--drain-timeout", "0s"}, w...), "--drain-timeout: must be positive, got 0s"},
		{append([]string{"serve", "--concurrency-threshold", "5000"}, w...), "--concurrency-threshold: must be 1–1024, got 5000"},
		{append([]string{"serve", "--listen", "nowhere"}, w...), "--listen: "},
		{[]string{"serve", "--worker", "localhost"}, "--worker localhost: address localhost: missing port in address"},
		{[]string{"serve", "--worker", "a=127.0.0.1:1", "--worker", "a=127.0.0.1:2"}, `--worker a=127.0.0.1:2: "a" is used by another worker`},
		{[]string{"serve"}, "--worker: at least one worker is required"},
		{append([]string{"serve", "--config", badStrategy}, w...), "--config: " + badStrategy + `: strategy: unknown strategy "fastest"`},
		{append([]string{"serve", "--config", badPool}, w...), "--config: " + badPool + ": pool.breaker_failures: line 2: -1 is not a non-negative integer"},
		{[]string{"bench", "--requests", "0"}, "--requests: must be at least 1, got 0"},
		{[]string{"bench", "--kv-blocks", "-3"}, "--kv-blocks: must be at least 1, got -3"},
		{[]string{"bench", "--cpu-blocks", "-7"}, "--cpu-blocks: must be at least -1"},
		{[]string{"bench", "--prefix-length", "10"}, "--prefix-length: must be 1024–65536, got 10"},
		{[]string{"bench", "--strategies", "kv_aware,fastest"}, `--strategies: unknown "fastest"`},
		{[]string{"bench", "--virtual", "--concurrency", "4"}, "--virtual: simulates in-process fleets in open loop"},
		{[]string{"tune", "--gpus", "0"}, "--gpus: must be at least 1, got 0"},
		{[]string{"tune", "--slo-ttft-p90", "0s"}, "--slo-ttft-p90: must be positive"},
		{[]string{"tune", "--strategies", "kv_aware,fastest"}, `--strategies: unknown "fastest"`},
		{[]string{"tune", "--thresholds", "8,x"}, `--thresholds: "x" is not a number`},
		{[]string{"tune", "--min-remote", "0"}, "--min-remote: must be 1–1048576, got 0"},
		{[]string{"tune", "--rate-scale", "0"}, "--rate-scale: must be positive"},
		{[]string{"tune", "--workload", "long-context"}, "--rate: required for the long-context workload"},
	}
	for _, c := range cases {
		err := run(context.Background(), c.args, io.Discard, io.Discard)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v\nwant an error starting %q", c.args, err, c.want)
		}
	}
}

// What a flag's help gives a meaning passes the checks.
func TestFlagsAccepted(t *testing.T) {
	sim := [][]string{
		{"--cpu-blocks", "-1"},
		{"--warmup-top-k", "0"},
		{"--time-scale", "0.5", "--tp", "2", "--kv-blocks", "100", "--max-running", "1", "--kv-scale", "1", "--mfu", "1"},
		{"--model-preset", "llama-3.1-70b", "--gpu", "h200", "--served-model-name", "a,b"},
	}
	for _, args := range sim {
		fs := newFlagSet("worker", "")
		var f simFlags
		f.register(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		if err := f.check(fs); err != nil {
			t.Errorf("%v: %v", args, err)
		}
	}
	for _, strategy := range strategyNames() {
		fs := newFlagSet("serve", "")
		fs.SetOutput(io.Discard)
		var f schedulerFlags
		f.register(fs, "127.0.0.1:0", "random")
		fs.Var(&f.workers, "worker", "")
		if err := parseFlags(fs, []string{"--strategy", strategy, "--worker", "127.0.0.1:1"}, io.Discard, io.Discard); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.load(fs)
		if err == nil {
			err = f.check(fs, cfg, false)
		}
		if err != nil {
			t.Errorf("--strategy %s: %v", strategy, err)
		}
	}
}

var _ flag.Value = (*workerList)(nil)
