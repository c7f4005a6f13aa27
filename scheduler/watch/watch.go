// Package watch keeps the KV index current: for each worker it holds one
// Watch stream open, applies the stream's snapshot and events to the
// index, and resubscribes (for a fresh snapshot) when the stream ends or
// skips a sequence number.
package watch

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/vllm"
)

// ErrClosed is returned by Add after Close.
var ErrClosed = errors.New("watcher closed")

// errNoSnapshot ends a stream whose first event is not a snapshot.
var errNoSnapshot = errors.New("watch stream did not start with a snapshot")

// Reasons of a resubscription, by ResyncReason.
const (
	// ResyncGap: an event's sequence number skipped ahead, so events were
	// lost; the index must not trust what it holds of the worker.
	ResyncGap = "gap"
	// ResyncStream: the stream broke or ended (the worker restarted or
	// dropped a slow subscriber, the connection broke), or did not start
	// with a snapshot.
	ResyncStream = "stream"
	// ResyncUnreachable: Info or Watch failed, so no stream began (each
	// attempt while the worker is down counts).
	ResyncUnreachable = "unreachable"
)

// ResyncReason classifies an error OnResync receives: ResyncGap,
// ResyncStream or ResyncUnreachable.
func ResyncReason(err error) string {
	var se subscribeError
	switch {
	case errors.Is(err, kvindex.ErrGap):
		return ResyncGap
	case errors.As(err, &se):
		return ResyncUnreachable
	}
	return ResyncStream
}

// subscribeError marks a failure before the stream began; its message is
// its cause's.
type subscribeError struct{ err error }

func (e subscribeError) Error() string { return e.err.Error() }
func (e subscribeError) Unwrap() error { return e.err }

// Source is a worker the Watcher subscribes to; grpcworker.Client
// implements it. The Watcher calls Info, then Watch, from the worker's
// goroutine on every (re)subscription; both may block until ctx ends.
// The stream's Recv is called from that goroutine only, and must return
// once the ctx passed to Watch is cancelled.
type Source interface {
	// Info describes the worker; its cost figures, block size and Redis
	// tier feed kv_aware's estimates.
	Info(ctx context.Context) (*workerpb.InfoResponse, error)
	// Watch subscribes to the worker's load reports and cache events.
	Watch(ctx context.Context) (workerpb.Worker_WatchClient, error)
}

// Defaults of Config.
const (
	DefaultMinBackoff  = 100 * time.Millisecond
	DefaultMaxBackoff  = 5 * time.Second
	DefaultInfoTimeout = 5 * time.Second
)

// Config configures a Watcher. The zero value means every default.
type Config struct {
	// MinBackoff is the wait before resubscribing after a stream that
	// applied its snapshot ends (a gap, the worker restarting); it
	// doubles after each failed subscription up to MaxBackoff. Defaults
	// DefaultMinBackoff (100 ms) and DefaultMaxBackoff (5 s).
	MinBackoff, MaxBackoff time.Duration
	// InfoTimeout bounds each Info call. Default DefaultInfoTimeout.
	InfoTimeout time.Duration
	// OnResync, if set, is called from the worker's goroutine each time
	// its subscription ends and the Watcher is about to resubscribe, with
	// the reason: an error wrapping kvindex.ErrGap (events were lost),
	// a stream error, or a failure to subscribe (ResyncReason classifies
	// it). It must not block. Use it for logs and metrics.
	OnResync func(worker string, err error)
	// OnAdapters, if set, is called from the worker's goroutine with the
	// LoRA adapters the worker holds, each time its Info or a load report
	// tells them (workers that serve no adapter do not), so that loads and
	// evictions the worker did itself, or its restart, reach the routing;
	// with its adapter slots from Info (0 from load reports). It must not
	// block.
	OnAdapters func(worker string, held []string, slots int)
	// ScrapesPerSecond bounds the engine metrics scrapes the Watcher
	// starts a second, across all its engines: with more engines than
	// their ScrapeInterval allows within it, each engine's interval
	// stretches to engines/ScrapesPerSecond. With Relay, the engines are
	// counted in the share of the turns this Watcher scraped itself over
	// the last second. Default
	// DefaultScrapesPerSecond; negative: no bound.
	ScrapesPerSecond float64
	// Relay, if set, shares the engines' load with the other scheduler
	// replicas in front of them: it is handed each usable scrape of an
	// engine's metrics (with when the scrape began), for the others'
	// Watchers (Relayed), and an engine whose load another replica
	// relayed within three quarters of its interval is not scraped at its
	// turn. With several replicas each engine is thus scraped by about one
	// of them an interval, whichever's turn comes first, and the others
	// take its report: the engines serve one replica's scrapes, not one
	// per replica. It is called from the engine's scraping goroutine and
	// must not block.
	Relay func(worker string, at time.Time, m vllm.Metrics)
}

