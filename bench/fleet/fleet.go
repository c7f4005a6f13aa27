// Package fleet starts an in-process fleet: simulated workers
// (workers/sim) and a scheduler in front of them, serving on loopback
// ports. baton demo, baton bench and the end-to-end tests build their
// fleets with it, so they wire workers and scheduler the same way.
package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/sim"
)

// DefaultReadyTimeout bounds Start's wait for the scheduler's /readyz.
const DefaultReadyTimeout = 10 * time.Second

// Spec describes a fleet. Its zero value is a scheduler alone, with the
// workers its Scheduler config already lists.
type Spec struct {
	// Workers, Prefill and Decode count the simulated workers of each
	// role: Workers colocated ones (role both), or Prefill prefill and
	// Decode decode ones for disaggregated serving. They start in that
	// order.
	Workers, Prefill, Decode int
	// Name names the i-th worker (from 0) of role; nil: DefaultName.
	Name func(role string, i int) string
	// Config returns the simulated engine of a worker; nil: sim.Config's
	// defaults. The builder sets Name and Role.
	Config func(name, role string) sim.Config
	// StartOptions returns a worker's extra sim.Start options (a transport
	// of the test's, a request size limit); nil: none.
	StartOptions func(name, role string) []sim.StartOption
	// Listen returns a worker's gRPC and HTTP listen addresses (an empty
	// HTTP address: no OpenAI endpoint of its own); nil: any loopback port
	// for gRPC, no HTTP.
	Listen func(name, role string) (grpc, http string)
	// WorkerLog receives each worker's logs, with a worker=name attribute;
	// nil discards them.
	WorkerLog *slog.Logger

	// Scheduler is the scheduler's configuration: Start appends the
	// workers to its Workers and serves on a free loopback port, whatever
	// its Listen says.
	Scheduler scheduler.Config
	// MaxLoRAs is each worker's max_loras in the scheduler's
	// configuration: the LoRA adapters (Scheduler.Adapters) loaded onto it
	// at once. 0: none.
	MaxLoRAs int
	// Log receives the scheduler's logs; nil discards them.
	Log *slog.Logger
	// Registry holds the strategies by name; nil: routing's built-ins.
	Registry *routing.Registry
	// Replicas is the number of schedulers started in front of the
	// workers, each configured alike and serving on its own port, as
	// replicas of baton serve behind a load balancer; 0 means 1.
	Replicas int
	// ReplicaConfig, when set, edits replica i's copy of the scheduler's
	// configuration before it starts (what differs between replicas: the
	// address each takes its peers' decisions on).
	ReplicaConfig func(i int, cfg *scheduler.Config)
	// ReadyTimeout bounds Start's wait until /readyz answers 200 (at least
	// one worker available); 0: DefaultReadyTimeout; negative: Start does
	// not wait, for tests whose workers are down on purpose.
	ReadyTimeout time.Duration
}

// DefaultName names workers by role and index: both-0, prefill-0,
// decode-0, as baton demo shows them.
func DefaultName(role string, i int) string { return fmt.Sprintf("%s-%d", role, i) }

// Fleet is a running fleet.
type Fleet struct {
	// Scheduler serves at Addr (host:port); both are empty after
	// StartWorkers. They are the first of Replicas.
	Scheduler *scheduler.Scheduler
	Addr      string
	// Replicas are every scheduler of the fleet (Spec.Replicas), the
	// first being Scheduler.
	Replicas []Replica
	// Workers are the simulated workers in start order, and Configs their
	// entries in the scheduler's configuration: name, gRPC address, role.
	Workers []*sim.Worker
	Configs []scheduler.WorkerConfig

	closeOnce sync.Once
	closeErr  error
}

// Replica is one scheduler of a fleet, serving at Addr (host:port).
type Replica struct {
	Scheduler *scheduler.Scheduler
	Addr      string
	served    chan error // Serve's result
}

// URL is the replica's base URL.
func (r Replica) URL() string { return "http://" + r.Addr }

// URL is the scheduler's base URL.
func (f *Fleet) URL() string { return "http://" + f.Addr }

