package watch_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/vllm"
)

// numberedMetrics numbers its scrapes and reports the number as the
// running requests: an index's load tells which scrape it holds.
type numberedMetrics struct{ n atomic.Int64 }

func (c *numberedMetrics) Scrape(context.Context) (vllm.Metrics, error) {
	return vllm.Metrics{Running: int(c.n.Add(1)), HasLoad: true}, nil
}

// Four replicas' Watchers follow one engine, each relaying its scrapes to
// the others a millisecond later, all started at the same instant (their
// turns in step, the worst case): the engine is scraped about once an
// interval, not four times, and every replica holds its latest load or
// the one before. The replica that scrapes stops: another takes over
// within an interval. Without Relay, four times the scrapes.
func TestReplicasShareScrapes(t *testing.T) {
	const (
		replicas = 4
		interval = 100 * time.Millisecond
		lag      = time.Millisecond
		span     = 30 * time.Second
		turns    = int64(span / interval)
	)
	for _, relay := range []bool{true, false} {
		t.Run(fmt.Sprintf("relay=%v", relay), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := &numberedMetrics{}
				ws := make([]*watch.Watcher, replicas)
				idxs := make([]*kvindex.Index, replicas)
				for i := range ws {
					idxs[i] = kvindex.New(kvindex.Config{})
					cfg := watch.Config{}
					if relay {
						cfg.Relay = func(worker string, _ time.Time, m vllm.Metrics) {
							for j, o := range ws {
								if j != i {
									time.AfterFunc(lag, func() { o.Relayed(worker, m) })
								}
							}
						}
					}
					ws[i] = watch.New(idxs[i], cfg)
				}
				for _, w := range ws {
					defer w.Close()
					if err := w.AddEngine("e0", watch.EngineConfig{Metrics: src, ScrapeInterval: interval}); err != nil {
						t.Fatal(err)
					}
				}
				// scrapes returns the scrapes made over span, and which
				// replica made most.
				scrapes := func(live []*watch.Watcher) (n int64, busiest *watch.Watcher) {
					time.Sleep(5 * time.Second) // past any turns still in step
					synctest.Wait()
					before, most := src.n.Load(), map[*watch.Watcher]uint64{}
					for _, w := range live {
						most[w] = w.Engines()[0].Scrapes.OK
					}
					time.Sleep(span)
					synctest.Wait()
					var top uint64
					for _, w := range live {
						if d := w.Engines()[0].Scrapes.OK - most[w]; d >= top {
							top, busiest = d, w
						}
					}
					latest := int64(src.n.Load())
					for i, w := range ws {
						if !relay || !slices.Contains(live, w) {
							continue // without relay, each holds its own latest
						}
						if got := int64(match(idxs[i], nil).Load.Running); got < latest-1 {
							t.Errorf("replica %d holds scrape %d of %d", i, got, latest)
						}
					}
					return src.n.Load() - before, busiest
				}
				want := turns
				if !relay {
					want = replicas * turns
				}
				n, busiest := scrapes(ws)
				t.Logf("%d scrapes in %s at %s, %d replicas", n, span, interval, replicas)
				if n < want*9/10 || n > want*11/10 {
					t.Errorf("%d scrapes in %s, want %d ± 10%%", n, span, want)
				}
				if !relay {
					return
				}
				busiest.Close()
				var live []*watch.Watcher
				for _, w := range ws {
					if w != busiest {
						live = append(live, w)
					}
				}
				if n, _ := scrapes(live); n < want*9/10 || n > want*11/10 {
					t.Errorf("with the replica that scraped gone: %d scrapes in %s, want %d ± 10%%", n, span, want)
				}
			})
		})
	}
}

// Past its ScrapesPerSecond, a Watcher stretches its engines' interval
// by the scrapes it makes itself: four replicas relaying to each other,
// each scraping about a quarter of the turns, keep the configured
// interval where one replica, or four that do not relay, stretch it
// twofold.
func TestRelayedScrapesShareTheBudget(t *testing.T) {
	const (
		replicas = 4
		engines  = 40
		interval = 100 * time.Millisecond
		perSec   = 200 // 40 engines every 100ms would take 400 a second
	)
	for _, relay := range []bool{true, false} {
		t.Run(fmt.Sprintf("relay=%v", relay), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ws := make([]*watch.Watcher, replicas)
				for i := range ws {
					cfg := watch.Config{ScrapesPerSecond: perSec}
					if relay {
						cfg.Relay = func(worker string, _ time.Time, m vllm.Metrics) {
							for j, o := range ws {
								if j != i {
									time.AfterFunc(time.Millisecond, func() { o.Relayed(worker, m) })
								}
							}
						}
					}
					ws[i] = watch.New(kvindex.New(kvindex.Config{}), cfg)
				}
				srcs := make([]*numberedMetrics, engines)
				for e := range srcs {
					srcs[e] = &numberedMetrics{}
				}
				for _, w := range ws {
					defer w.Close()
					for e, src := range srcs {
						if err := w.AddEngine(fmt.Sprintf("e%d", e), watch.EngineConfig{Metrics: src, ScrapeInterval: interval}); err != nil {
							t.Fatal(err)
						}
					}
				}
				// Past the first seconds' shares (the interval stretches
				// until one is measured), over 10 s.
				total := func() (n int64) {
					for _, src := range srcs {
						n += src.n.Load()
					}
					return n
				}
				time.Sleep(50 * time.Second)
				synctest.Wait()
				before := total()
				time.Sleep(10 * time.Second)
				synctest.Wait()
				if relay {
					// One scrape an engine a turn in all, as one replica
					// would make.
					if n, turns := total()-before, int64(engines*10*time.Second/interval); n < turns*9/10 || n > turns*13/10 {
						t.Errorf("%d scrapes in 10 s, want about %d, one an engine a turn", n, turns)
					}
				}
				want := interval
				if !relay {
					want = 2 * interval
				}
				for i, w := range ws {
					for _, e := range w.Engines() {
						if e.ScrapeInterval < want || e.ScrapeInterval > want*5/4 {
							t.Fatalf("replica %d scrapes %s every %s, want %s", i, e.Worker, e.ScrapeInterval, want)
						}
					}
				}
			})
		})
	}
}