// DefaultScrapesPerSecond is Config.ScrapesPerSecond's default: 1,000
// engines at DefaultScrapeInterval. A scrape of a vLLM engine's page
// costs the scheduler about 0.2 ms of CPU, so the default bounds
// scraping to about one core whatever the fleet's size.
const DefaultScrapesPerSecond = 4000

func (c Config) withDefaults() Config {
	if c.MinBackoff <= 0 {
		c.MinBackoff = DefaultMinBackoff
	}
	if c.MaxBackoff < c.MinBackoff {
		c.MaxBackoff = max(DefaultMaxBackoff, c.MinBackoff)
	}
	if c.ScrapesPerSecond == 0 {
		c.ScrapesPerSecond = DefaultScrapesPerSecond
	}
	if c.InfoTimeout <= 0 {
		c.InfoTimeout = DefaultInfoTimeout
	}
	return c
}

// Watcher runs one goroutine per worker, feeding idx. Its methods are safe
// for concurrent use.
type Watcher struct {
	idx *kvindex.Index
	cfg Config

	mu      sync.RWMutex // serializes Add, Remove and Close; Relayed and Engines read under it
	workers map[string]*watched
	closed  bool

	wakeMu sync.Mutex               // guards wakes; never held while blocking
	wakes  map[string]chan struct{} // by worker: Retry's signal to its goroutine (cap 1)

	scraping atomic.Int64 // engines whose scrape loops run

	// With Config.Relay, the share of the turns this Watcher scraped
	// itself (the rest another replica's report covered), which the
	// ScrapesPerSecond budget counts: turns and scraped since
	// shareFrom, share in millionths plus one (0: not measured yet),
	// updated every shareEvery.
	turns, scraped atomic.Int64
	shareFrom      atomic.Int64 // Unix nanoseconds
	share          atomic.Int64
}

// shareEvery is how often the share of turns scraped is taken anew.
const shareEvery = time.Second

// turn counts one turn of an engine's scrape loop, taken at now (Unix
// nanoseconds), scraped or skipped.
func (w *Watcher) turn(now int64, scraped bool) {
	if w.cfg.Relay == nil {
		return
	}
	w.turns.Add(1)
	if scraped {
		w.scraped.Add(1)
	}
	from := w.shareFrom.Load()
	if now-from < int64(shareEvery) || !w.shareFrom.CompareAndSwap(from, now) {
		return
	}
	if t := w.turns.Swap(0); t > 0 {
		w.share.Store(w.scraped.Swap(0)*1e6/t + 1)
	}
}

// scrapeInterval is the interval of an engine configured to scrape every
// d, with the Watcher's scrape loops sharing its ScrapesPerSecond.
func (w *Watcher) scrapeInterval(d time.Duration) time.Duration {
	if w.cfg.ScrapesPerSecond < 0 {
		return d
	}
	engines := float64(w.scraping.Load())
	if w.cfg.Relay != nil {
		// Only the turns this replica scrapes count: with the others'
		// reports relayed, four replicas each scrape about a quarter.
		if sh := w.share.Load(); sh > 0 {
			engines *= float64(sh-1) / 1e6
		}
	}
	return max(d, time.Duration(engines/w.cfg.ScrapesPerSecond*float64(time.Second)))
}

type watched struct {
	cancel context.CancelFunc
	done   chan struct{}
	stats  func() EngineStats // engines only
	engine *engine            // engines only
}

// Relayed applies an engine's load that another replica scraped and
// relayed (Config.Relay) as if this Watcher had scraped it, and holds
// back this Watcher's own next scrape of the engine if it comes within
// three quarters of an interval. It reports false when no engine is
// watched as worker.
func (w *Watcher) Relayed(worker string, m vllm.Metrics) bool {
	// Held while the report is applied, so that a worker being removed
	// is not reported on after.
	w.mu.RLock()
	defer w.mu.RUnlock()
	wd := w.workers[worker]
	if wd == nil || wd.engine == nil {
		return false
	}
	wd.engine.relayed(m)
	return true
}

// New returns a Watcher feeding idx, watching no worker yet.
func New(idx *kvindex.Index, cfg Config) *Watcher {
	return &Watcher{idx: idx, cfg: cfg.withDefaults(), workers: make(map[string]*watched), wakes: make(map[string]chan struct{})}
}

