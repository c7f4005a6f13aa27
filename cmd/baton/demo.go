package main

import (
	"context"
	"fmt"
	"io"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/sim"
)

func demo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("demo", "[flags]\n\nRuns a scheduler and a simulated fleet in one process.")
	var f schedulerFlags
	// The demo shows what baton is for: prefix-aware routing.
	f.register(fs, "127.0.0.1:8080", routing.PrefixAware)
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
	roles, err := demoRoles(*colocated, *nPrefill, *nDecode)
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
	// The fleet's shared KV tier: Redis with --redis, else one in-process
	// store all the demo's workers share.
	if sf.store, err = sf.openStore(); err != nil {
		return err
	}
	if sf.store == nil {
		sf.store = kvstore.NewMemory(kvstore.MemoryConfig{})
	}
	defer sf.store.Close()
	count := map[string]int{}
	for _, role := range roles {
		name := fmt.Sprintf("%s-%d", role, count[role])
		count[role]++
		sf.role = role
		w, err := sim.Start(sf.config(name), "127.0.0.1:0", "", log.With("worker", name))
		if err != nil {
			return err
		}
		defer w.Close()
		go logWarmup(ctx, w.Engine, log.With("worker", name))
		cfg.Workers = append(cfg.Workers, scheduler.WorkerConfig{Name: name, Address: w.GRPCAddr, Role: role})
	}
	fleet := fmt.Sprintf("%d prefill + %d decode simulated workers", count[sim.RolePrefill], count[sim.RoleDecode])
	if *colocated > 0 {
		fleet = fmt.Sprintf("%d simulated workers", *colocated)
	}
	model := sf.config("").WithDefaults().Models[0]
	return runScheduler(ctx, cfg, stdout, stderr, func(addr string) {
		fmt.Fprintf(stdout, `baton demo: scheduler at http://%[1]s (strategy %[2]s, %[3]s serving %[4]s)

  curl -sN http://%[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[4]s","stream":true,"messages":[{"role":"user","content":"Hello, baton!"}]}'

  OpenAI clients: base URL http://%[1]s/v1 (any API key).  Metrics: http://%[1]s/metrics
  Ctrl-C stops.
`, addr, cfg.WithDefaults().Strategy, fleet, model)
	})
}

// demoRoles lists the roles of the demo's workers: colocated ones if asked
// for, else a prefill/decode fleet.
func demoRoles(colocated, prefill, decode int) ([]string, error) {
	var roles []string
	switch {
	case colocated < 0 || colocated > 64:
		return nil, fmt.Errorf("--workers: must be 0–64, got %d", colocated)
	case colocated > 0:
		for range colocated {
			roles = append(roles, sim.RoleBoth)
		}
		return roles, nil
	case prefill < 0 || prefill > 32:
		return nil, fmt.Errorf("--prefill-workers: must be 0–32, got %d", prefill)
	case decode < 1 || decode > 32:
		return nil, fmt.Errorf("--decode-workers: must be 1–32, got %d", decode)
	}
	for range prefill {
		roles = append(roles, sim.RolePrefill)
	}
	for range decode {
		roles = append(roles, sim.RoleDecode)
	}
	return roles, nil
}
