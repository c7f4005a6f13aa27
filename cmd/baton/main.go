// Command baton is the one binary of baton: the scheduler (serve), the
// simulated engine worker (worker), an all-in-one local cluster (demo) and
// its version.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const usage = `baton routes OpenAI-compatible LLM traffic across a fleet of engine workers.

Usage:
  baton serve   [flags]   run the scheduler in front of configured workers
  baton worker  [flags]   run a simulated engine worker
  baton demo    [flags]   run a scheduler and a simulated fleet in one process
  baton bench   [flags]   benchmark routing strategies on a workload, side by side
  baton version           print the version

Run "baton COMMAND -h" for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "baton:", err)
		}
		stop()
		os.Exit(2)
	}
}

// run runs the command args until it ends or ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command")
	}
	switch args[0] {
	case "serve":
		return serve(ctx, args[1:], stdout, stderr)
	case "worker":
		return worker(ctx, args[1:], stdout, stderr)
	case "demo":
		return demo(ctx, args[1:], stdout, stderr)
	case "bench":
		return benchCmd(ctx, args[1:], stdout, stderr)
	case "version", "-version", "--version":
		fmt.Fprintln(stdout, "baton", buildVersion())
		return nil
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

func buildVersion() string {
	if version != "dev" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				return "dev-" + s.Value[:12]
			}
		}
	}
	return version
}

// newLogger returns a text logger on w at the named level.
func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level: %w", err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})), nil
}
