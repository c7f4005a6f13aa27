package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/workers/sim"
)

func demo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f schedulerFlags
	f.register(fs, "127.0.0.1:8080")
	var sf simFlags
	sf.register(fs)
	n := fs.Int("workers", 4, "number of simulated workers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n < 1 || *n > 64 {
		return fmt.Errorf("-workers: must be 1–64, got %d", *n)
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	if cfg.Strategy == "" {
		// The demo shows what baton is for.
		cfg.Strategy = "prefix_aware"
	}
	log, err := newLogger(stderr, cfg.WithDefaults().LogLevel)
	if err != nil {
		return err
	}
	for i := range *n {
		name := fmt.Sprintf("sim-%d", i)
		w, err := sim.Start(sf.config(name), "127.0.0.1:0", "", log.With("worker", name))
		if err != nil {
			return err
		}
		defer w.Close()
		cfg.Workers = append(cfg.Workers, scheduler.WorkerConfig{Name: name, Address: w.GRPCAddr})
	}
	model := sf.config("").WithDefaults().Models[0]
	return runScheduler(ctx, cfg, stdout, stderr, func(addr string) {
		fmt.Fprintf(stdout, `baton demo: scheduler at http://%[1]s (strategy %[2]s, %[3]d simulated workers serving %[4]s)

  curl -sN http://%[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[4]s","stream":true,"messages":[{"role":"user","content":"Hello, baton!"}]}'

  OpenAI clients: base URL http://%[1]s/v1 (any API key).  Metrics: http://%[1]s/metrics
  Ctrl-C stops.
`, addr, cfg.WithDefaults().Strategy, *n, model)
	})
}
