package main

import (
	"bytes"
	"context"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// TestConfigLoads: the configuration printed is one baton serve loads:
// every engine a vllm worker with its events, replay socket, block size
// and cost figures, reachable at its address.
func TestConfigLoads(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fleet.yaml")
	ctx, cancel := context.WithCancel(context.Background())
	var stdout bytes.Buffer
	stderr := newStderr()
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"-n", "2", "-time-scale", "100", "-config", path}, &stdout, stderr) }()
	cfg := waitServing(t, path, stderr, done)
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	if err := cfg.Validate(reg); err != nil {
		t.Fatalf("the configuration does not validate: %v", err)
	}
	if len(cfg.Workers) != 2 || cfg.Strategy != "kv_aware" {
		t.Fatalf("configuration %+v, want 2 workers and kv_aware", cfg)
	}
	for _, w := range cfg.Workers {
		if w.Kind != scheduler.KindVLLM || w.Events == "" || w.EventsReplay == "" || w.BlockSize != 16 || w.Cost.FLOPS <= 0 {
			t.Errorf("worker %+v, want a vllm worker with events, replay, block size 16 and cost figures", w)
		}
		resp, err := http.Get(w.Address + "/health")
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s/health: %v %v", w.Address, resp, err)
		} else {
			resp.Body.Close()
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr.String(), "fake-vllm-1: 0 requests") {
		t.Errorf("stderr %q, want each engine's counters", stderr.String())
	}
}

// TestConfigLoadsDataParallel: with -dp, each engine is a vllm worker with
// data_parallel_size, whose ranks publish on its events ports plus their
// rank.
func TestConfigLoadsDataParallel(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fleet.yaml")
	ctx, cancel := context.WithCancel(context.Background())
	var stdout bytes.Buffer
	stderr := newStderr()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-n", "1", "-dp", "2", "-time-scale", "100", "-config", path}, &stdout, stderr)
	}()
	cfg := waitServing(t, path, stderr, done)
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	if err := cfg.Validate(reg); err != nil {
		t.Fatalf("the configuration does not validate: %v", err)
	}
	if len(cfg.Workers) != 1 || cfg.Workers[0].DataParallelSize != 2 || cfg.Workers[0].Events == "" {
		t.Fatalf("workers %+v, want one vllm worker with data_parallel_size 2 and events", cfg.Workers)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr.String(), "fake-vllm-0/dp1: 0 requests") {
		t.Errorf("stderr %q, want each rank's counters", stderr.String())
	}
}

// TestChurnPublishes: the churn loop's blocks reach a subscriber of the
// engines' events, every one of them, on each engine in turn.
func TestChurnPublishes(t *testing.T) {
	var ranks []*vllmtest.Server
	for range 2 {
		s, err := vllmtest.New(vllmtest.Config{TimeScale: 1e6, GPUBlocks: 64, BlockSize: 4})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		ranks = append(ranks, s)
	}
	seen := make(chan int, 1024)
	for _, s := range ranks {
		sub, err := kvevents.New(kvevents.SubscriberConfig{Endpoint: s.EventsEndpoint(), Topic: s.Topic()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = s.WaitSubscribed(wctx)
		wcancel()
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for m := range sub.Messages() {
				for _, ev := range m.Batch.Events {
					if st, ok := ev.(*kvevents.BlockStored); ok {
						seen <- len(st.BlockHashes)
					}
				}
			}
		}()
	}
	ctx, cancel := context.WithCancel(context.Background())
	stored := make(chan int64, 1)
	go func() { stored <- churnLoop(ctx, ranks, 20000, 8, 4) }()
	got := 0
	timeout := time.After(10 * time.Second)
	for got < 64 {
		select {
		case n := <-seen:
			got += n
		case <-timeout:
			t.Fatalf("%d blocks seen in 10s", got)
		}
	}
	cancel()
	n := <-stored
	for got < int(n) {
		select {
		case k := <-seen:
			got += k
		case <-timeout:
			t.Fatalf("%d blocks seen of %d stored", got, n)
		}
	}
	if got != int(n) || n%8 != 0 {
		t.Errorf("stored %d blocks, seen %d; want equal, in prompts of 8", n, got)
	}
	for i, s := range ranks {
		if st := s.Stats(); st.BlocksStored == 0 {
			t.Errorf("engine %d stored nothing: the churn takes engines in turn", i)
		}
	}
}

// runStderr is the run's standard error as the test reads it while the run
// writes it; serving is closed once the run says its engines serve (it
// has written the configuration by then).
type runStderr struct {
	mu      sync.Mutex
	b       strings.Builder
	serving chan struct{}
}

func newStderr() *runStderr { return &runStderr{serving: make(chan struct{})} }

func (w *runStderr) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	was := strings.Contains(w.b.String(), "engines serving")
	w.b.Write(p)
	if !was && strings.Contains(w.b.String(), "engines serving") {
		close(w.serving)
	}
	return len(p), nil
}

func (w *runStderr) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// waitServing waits until the run serves and returns the configuration it
// wrote to path.
func waitServing(t *testing.T, path string, stderr *runStderr, done <-chan error) scheduler.Config {
	t.Helper()
	select {
	case <-stderr.serving:
	case err := <-done:
		t.Fatalf("the run ended before serving: %v\n%s", err, stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatalf("not serving after 10s\n%s", stderr.String())
	}
	cfg, err := scheduler.LoadConfig(path)
	if err != nil {
		t.Fatalf("loading the configuration: %v\n%s", err, stderr.String())
	}
	return cfg
}
