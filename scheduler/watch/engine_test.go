package watch_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// fakeMetrics is an engine's metrics as the test sets them.
type fakeMetrics struct {
	mu  sync.Mutex
	m   vllm.Metrics
	err error
}

func (f *fakeMetrics) Scrape(context.Context) (vllm.Metrics, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return vllm.Metrics{}, f.err
	}
	return f.m, nil
}

func (f *fakeMetrics) set(m vllm.Metrics, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.m, f.err = m, err
}

// waitUntil checks cond every few milliseconds until it returns nil, and
// fails t with its error after 10 s: the events cross a real socket.
func waitUntil(t *testing.T, cond func() error) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(10 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatal(err)
		}
	}
}

func match(idx *kvindex.Index, keys []uint64) kvindex.Match {
	out := make([]kvindex.Match, 1)
	idx.Lookup(keys, []string{"e0"}, out)
	return out[0]
}

// newEngineWatch returns a publisher of cache events on a loopback port, an
// index and a watcher feeding it, closed at the test's end.
func newEngineWatch(t *testing.T) (*kveventstest.Publisher, *kvindex.Index, *watch.Watcher) {
	t.Helper()
	pub, err := kveventstest.NewPublisher(kveventstest.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Topic: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	idx := kvindex.New(kvindex.Config{})
	w := watch.New(idx, watch.Config{})
	t.Cleanup(func() { w.Close() })
	return pub, idx, w
}

// TestEngine: an engine's scraped load and translated events reach the
// index; a lost batch resets its blocks but keeps its load; Remove stops
// following it and forgets it.
func TestEngine(t *testing.T) {
	pub, idx, w := newEngineWatch(t)
	src := &fakeMetrics{m: vllm.Metrics{Running: 2, Waiting: 1, HasLoad: true, KVUsage: 0.5, HasKVUsage: true, BlockSize: 4, GPUBlocks: 100}}
	err := w.AddEngine("e0", watch.EngineConfig{
		Metrics: src, ScrapeInterval: 10 * time.Millisecond,
		Events: kvevents.SubscriberConfig{Endpoint: pub.Endpoint(), Topic: "kv", RedialMin: 10 * time.Millisecond},
		Model:  func() string { return "m" },
	})
	if err != nil {
		t.Fatal(err)
	}
	want := kvindex.Load{Running: 2, Waiting: 1, GPUBlocksUsed: 50, GPUBlocksTotal: 100}
	waitUntil(t, func() error {
		if m := match(idx, nil); m.Load != want || m.BlockTokens != 4 {
			return fmt.Errorf("load %+v, block tokens %d; want %+v, 4", m.Load, m.BlockTokens, want)
		}
		return nil
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	keys := blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt("m", "", "")), toks, 4)
	if _, err := pub.Publish(kvevents.Batch{Events: []kvevents.Event{&kvevents.BlockStored{
		BlockHashes: []kvevents.Hash{kvevents.IntHash(1), kvevents.IntHash(2)}, TokenIDs: toks, BlockSize: 4,
	}}}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, func() error {
		if m := match(idx, keys); m.GPU != 2 {
			return fmt.Errorf("%d of 2 stored blocks indexed", m.GPU)
		}
		return nil
	})

	// A batch the subscriber never gets, and no replay socket: a reset.
	src.set(vllm.Metrics{Running: 7, HasLoad: true}, nil)
	waitUntil(t, func() error {
		if m := match(idx, nil); m.Load.Running != 7 {
			return fmt.Errorf("load %+v, want 7 running", m.Load)
		}
		return nil
	})
	// Scrapes fail from now on: the load the reset keeps is the last one
	// scraped, not one scraped after it.
	src.set(vllm.Metrics{}, errors.New("connection refused"))
	waitUntil(t, func() error {
		if st := w.Engines(); len(st) != 1 || st[0].Scrapes.Failed == 0 {
			return fmt.Errorf("Engines() = %+v, want a failed scrape", st)
		}
		return nil
	})
	if _, err := pub.Drop(kvevents.Batch{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(kvevents.Batch{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, func() error {
		if m := match(idx, keys); m.GPU != 0 || m.Load.Running != 7 {
			return fmt.Errorf("after a reset: %d blocks, load %+v; want none, the latest load (7 running)", m.GPU, m.Load)
		}
		return nil
	})
	stats := w.Engines()
	if len(stats) != 1 || stats[0].Worker != "e0" || !stats[0].HasEvents || stats[0].Translated.Stored != 2 || stats[0].Events.Resets != 1 {
		t.Errorf("Engines() = %+v, want e0 with 2 blocks stored and 1 reset", stats)
	}

	w.Remove("e0")
	if m := match(idx, nil); m.Known {
		t.Errorf("after Remove the index still knows e0: %+v", m)
	}
	if got := w.Engines(); len(got) != 0 {
		t.Errorf("after Remove Engines() = %+v, want none", got)
	}
}

// TestEngineWithoutEvents: the index learns an engine without events
// from routing, within the slots its metrics report.
func TestEngineWithoutEvents(t *testing.T) {
	idx := kvindex.New(kvindex.Config{})
	w := watch.New(idx, watch.Config{})
	defer w.Close()
	src := &fakeMetrics{m: vllm.Metrics{HasLoad: true, Slots: 1, KVTokens: 4096}}
	cost := kvindex.DefaultCost
	cost.FLOPS /= 2
	err := w.AddEngine("e0", watch.EngineConfig{Metrics: src, ScrapeInterval: 10 * time.Millisecond,
		Cost: func() (kvindex.Cost, bool) { return cost, true }})
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, func() error {
		if m := match(idx, nil); m.Load.Slots != 1 {
			return fmt.Errorf("load %+v, want 1 slot", m.Load)
		}
		return nil
	})
	if m := match(idx, nil); !m.HasCost || m.Cost != cost {
		t.Errorf("index has cost %+v (set %v), want the configured %+v", m.Cost, m.HasCost, cost)
	}
	a, b := []uint64{1, 2, 3}, []uint64{7, 8, 9}
	idx.Predict("e0", a)
	if m := match(idx, a); m.GPU != 3 {
		t.Errorf("the prompt routed: %d blocks held, want 3", m.GPU)
	}
	idx.Finished("e0", a, kvindex.Usage{})
	idx.Predict("e0", b) // takes the one slot
	if m := match(idx, a); m.GPU != 0 {
		t.Errorf("one slot, another prompt routed since: %d blocks held, want 0", m.GPU)
	}
}

// An engine whose model is not known when its first events come (a
// worker not yet described) has them keyed without it; once its model is
// known, its next batch is keyed by it and the blocks keyed before leave
// the index: no request would find them, and their hashes must not chain
// new blocks onto the old keys.
func TestEngineEventsFollowTheModel(t *testing.T) {
	pub, idx, w := newEngineWatch(t)
	var mu sync.Mutex
	model := ""
	err := w.AddEngine("e0", watch.EngineConfig{
		Metrics: &fakeMetrics{m: vllm.Metrics{HasLoad: true, BlockSize: 4, GPUBlocks: 100}}, ScrapeInterval: 10 * time.Millisecond,
		Events: kvevents.SubscriberConfig{Endpoint: pub.Endpoint(), Topic: "kv", RedialMin: 10 * time.Millisecond},
		Model: func() string {
			mu.Lock()
			defer mu.Unlock()
			return model
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
	store := func(first uint64, toks []uint32) {
		t.Helper()
		if _, err := pub.Publish(kvevents.Batch{Events: []kvevents.Event{&kvevents.BlockStored{
			BlockHashes: []kvevents.Hash{kvevents.IntHash(first), kvevents.IntHash(first + 1)}, TokenIDs: toks, BlockSize: 4,
		}}}); err != nil {
			t.Fatal(err)
		}
	}
	keys := func(m string, toks []uint32) []uint64 {
		return blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt(m, "", "")), toks, 4)
	}
	a, b := []uint32{1, 2, 3, 4, 5, 6, 7, 8}, []uint32{9, 10, 11, 12, 13, 14, 15, 16}
	store(1, a)
	waitUntil(t, func() error {
		if m := match(idx, keys("", a)); m.GPU != 2 {
			return fmt.Errorf("%d of 2 blocks indexed without a model", m.GPU)
		}
		return nil
	})
	mu.Lock()
	model = "m"
	mu.Unlock()
	store(3, b)
	waitUntil(t, func() error {
		if m := match(idx, keys("m", b)); m.GPU != 2 {
			return fmt.Errorf("%d of 2 blocks indexed under the model", m.GPU)
		}
		return nil
	})
	if m := match(idx, keys("", a)); m.GPU != 0 {
		t.Errorf("%d blocks keyed without the model still indexed, want none", m.GPU)
	}
}

// countingMetrics counts its scrapes.
type countingMetrics struct{ n atomic.Int64 }

func (c *countingMetrics) Scrape(context.Context) (vllm.Metrics, error) {
	c.n.Add(1)
	return vllm.Metrics{HasLoad: true}, nil
}

// TestScrapesShareTheBudget: engines scrape at their interval while the
// Watcher's ScrapesPerSecond allows; past it, their intervals stretch so
// that together they stay within it, and shrink back as engines leave.
func TestScrapesShareTheBudget(t *testing.T) {
	for _, tt := range []struct {
		name     string
		perSec   float64
		engines  int
		interval time.Duration
		want     time.Duration // the interval in use
	}{
		{"within the budget", 400, 20, 100 * time.Millisecond, 100 * time.Millisecond},
		{"past the budget", 40, 20, 100 * time.Millisecond, 500 * time.Millisecond},
		{"no bound", -1, 20, 100 * time.Millisecond, 100 * time.Millisecond},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				w := watch.New(kvindex.New(kvindex.Config{}), watch.Config{ScrapesPerSecond: tt.perSec})
				defer w.Close()
				srcs := make([]*countingMetrics, tt.engines)
				for i := range srcs {
					srcs[i] = &countingMetrics{}
					if err := w.AddEngine(fmt.Sprintf("e%d", i), watch.EngineConfig{Metrics: srcs[i], ScrapeInterval: tt.interval}); err != nil {
						t.Fatal(err)
					}
				}
				time.Sleep(time.Second) // every engine's loop has started and scraped
				synctest.Wait()
				var before int64
				for _, s := range srcs {
					before += s.n.Load()
				}
				const span = 10 * time.Second
				time.Sleep(span)
				synctest.Wait()
				var n int64
				for _, s := range srcs {
					n += s.n.Load()
				}
				want := int64(tt.engines) * int64(span/tt.want)
				if n-before < want-int64(tt.engines) || n-before > want+int64(tt.engines) {
					t.Errorf("%d scrapes in %s, want %d ± %d", n-before, span, want, tt.engines)
				}
				for _, e := range w.Engines() {
					if e.ScrapeInterval != tt.want {
						t.Errorf("%s scrapes every %s, want %s", e.Worker, e.ScrapeInterval, tt.want)
					}
				}
				if tt.want == tt.interval {
					return
				}
				// Half the engines leave: the others scrape twice as often,
				// down to their own interval.
				for i := range tt.engines / 2 {
					w.Remove(fmt.Sprintf("e%d", i))
				}
				time.Sleep(2 * tt.want)
				synctest.Wait()
				for _, e := range w.Engines() {
					if want := max(tt.interval, tt.want/2); e.ScrapeInterval != want {
						t.Errorf("after half left, %s scrapes every %s, want %s", e.Worker, e.ScrapeInterval, want)
					}
				}
			})
		})
	}
}