// Add starts watching src as the worker name, replacing (and stopping
// first) any source already watched under that name. The index keeps the
// worker's blocks until the new stream's snapshot replaces them.
func (w *Watcher) Add(name string, src Source) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return ErrClosed
	}
	if old := w.workers[name]; old != nil {
		old.stop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	wd := &watched{cancel: cancel, done: make(chan struct{})}
	w.workers[name] = wd
	wake := make(chan struct{}, 1)
	w.wakeMu.Lock()
	w.wakes[name] = wake
	w.wakeMu.Unlock()
	go w.run(ctx, wd.done, name, src, wake)
	return nil
}

// Remove stops watching the worker name, waits for its goroutine to end,
// and removes the worker from the index. Removing a worker not watched
// still removes it from the index.
func (w *Watcher) Remove(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if wd := w.workers[name]; wd != nil {
		wd.stop()
		delete(w.workers, name)
	}
	w.wakeMu.Lock()
	delete(w.wakes, name)
	w.wakeMu.Unlock()
	w.idx.RemoveWorker(name)
}

// Close stops every worker's goroutine and waits for them. The index keeps
// what it knows. Close is idempotent.
func (w *Watcher) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil
	}
	w.closed = true
	for _, wd := range w.workers {
		wd.cancel()
	}
	for name, wd := range w.workers {
		<-wd.done
		delete(w.workers, name)
	}
	return nil
}

// Retry has the goroutine of the worker name, if it is waiting to
// resubscribe, try again now rather than at the end of its backoff (up to
// MaxBackoff). Call it when the worker is known to be back, its health
// checks passing again: a restarted worker is then routed to again, and
// until its snapshot arrives the index holds what the old process held.
// It does not block; a worker not watched is ignored. A Retry while the
// worker's stream is up cuts the next wait short instead.
func (w *Watcher) Retry(name string) {
	w.wakeMu.Lock()
	ch := w.wakes[name]
	w.wakeMu.Unlock()
	select {
	case ch <- struct{}{}: // a nil ch (not watched) is never ready
	default:
	}
}

func (wd *watched) stop() {
	wd.cancel()
	<-wd.done
}

// run subscribes to src until ctx ends, backing off between attempts; a
// signal on wake (Retry) ends a wait early.
func (w *Watcher) run(ctx context.Context, done chan<- struct{}, name string, src Source, wake <-chan struct{}) {
	defer close(done)
	backoff := w.cfg.MinBackoff
	for {
		synced, err := w.session(ctx, name, src)
		if ctx.Err() != nil {
			return
		}
		if synced {
			backoff = w.cfg.MinBackoff
		}
		if w.cfg.OnResync != nil {
			w.cfg.OnResync(name, err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		case <-wake:
			t.Stop()
		}
		backoff = min(2*backoff, w.cfg.MaxBackoff)
	}
}

// session runs one subscription: Info, then the stream until it fails or
// the index refuses an event (a gap). synced reports that its snapshot was
// applied.
func (w *Watcher) session(ctx context.Context, name string, src Source) (synced bool, err error) {
	ictx, cancel := context.WithTimeout(ctx, w.cfg.InfoTimeout)
	info, err := src.Info(ictx)
	cancel()
	if err != nil {
		return false, subscribeError{fmt.Errorf("worker %s: %w", name, err)}
	}
	if err := w.idx.SetInfo(name, InfoFromProto(info)); err != nil {
		return false, subscribeError{err}
	}
	w.adapters(name, info.GetAdapters(), int(info.GetMaxLoras()))
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := src.Watch(sctx)
	if err != nil {
		return false, subscribeError{fmt.Errorf("worker %s: %w", name, err)}
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			return synced, fmt.Errorf("worker %s: watch: %w", name, err)
		}
		if !synced && ev.GetSnapshot() == nil {
			return false, fmt.Errorf("worker %s: %w", name, errNoSnapshot)
		}
		if err := w.idx.Apply(name, FromProto(ev)); err != nil {
			return synced, err
		}
		synced = true
		if l := ev.GetLoad(); l != nil {
			w.adapters(name, l.GetAdapters(), 0)
		} else if s := ev.GetSnapshot(); s != nil {
			w.adapters(name, s.GetLoad().GetAdapters(), 0)
		}
	}
}

// adapters tells OnAdapters what a worker holds, when a says.
func (w *Watcher) adapters(name string, a *workerpb.Adapters, slots int) {
	if a != nil && w.cfg.OnAdapters != nil {
		w.cfg.OnAdapters(name, a.GetNames(), slots)
	}
}
