// Command baton is the one binary of baton: the scheduler (serve), the
// simulated engine worker (worker), an all-in-one local cluster (demo) and
// its version.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
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
  baton calibrate --worker URL   measure an engine's cost figures for its configuration
  baton tune    [flags]   search prefill:decode splits and routing for goodput on a virtual clock
  baton version           print the version

Run "baton COMMAND -h" or "baton help COMMAND" for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := exitCode(run(ctx, os.Args[1:], os.Stdout, os.Stderr), os.Stderr)
	stop()
	os.Exit(code)
}

// exitCode reports err, the result of run, on stderr and returns the exit
// code: 0 on success and when help was asked for, else 2.
func exitCode(err error, stderr io.Writer) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return 0
	}
	fmt.Fprintln(stderr, "baton:", err)
	return 2
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
	case "calibrate":
		return calibrateCmd(ctx, args[1:], stdout, stderr)
	case "tune":
		return tuneCmd(ctx, args[1:], stdout, stderr)
	case "version", "-version", "--version":
		fmt.Fprintln(stdout, "baton", buildVersion())
		return nil
	case "help", "-h", "-help", "--help":
		if len(args) > 1 && args[1] != "help" && args[1] != "version" {
			return run(ctx, []string{args[1], "-h"}, stdout, stderr)
		}
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

// newLogger returns a text logger on w at the level --log-level names.
func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level: must be debug, info, warn or error, got %q", level)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})), nil
}

// newFlagSet returns the flag set of the command name, whose usage shows
// synopsis (its arguments and what it does) above the flags.
func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: baton %s %s\n\nFlags:\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args into fs. Help asked for with -h or --help goes
// to stdout, and the error is flag.ErrHelp (exit code 0); a bad flag is
// reported on stderr with the usage. Arguments left after the flags are
// an error: no command takes any.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) error {
	var out bytes.Buffer
	fs.SetOutput(&out)
	err := fs.Parse(args)
	fs.SetOutput(stderr)
	if errors.Is(err, flag.ErrHelp) {
		stdout.Write(out.Bytes())
		return err
	}
	stderr.Write(out.Bytes())
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (flags go before them; see baton %s -h)", fs.Args(), fs.Name())
	}
	return nil
}

// setFlags returns the names of the flags set on fs's command line.
func setFlags(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return set
}

// renameField names the flag that set the field a validation error
// begins with ("field: why"): flagOf returns the flag (with its dashes)
// or "" when no flag set the field, and err is returned as it is.
func renameField(err error, flagOf func(field string) string) error {
	field, why, ok := strings.Cut(err.Error(), ": ")
	if !ok {
		return err
	}
	if name := flagOf(field); name != "" {
		return fmt.Errorf("%s: %s", name, why)
	}
	return err
}
