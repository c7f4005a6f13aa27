package scheduler_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/sim"
)

// fleet is a disaggregated fleet under test.
type fleet struct {
	workers map[string]*sim.Worker
	addr    string
	s       *scheduler.Scheduler
}

// startFleet starts prefill and decode simulated workers (named p0…, d0…)
// at the given time scales, prefill workers pushing over tr if not nil,
// and a prefix_aware scheduler in front of them.
func startFleet(t *testing.T, nPrefill, nDecode int, pScale, dScale float64, tr func() transfer.Transport, edit func(*scheduler.Config)) *fleet {
	t.Helper()
	return startFleetLog(t, nPrefill, nDecode, pScale, dScale, tr, edit, nil)
}

// startFleetLog is startFleet with the scheduler logging to log.
func startFleetLog(t *testing.T, nPrefill, nDecode int, pScale, dScale float64, tr func() transfer.Transport, edit func(*scheduler.Config), log *slog.Logger) *fleet {
	t.Helper()
	spec := simfleet.Spec{
		Prefill: nPrefill,
		Decode:  nDecode,
		Name:    shortName,
		Config: func(_, role string) sim.Config {
			if role == sim.RolePrefill {
				return sim.Config{TimeScale: pScale}
			}
			return sim.Config{TimeScale: dScale}
		},
		StartOptions: func(_, role string) []sim.StartOption {
			if tr == nil || role != sim.RolePrefill {
				return nil
			}
			tt := tr()
			t.Cleanup(func() { tt.Close() })
			return []sim.StartOption{sim.WithTransport(tt)}
		},
		Scheduler: scheduler.Config{Strategy: "prefix_aware", Pool: fastPool()},
		Log:       log,
	}
	if edit != nil {
		edit(&spec.Scheduler)
	}
	sf := startFleetSpec(t, spec)
	f := &fleet{workers: map[string]*sim.Worker{}, s: sf.Scheduler, addr: sf.Addr}
	for i, wc := range sf.Configs {
		f.workers[wc.Name] = sf.Workers[i]
	}
	return f
}

// userKeys returns the block keys of a one-message chat prompt.
func userKeys(prompt string) []uint64 {
	return blockkey.Append(nil, blockkey.Seed(model, ""), "<|user|>\n"+prompt+"\n", blockkey.DefaultBlockChars)
}

func TestDisaggregatedMatchesColocated(t *testing.T) {
	f := startFleet(t, 2, 2, fastScale, fastScale, nil, nil)
	c := oaClient(t, f.addr)
	_, colocated := startWorkers(t, 1, fastScale)
	_, caddr := startScheduler(t, scheduler.Config{Workers: colocated})
	cc := oaClient(t, caddr)

	for i := range 4 {
		prompt := text(fmt.Sprintf("doc-%d", i), 6000) // about 1,500 tokens: remote
		got := chat(t, c, chatParams(prompt, 40))
		want := chat(t, cc, chatParams(prompt, 40))
		if got.content != want.content || got.finish != want.finish {
			t.Errorf("prompt %d: disaggregated text %q (%s), colocated %q (%s)", i, got.content, got.finish, want.content, want.finish)
		}
		pw := got.prefill
		if !strings.HasPrefix(pw, "p") || !strings.HasPrefix(got.worker, "d") {
			t.Fatalf("prompt %d: prefill worker %q, decode worker %q", i, pw, got.worker)
		}
		if !strings.Contains(got.route, "prefill=remote") {
			t.Errorf("prompt %d: route %q, want prefill=remote", i, got.route)
		}
		if got.cached != 0 {
			t.Errorf("prompt %d: first request reports %d cached tokens, want 0", i, got.cached)
		}
		// The decode worker now holds every full block of the prompt.
		keys := userKeys(prompt)
		if n := f.workers[got.worker].Engine.Cache().Lookup(keys); n != len(keys) {
			t.Errorf("prompt %d: decode worker %s holds %d of %d blocks", i, got.worker, n, len(keys))
		}
	}

	// Streaming goes the same way.
	r, err := streamChat(t, c, chatParams(text("stream", 6000), 20))
	if err != nil || r.content == "" || !strings.Contains(r.route, "prefill=remote") {
		t.Fatalf("stream: %+v, %v", r, err)
	}

	hc := httpClient(t)
	m := scrapeSettled(t, hc, f.addr)
	if v, _ := metric(m, "baton_disagg_decisions_total", `decision="remote"`); v != 5 {
		t.Errorf("remote decisions = %v, want 5", v)
	}
	if v, _ := metric(m, "baton_transfer_bytes_total"); v <= 0 {
		t.Errorf("transfer bytes = %v", v)
	}
	if _, ok := metric(m, "baton_ttft_phase_seconds_count", `phase="first_decode"`); !ok {
		t.Error("no first_decode phase observed")
	}
}