// StartWorkers starts spec's simulated workers only, for a caller that
// runs its own scheduler from Configs. On error the workers already
// started are closed.
func StartWorkers(spec Spec) (*Fleet, error) {
	f := &Fleet{}
	if err := f.startWorkers(spec); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Start starts spec's workers and a scheduler in front of them (or
// Spec.Replicas of them), each serving on a free loopback port, and
// returns once every scheduler is ready and knows every worker (unless
// spec.ReadyTimeout is negative). On error everything started is closed.
func Start(spec Spec) (*Fleet, error) {
	f := &Fleet{}
	if err := f.start(spec); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func (f *Fleet) start(spec Spec) error {
	if err := f.startWorkers(spec); err != nil {
		return err
	}
	cfg := spec.Scheduler
	for i := range f.Configs {
		f.Configs[i].MaxLoRAs = spec.MaxLoRAs
	}
	cfg.Workers = append(append([]scheduler.WorkerConfig(nil), cfg.Workers...), f.Configs...)
	reg := spec.Registry
	if reg == nil {
		reg = &routing.Registry{}
		routing.RegisterBuiltins(reg)
	}
	for i := range max(spec.Replicas, 1) {
		cfg := cfg
		if spec.ReplicaConfig != nil {
			spec.ReplicaConfig(i, &cfg)
		}
		s, err := scheduler.New(cfg, reg, spec.Log)
		if err != nil {
			return fmt.Errorf("scheduler: %w", err)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			s.Close()
			return fmt.Errorf("scheduler listener: %w", err)
		}
		r := Replica{Scheduler: s, Addr: l.Addr().String(), served: make(chan error, 1)}
		go func() { r.served <- s.Serve(l) }()
		f.Replicas = append(f.Replicas, r)
	}
	f.Scheduler, f.Addr = f.Replicas[0].Scheduler, f.Replicas[0].Addr
	if spec.ReadyTimeout < 0 {
		return nil
	}
	timeout := spec.ReadyTimeout
	if timeout == 0 {
		timeout = DefaultReadyTimeout
	}
	start := time.Now()
	for _, r := range f.Replicas {
		if err := waitReady(r.URL()+"/readyz", timeout); err != nil {
			return err
		}
		// Ready means one worker serves; a fleet that is measured needs
		// all of them (a Describe that timed out on a loaded machine is
		// asked again at the next health check).
		for p := r.Scheduler.Pending(); len(p) > 0; p = r.Scheduler.Pending() {
			if time.Since(start) > timeout {
				return fmt.Errorf("workers %v not described after %v", p, timeout)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return nil
}

func (f *Fleet) startWorkers(spec Spec) error {
	name := spec.Name
	if name == nil {
		name = DefaultName
	}
	roles := []struct {
		role string
		n    int
	}{{sim.RoleBoth, spec.Workers}, {sim.RolePrefill, spec.Prefill}, {sim.RoleDecode, spec.Decode}}
	for _, r := range roles {
		for i := range r.n {
			n := name(r.role, i)
			var cfg sim.Config
			if spec.Config != nil {
				cfg = spec.Config(n, r.role)
			}
			cfg.Name, cfg.Role = n, r.role
			grpcListen, httpListen := "127.0.0.1:0", ""
			if spec.Listen != nil {
				grpcListen, httpListen = spec.Listen(n, r.role)
			}
			var opts []sim.StartOption
			if spec.StartOptions != nil {
				opts = spec.StartOptions(n, r.role)
			}
			var log *slog.Logger
			if spec.WorkerLog != nil {
				log = spec.WorkerLog.With("worker", n)
			}
			w, err := sim.Start(cfg, grpcListen, httpListen, log, opts...)
			if err != nil {
				return fmt.Errorf("worker %s: %w", n, err)
			}
			f.Workers = append(f.Workers, w)
			f.Configs = append(f.Configs, scheduler.WorkerConfig{Name: n, Address: w.GRPCAddr, Role: r.role})
		}
	}
	return nil
}

// waitReady polls url until it answers 200 or timeout passes.
func waitReady(url string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// No keep-alive: no idle connection outlives the wait.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	const poll = 20 * time.Millisecond
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := hc.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		if ctx.Err() == nil || last == nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("scheduler not ready after %v: %w", timeout, last)
		case <-time.After(poll):
		}
	}
}

// Close closes the schedulers, then the workers. It returns the first
// error a scheduler's Serve returned, if any, and is idempotent.
func (f *Fleet) Close() error {
	f.closeOnce.Do(func() {
		for _, r := range f.Replicas {
			r.Scheduler.Close()
			if err := <-r.served; err != nil && f.closeErr == nil {
				f.closeErr = err
			}
		}
		for _, w := range f.Workers {
			w.Close()
		}
	})
	return f.closeErr
}
