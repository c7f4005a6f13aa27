package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// schedulerFlags are the flags serve and demo share; set ones override the
// config file.
type schedulerFlags struct {
	config    string
	listen    string
	strategy  string
	threshold int
	prefixLen int
	logLevel  string
}

func (f *schedulerFlags) register(fs *flag.FlagSet, defaultListen string) {
	fs.StringVar(&f.config, "config", "", "YAML configuration `file` (see README)")
	fs.StringVar(&f.listen, "listen", defaultListen, "HTTP listen `address`")
	fs.StringVar(&f.strategy, "strategy", "", "routing strategy: random, round_robin, least_outstanding, prefix_aware (default random)")
	fs.IntVar(&f.threshold, "concurrency-threshold", 0, "in-flight requests at which prefix_aware spills to a less busy worker, 1–1024 (default 16)")
	fs.IntVar(&f.prefixLen, "prefix-length", 0, "characters (bytes on /invocations) of routing text prefix_aware hashes, 1024–65536 (default 4096)")
	fs.StringVar(&f.logLevel, "log-level", "", "log level: debug, info, warn, error (default info)")
}

// load reads the config file, if any, and applies the flags set on fs.
func (f *schedulerFlags) load(fs *flag.FlagSet) (scheduler.Config, error) {
	var cfg scheduler.Config
	if f.config != "" {
		var err error
		if cfg, err = scheduler.LoadConfig(f.config); err != nil {
			return cfg, err
		}
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if set["listen"] || cfg.Listen == "" {
		cfg.Listen = f.listen
	}
	if f.strategy != "" {
		cfg.Strategy = f.strategy
	}
	// In the config file zero means "default"; on the command line it is a
	// value the user typed, and out of range.
	if set["concurrency-threshold"] {
		if f.threshold == 0 {
			return cfg, errors.New("concurrency_threshold: must be 1–1024, got 0")
		}
		cfg.ConcurrencyThreshold = f.threshold
	}
	if set["prefix-length"] {
		if f.prefixLen == 0 {
			return cfg, errors.New("prefix_length: must be 1024–65536, got 0")
		}
		cfg.PrefixLength = f.prefixLen
	}
	if f.logLevel != "" {
		cfg.LogLevel = f.logLevel
	}
	return cfg, nil
}

// workerList is a repeatable -worker flag: [name=]address, with an http://
// address meaning an OpenAI-compatible HTTP engine.
type workerList []scheduler.WorkerConfig

func (l *workerList) String() string { return fmt.Sprint(len(*l), " workers") }

func (l *workerList) Set(v string) error {
	var w scheduler.WorkerConfig
	if name, addr, ok := strings.Cut(v, "="); ok {
		w.Name, v = name, addr
	}
	w.Address = v
	w.Kind = scheduler.KindGRPC
	if strings.HasPrefix(v, "http://") || strings.HasPrefix(v, "https://") {
		w.Kind = scheduler.KindHTTP
	}
	*l = append(*l, w)
	return nil
}

func strategies() *routing.Registry {
	r := &routing.Registry{}
	routing.RegisterBuiltins(r)
	return r
}

func serve(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f schedulerFlags
	f.register(fs, scheduler.DefaultListen)
	var workers workerList
	fs.Var(&workers, "worker", "a worker, `[name=]host:port` (baton gRPC) or [name=]http://host:port (OpenAI-compatible engine); repeatable, added to the config's workers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	cfg.Workers = append(cfg.Workers, workers...)
	return runScheduler(ctx, cfg, stdout, stderr, nil)
}

// runScheduler runs a scheduler until ctx is done, then drains it. ready,
// if not nil, is called with the bound address once it listens.
func runScheduler(ctx context.Context, cfg scheduler.Config, stdout, stderr io.Writer, ready func(addr string)) error {
	log, err := newLogger(stderr, cfg.WithDefaults().LogLevel)
	if err != nil {
		return err
	}
	s, err := scheduler.New(cfg, strategies(), log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	defer s.Close()
	cfg = cfg.WithDefaults()
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	log.Info("scheduler listening", "addr", l.Addr().String(), "strategy", cfg.Strategy, "workers", len(cfg.Workers))
	if ready != nil {
		ready(l.Addr().String())
	}
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s.Shutdown(sctx)
	return <-errc
}