func TestRepeatedPrefixTransfersOnlyNewBlocks(t *testing.T) {
	// Always transfer, so the short new part moves too.
	f := startFleet(t, 2, 2, fastScale, fastScale, nil, func(c *scheduler.Config) {
		c.Disaggregation.MinRemotePrefillTokens = 1
	})
	c := oaClient(t, f.addr)
	hc := httpClient(t)
	prefix := text("shared-system-prompt", 8000)
	// Each question adds about five blocks of its own.
	question := func(i int) string { return prefix + text(fmt.Sprintf("question %d", i), 320) }
	first := chat(t, c, chatParams(question(0), 10))
	shared := len(userKeys(prefix)) - 1
	// Decode workers are picked by load, so ask until the same one serves.
	for i := 1; i < 20; i++ {
		before := scrapeSettled(t, hc, f.addr)
		r := chat(t, c, chatParams(question(i), 10))
		if r.worker != first.worker {
			continue
		}
		after := scrapeSettled(t, hc, f.addr)
		sent0, _ := metric(before, "baton_transfer_blocks_total", `kind="sent"`)
		sent1, _ := metric(after, "baton_transfer_blocks_total", `kind="sent"`)
		held0, _ := metric(before, "baton_transfer_blocks_total", `kind="held"`)
		held1, _ := metric(after, "baton_transfer_blocks_total", `kind="held"`)
		if held1-held0 < float64(shared) || sent1-sent0 < 1 || sent1-sent0 > 8 {
			t.Errorf("repeat on %s: sent %v blocks and found %v held; the shared prefix has %d", r.worker, sent1-sent0, held1-held0, shared)
		}
		if r.cached < int64(len(prefix)/4-64) {
			t.Errorf("repeat reports %d cached tokens, want about %d", r.cached, len(prefix)/4)
		}
		return
	}
	t.Fatal("the first request's decode worker never served again")
}

func TestConditionalDisaggregation(t *testing.T) {
	f := startFleet(t, 1, 1, fastScale, fastScale, nil, nil)
	c := oaClient(t, f.addr)
	short := chat(t, c, chatParams("a short question about routing", 10))
	if short.prefill != "" || !strings.Contains(short.route, "prefill=local(short)") {
		t.Errorf("short prompt: prefill worker %q, route %q", short.prefill, short.route)
	}
	long := chat(t, c, chatParams(text("long", 4000), 10))
	if long.prefill != "p0" || !strings.Contains(long.route, "prefill=remote") {
		t.Errorf("long prompt: prefill worker %q, route %q", long.prefill, long.route)
	}
	m := scrapeSettled(t, httpClient(t), f.addr)
	if v, _ := metric(m, "baton_disagg_decisions_total", `decision="local"`, `reason="short"`); v != 1 {
		t.Errorf("local short decisions = %v, want 1", v)
	}
	if v, _ := metric(m, "baton_transfer_blocks_total", `kind="sent"`); v < 40 {
		t.Errorf("blocks sent = %v, want the long prompt's", v)
	}
}

// Every fault below must end with every request answered correctly.

