package main

import (
	"context"
	"fmt"
	"io"

	"github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/sim"
)

func demo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", "[flags]\n\nRuns a scheduler and a simulated fleet in one process.")
	var f schedulerFlags
	// The demo shows what baton is for: prefix-aware routing.
	f.register(fs, "127.0.0.1:8080", routing.PrefixAware)
	f.registerTLS(fs) // off by default: the demo is for loopback
	var sf simFlags
	sf.register(fs)
	colocated := fs.Int("workers", 0, "run this many colocated (role both) workers instead of a prefill/decode fleet, 0–64")
	nPrefill := fs.Int("prefill-workers", 2, "prefill workers of the disaggregated fleet, 0–32")
	nDecode := fs.Int("decode-workers", 2, "decode workers of the disaggregated fleet, 1–32")
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	if err := sf.check(fs); err != nil {
		return err
	}
	spec, err := demoFleet(*colocated, *nPrefill, *nDecode)
	if err != nil {
		return err
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	if err := f.check(fs, cfg, true); err != nil {
		return err
	}
	log, err := newLogger(stderr, cfg.WithDefaults().LogLevel)
	if err != nil {
		return err
	}
	stopPprof, err := f.servePprof(log)
	if err != nil {
		return err
	}
	defer stopPprof()
	// The fleet's shared KV tier: Redis with --redis, else one in-process
	// store all the demo's workers share.
	if sf.store, err = sf.openStore(); err != nil {
		return err
	}
	if sf.store == nil {
		sf.store = kvstore.NewMemory(kvstore.MemoryConfig{})
	}
	defer sf.store.Close()
	spec.Config = func(name, _ string) sim.Config { return sf.config(name) }
	spec.WorkerLog = log
	workers, err := fleet.StartWorkers(spec)
	if err != nil {
		return err
	}
	defer workers.Close()
	for i, w := range workers.Workers {
		go logWarmup(ctx, w.Engine, log.With("worker", workers.Configs[i].Name))
	}
	cfg.Workers = append(cfg.Workers, workers.Configs...)
	shape := fmt.Sprintf("%d prefill + %d decode simulated workers", spec.Prefill, spec.Decode)
	if spec.Workers > 0 {
		shape = fmt.Sprintf("%d simulated workers", spec.Workers)
	}
	model := sf.config("").WithDefaults().Models[0]
	scheme, curlTLS := "http", ""
	if cfg.TLS.CertFile != "" {
		scheme, curlTLS = "https", "\n  (HTTPS: give curl --cacert with the CA that signed the certificate.)\n"
	}
	return runScheduler(ctx, cfg, stdout, stderr, func(addr string) {
		fmt.Fprintf(stdout, `baton demo: scheduler at %[5]s://%[1]s (strategy %[2]s, %[3]s serving %[4]s)
%[6]s
  curl -sN %[5]s://%[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[4]s","stream":true,"messages":[{"role":"user","content":"Hello, baton!"}]}'

  OpenAI clients: base URL %[5]s://%[1]s/v1 (any API key).  Metrics: %[5]s://%[1]s/metrics
  Ctrl-C stops.
`, addr, cfg.WithDefaults().Strategy, shape, model, scheme, curlTLS)
	})
}

// demoFleet shapes the demo's fleet: colocated workers if asked for, else
// a prefill/decode one.
func demoFleet(colocated, prefill, decode int) (fleet.Spec, error) {
	switch {
	case colocated < 0 || colocated > 64:
		return fleet.Spec{}, fmt.Errorf("--workers: must be 0–64, got %d", colocated)
	case colocated > 0:
		return fleet.Spec{Workers: colocated}, nil
	case prefill < 0 || prefill > 32:
		return fleet.Spec{}, fmt.Errorf("--prefill-workers: must be 0–32, got %d", prefill)
	case decode < 1 || decode > 32:
		return fleet.Spec{}, fmt.Errorf("--decode-workers: must be 1–32, got %d", decode)
	}
	return fleet.Spec{Prefill: prefill, Decode: decode}, nil
}
