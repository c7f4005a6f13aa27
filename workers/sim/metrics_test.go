package sim

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/workers/engine"
)

// syncBuffer is a log destination safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// logLines returns the lines of logs that contain every one of parts.
func logLines(logs string, parts ...string) []string {
	var out []string
	for _, l := range strings.Split(logs, "\n") {
		ok := l != ""
		for _, p := range parts {
			ok = ok && strings.Contains(l, p)
		}
		if ok {
			out = append(out, l)
		}
	}
	return out
}

// A Redis outage shows in the worker's logs and metrics: the breaker's
// opening at WARN, its recovery at INFO, its state, and the errors.
func TestStoreBreakerObserved(t *testing.T) {
	srv := redistest.Start(t)
	var logs syncBuffer
	m := NewMetrics(slog.New(slog.NewTextHandler(&logs, nil)))
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	const openTimeout = 100 * time.Millisecond
	b := kvstore.NewBreaker(r, kvstore.BreakerConfig{Name: "redis", Failures: 3, OpenTimeout: openTimeout}, m.StoreOptions("redis")...)
	t.Cleanup(func() { b.Close() })
	ctx := context.Background()
	ns := transfer.Namespace{Model: "m"}
	state := func() float64 {
		v, _ := metricValue(t, m, "baton_kv_store_breaker_state", "store", "redis")
		return v
	}
	errs := func(op kvstore.Op, reason string) float64 {
		v, _ := metricValue(t, m, "baton_kv_store_errors_total", "store", "redis", "op", string(op), "reason", reason)
		return v
	}
	if _, err := b.Get(ctx, ns, []uint64{1}, 64); err != nil {
		t.Fatalf("Get with Redis up: %v", err)
	}
	if got := state(); got != 0 {
		t.Errorf("state %v with Redis up, want 0 (closed)", got)
	}

	srv.Stop()
	waitFor(t, "the breaker to open", func() bool {
		b.Get(ctx, ns, []uint64{1}, 64)
		return b.State() == gobreaker.StateOpen
	})
	if got := state(); got != 2 {
		t.Errorf("state %v with Redis down, want 2 (open)", got)
	}
	if got := errs(kvstore.OpGet, "error"); got != 3 {
		t.Errorf("get errors %v, want 3 (the failures that opened it)", got)
	}
	b.Get(ctx, ns, []uint64{1}, 64)
	if got := errs(kvstore.OpGet, "bypassed"); got < 1 {
		t.Errorf("get bypassed %v, want at least 1", got)
	}
	if got := logLines(logs.String(), "level=WARN", "kv store breaker open", "store=redis"); len(got) != 1 {
		t.Errorf("WARN lines on opening: %q\nlogs:\n%s", got, logs.String())
	}

	srv.Restart()
	waitFor(t, "the breaker to close", func() bool {
		b.Get(ctx, ns, []uint64{1}, 64)
		return b.State() == gobreaker.StateClosed
	})
	if got := state(); got != 0 {
		t.Errorf("state %v after recovery, want 0 (closed)", got)
	}
	for _, to := range []string{"half-open", "closed"} {
		if got := logLines(logs.String(), "level=INFO", "kv store breaker "+to, "store=redis"); len(got) == 0 {
			t.Errorf("no INFO line for %s; logs:\n%s", to, logs.String())
		}
		if got, _ := metricValue(t, m, "baton_kv_store_breaker_transitions_total", "store", "redis", "to", to); got < 1 {
			t.Errorf("transitions to %s: %v", to, got)
		}
	}
}

// metricValue returns the value of the sample of family name whose labels
// include labels (name, value pairs), and whether there is one.
func metricValue(t *testing.T, m *Metrics, name string, labels ...string) (float64, bool) {
	t.Helper()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatalf("Gather: %v", err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	metric:
		for _, s := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range s.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue metric
				}
			}
			switch {
			case s.Gauge != nil:
				return s.GetGauge().GetValue(), true
			case s.Counter != nil:
				return s.GetCounter().GetValue(), true
			}
			return 0, true
		}
	}
	return 0, false
}

// The engine's metrics follow its load and transfers.
func TestEngineMetrics(t *testing.T) {
	p := newEngine(t, Config{Role: RolePrefill, Tiers: Tiers{GPUBlocks: 1000, CPUBlocks: 500}})
	d := newEngine(t, Config{Role: RoleDecode})
	n := transfer.NewInMem()
	t.Cleanup(n.Listen("d", d))
	tr := closeTransport(t, n.Transport())
	mp, md := NewMetrics(nil), NewMetrics(nil)
	mp.Engine(p)
	md.Engine(d)
	req := &engine.Request{Model: testModel, Prompt: longPrompt("m", 10)}
	if _, err := p.Prefill(context.Background(), &engine.PrefillRequest{Request: req, TransferID: "x", DecodeAddr: "d"}, tr); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		m      *Metrics
		name   string
		labels []string
		want   float64
	}{
		{mp, "baton_worker_kv_blocks_capacity", []string{"tier", "gpu"}, 1000},
		{mp, "baton_worker_kv_blocks_capacity", []string{"tier", "cpu"}, 500},
		{mp, "baton_worker_kv_blocks_used", []string{"tier", "gpu"}, 0},
		{mp, "baton_worker_sequences", []string{"state", "running"}, 0},
		{mp, "baton_worker_transfers_total", []string{"direction", "sent"}, 1},
		{mp, "baton_worker_transfer_failures_total", []string{"direction", "sent"}, 0},
		{mp, "baton_worker_transfer_blocks_total", []string{"direction", "sent"}, 10},
		{mp, "baton_worker_transfer_bytes_total", []string{"direction", "sent"}, float64(10 * p.BlockBytes())},
		{md, "baton_worker_transfers_total", []string{"direction", "received"}, 1},
		{md, "baton_worker_transfer_blocks_total", []string{"direction", "received", "outcome", "accepted"}, 10},
		{md, "baton_worker_transfer_bytes_total", []string{"direction", "received"}, float64(10 * d.BlockBytes())},
	} {
		got, ok := metricValue(t, tc.m, tc.name, tc.labels...)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (found %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	for _, name := range []string{"process_resident_memory_bytes", "go_goroutines"} {
		if _, ok := metricValue(t, mp, name); !ok {
			t.Errorf("no %s", name)
		}
	}
}