func TestPrefillWorkerKilledMidPrefill(t *testing.T) {
	// Prefill workers run in real time: a 32,000-character prompt takes
	// about 0.2 s to prefill, long enough to kill its worker mid-way.
	f := startFleet(t, 2, 1, 1, fastScale, nil, nil)
	c := oaClient(t, f.addr)
	prompt := text("long-document", 32000)
	want := chat(t, oaClient(t, startColocated(t)), chatParams(prompt, 16))

	// Kill whichever prefill worker takes the request, once it is busy.
	killed := make(chan string, 1)
	go func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		timeout := time.After(5 * time.Second)
		for {
			for _, name := range []string{"p0", "p1"} {
				if f.workers[name].Engine.Load().Running > 0 {
					f.workers[name].Close()
					killed <- name
					return
				}
			}
			select {
			case <-tick.C:
			case <-timeout:
				killed <- ""
				return
			}
		}
	}()
	got := chat(t, c, chatParams(prompt, 16))
	victim := <-killed
	if victim == "" {
		t.Fatal("no prefill worker ever ran the request")
	}
	if got.content != want.content {
		t.Errorf("text %q, want %q", got.content, want.content)
	}
	if pw := got.prefill; pw == victim {
		t.Errorf("the killed worker %s is named as the prefill worker", victim)
	}
	m := scrapeSettled(t, httpClient(t), f.addr)
	if v, _ := metric(m, "baton_transfer_failures_total"); v < 1 {
		t.Errorf("transfer failures = %v, want at least 1", v)
	}
}

// startColocated starts one colocated worker behind its own scheduler and
// returns the scheduler's address: the reference for generated text.
func startColocated(t *testing.T) string {
	_, cfgs := startWorkers(t, 1, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Workers: cfgs})
	return addr
}

func TestDecodeWorkerKilledMidTransfer(t *testing.T) {
	// Stall every block 20 ms in flight, and kill the decode worker once
	// the push has begun.
	var pushing atomic.Int32
	tr := func() transfer.Transport {
		return transfer.NewGRPC(transfer.WithDelay(func(uint64) time.Duration {
			pushing.Add(1)
			return 20 * time.Millisecond
		}))
	}
	f := startFleet(t, 1, 2, fastScale, fastScale, tr, nil)
	c := oaClient(t, f.addr)
	prompt := text("transfer-victim", 6000)
	want := chat(t, oaClient(t, startColocated(t)), chatParams(prompt, 16))

	done := make(chan chatResult, 1)
	go func() { done <- chat(t, c, chatParams(prompt, 16)) }()
	eventually(t, 10*time.Second, func() error {
		if pushing.Load() == 0 {
			return fmt.Errorf("no push yet")
		}
		return nil
	})
	// The push targets the decode worker with a transfer under way.
	victim := ""
	for _, name := range []string{"d0", "d1"} {
		if f.s.Pool.Snapshot().Worker(name).InFlight() > 0 {
			victim = name
		}
	}
	if victim == "" {
		t.Fatal("no decode worker has the request in flight")
	}
	f.workers[victim].Close()
	got := <-done
	if got.content != want.content || got.worker == victim {
		t.Errorf("served by %s (killed %s): %q, want %q", got.worker, victim, got.content, want.content)
	}
}

func TestCorruptBlockNeverEntersCache(t *testing.T) {
	var corrupted atomic.Int32
	tr := func() transfer.Transport {
		return transfer.NewGRPC(transfer.WithFault(func(key uint64, data []byte) []byte {
			if corrupted.Add(1) == 3 { // the third block sent
				bad := append([]byte(nil), data...)
				bad[len(bad)/2] ^= 0xff
				return bad
			}
			return data
		}))
	}
	f := startFleet(t, 1, 1, fastScale, fastScale, tr, nil)
	c := oaClient(t, f.addr)
	prompt := text("corrupt-me", 6000)
	want := chat(t, oaClient(t, startColocated(t)), chatParams(prompt, 16))
	got := chat(t, c, chatParams(prompt, 16))
	if got.content != want.content {
		t.Errorf("text %q, want %q", got.content, want.content)
	}
	m := scrapeSettled(t, httpClient(t), f.addr)
	if v, _ := metric(m, "baton_transfer_blocks_total", `kind="rejected"`); v != 1 {
		t.Errorf("rejected blocks = %v, want 1", v)
	}
	// The decode worker recomputed the corrupt block: it holds every
	// block now, and the one it holds is its own.
	keys := userKeys(prompt)
	if n := f.workers["d0"].Engine.Cache().Lookup(keys); n != len(keys) {
		t.Errorf("decode worker holds %d of %d blocks", n, len(keys))
	}
}

func TestStalledTransferPastDeadline(t *testing.T) {
	tr := func() transfer.Transport {
		return transfer.NewGRPC(transfer.WithDelay(func(uint64) time.Duration { return time.Second }))
	}
	f := startFleet(t, 1, 1, fastScale, fastScale, tr, func(c *scheduler.Config) {
		c.Disaggregation.TransferTimeout = 200 * time.Millisecond
		c.Disaggregation.PrefillRetries = -1
	})
	c := oaClient(t, f.addr)
	prompt := text("stalled", 6000)
	want := chat(t, oaClient(t, startColocated(t)), chatParams(prompt, 16))
	start := time.Now()
	got := chat(t, c, chatParams(prompt, 16))
	if got.content != want.content {
		t.Errorf("text %q, want %q", got.content, want.content)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("request took %v: the stalled transfer was waited out", d)
	}
	m := scrapeSettled(t, httpClient(t), f.addr)
	if v, _ := metric(m, "baton_transfer_failures_total", `reason="timeout"`); v < 1 {
		if all, _ := metric(m, "baton_transfer_failures_total"); all < 1 {
			t.Errorf("transfer failures = %v, want the stall counted", all)
		}
	}
}

func TestPrefillPoolDownServesColocated(t *testing.T) {
	f := startFleet(t, 2, 1, fastScale, fastScale, nil, nil)
	c := oaClient(t, f.addr)
	f.workers["p0"].Close()
	f.workers["p1"].Close()
	eventually(t, 5*time.Second, func() error {
		for _, w := range f.s.PrefillPool.Snapshot().Workers {
			if w.Available() {
				return fmt.Errorf("%s still available", w.Name)
			}
		}
		return nil
	})
	for i := range 3 {
		r := chat(t, c, chatParams(text(fmt.Sprintf("no-prefill-%d", i), 6000), 8))
		if r.worker != "d0" || !strings.Contains(r.route, "no_prefill_worker") {
			t.Errorf("request %d: worker %q route %q", i, r.worker, r.route)
		}
	}

	// With the decode pool gone too, requests get a 503.
	f.workers["d0"].Close()
	eventually(t, 5*time.Second, func() error {
		if f.s.Pool.Snapshot().Worker("d0").Available() {
			return fmt.Errorf("d0 still available")
		}
		return nil
	})
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"hi"}]}`
	r := do(t, httpClient(t), http.MethodPost, "http://"+f.addr+"/v1/chat/completions", body, nil)
	if _, _, code, _ := decodeError(t, r.body); r.status != 503 || code != "no_worker_available" {
		t.Errorf("status %d code %q, want 503 no_worker_available", r.status, code)
	}
}

func TestDisconnectCancelsPrefillTransferAndDecode(t *testing.T) {
	f := startFleet(t, 1, 1, 1, 1, nil, nil)
	c := oaClient(t, f.addr)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Chat.Completions.New(ctx, chatParams(text("cancel-me", 32000), 500))
		done <- err
	}()
	eventually(t, 5*time.Second, func() error {
		if f.workers["p0"].Engine.Load().Running == 0 {
			return fmt.Errorf("prefill not running yet")
		}
		return nil
	})
	cancel()
	if err := <-done; err == nil {
		t.Fatal("cancelled request succeeded")
	}
	eventually(t, 5*time.Second, func() error {
		for name, w := range f.workers {
			if l := w.Engine.Load(); l.Running+l.Waiting > 0 {
				return fmt.Errorf("%s still runs %d, waits %d", name, l.Running, l.Waiting)
			}
		}
		if n := f.s.PrefillPool.Snapshot().Worker("p0").InFlight() + f.s.Pool.Snapshot().Worker("d0").InFlight(); n != 0 {
			return fmt.Errorf("%d calls in flight", n)
		}
		return nil
	})
}
