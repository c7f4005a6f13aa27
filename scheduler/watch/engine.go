package watch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// MetricsSource is an engine whose metrics the Watcher scrapes;
// vllm.Scraper implements it. Scrape is called from the engine's scrape
// goroutine, one call at a time, with a ctx that ends after
// EngineConfig.ScrapeTimeout; it must return when ctx ends. An error
// wrapping vllm.ErrGarbage may come with the metrics that could be read.
type MetricsSource interface {
	Scrape(ctx context.Context) (vllm.Metrics, error)
}

// Defaults of EngineConfig.
const (
	DefaultScrapeInterval = 250 * time.Millisecond
	DefaultScrapeTimeout  = time.Second
	DefaultBlockSize      = 16
)

// EngineConfig describes an engine the Watcher follows through its
// metrics and, if it publishes them, its KV cache events: vLLM and SGLang.
type EngineConfig struct {
	// Metrics is scraped every ScrapeInterval for the engine's load.
	// Required.
	Metrics MetricsSource
	// ScrapeInterval is the time between two scrapes' starts (default
	// DefaultScrapeInterval); ScrapeTimeout bounds one (default
	// DefaultScrapeTimeout). A scrape that fails keeps the last load: the
	// pool's health checks, not the scrapes, decide the worker is down.
	ScrapeInterval, ScrapeTimeout time.Duration
	// BlockSize is the engine's tokens per KV block. 0: the one its
	// metrics say (vLLM's cache_config_info), else its events', else
	// DefaultBlockSize.
	BlockSize int
	// Events subscribes to the engine's KV events; an empty Endpoint means
	// the engine publishes none: the index learns its blocks from routing
	// (kvindex.Index.Learn) within Capacity.
	Events kvevents.SubscriberConfig
	// Capacity bounds what the index learns of an engine without events;
	// its zero fields mean what the engine's metrics say.
	Capacity kvindex.Capacity
	// Cost returns the engine's cost figures and whether it has any
	// (configured, or measured by baton calibrate); nil: none, and
	// kv_aware assumes kvindex.DefaultCost.
	Cost func() (kvindex.Cost, bool)
	// Model returns the model that salts the engine's block keys. It is
	// called when the first events arrive, so that an engine that did not
	// say at start which model it serves has said by then. Nil: "".
	Model func() string
	// Logger receives scrape problems (once per change) and index errors.
	// Nil discards.
	Logger *slog.Logger
	// OnAdapters, if set, is called from the engine's goroutine after each
	// scrape that read the engine's LoRA state (vllm.Metrics.HasLoRA):
	// the adapters with requests on it and its adapter slots. It must not
	// block.
	OnAdapters func(held []string, slots int)
}

func (c EngineConfig) withDefaults() EngineConfig {
	if c.ScrapeInterval <= 0 {
		c.ScrapeInterval = DefaultScrapeInterval
	}
	if c.ScrapeTimeout <= 0 {
		c.ScrapeTimeout = DefaultScrapeTimeout
	}
	if c.Model == nil {
		c.Model = func() string { return "" }
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// EngineStats counts what the Watcher did for one engine.
type EngineStats struct {
	Worker string
	// Scrapes counts scrapes by outcome: OK, Failed (no answer, or not
	// 200) and Garbage (metrics that did not parse or held values baton
	// cannot use; what was usable still counts).
	// Skipped counts turns not scraped because another replica relayed
	// the engine's load within the interval (Config.Relay), and Relayed
	// the reports taken from other replicas.
	Scrapes struct{ OK, Failed, Garbage, Skipped, Relayed uint64 }
	// ScrapeInterval is the interval between scrapes in use: the
	// configured one, or longer when the Watcher's engines share its
	// Config.ScrapesPerSecond.
	ScrapeInterval time.Duration
	// HasEvents: the engine's KV events are subscribed to; Events and
	// Translated count them.
	HasEvents  bool
	Events     kvevents.Stats
	Translated TranslatorStats
}

// engineState is what EngineStats reads of a running engine.
type engineState struct {
	ok, failed, garbage atomic.Uint64
	skipped, relayed    atomic.Uint64
	interval            atomic.Int64 // the scrape interval in use, in ns
	sub                 *kvevents.Subscriber
	tr                  atomic.Pointer[Translator]
}

func (s *engineState) stats(name string) EngineStats {
	st := EngineStats{Worker: name}
	st.Scrapes.OK, st.Scrapes.Failed, st.Scrapes.Garbage = s.ok.Load(), s.failed.Load(), s.garbage.Load()
	st.Scrapes.Skipped, st.Scrapes.Relayed = s.skipped.Load(), s.relayed.Load()
	st.ScrapeInterval = time.Duration(s.interval.Load())
	if s.sub != nil {
		st.HasEvents = true
		st.Events = s.sub.Stats()
	}
	if tr := s.tr.Load(); tr != nil {
		st.Translated = tr.Stats()
	}
	return st
}

// AddEngine starts following the engine cfg describes as the worker name,
// replacing (and stopping first) anything already watched under that name:
// a goroutine scrapes its metrics, another applies its load to the index,
// and when cfg.Events is set, the subscriber's goroutine applies its
// translated KV events. Remove or Close stops them.
func (w *Watcher) AddEngine(name string, cfg EngineConfig) error {
	if cfg.Metrics == nil {
		return errors.New("engine without metrics")
	}
	cfg = cfg.withDefaults()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return ErrClosed
	}
	st := &engineState{}
	// Only the latest scrape matters: a slow applier skips stale ones.
	e := &engine{idx: w.idx, name: name, cfg: cfg, st: st, w: w, ready: make(chan struct{}), scrapes: make(chan vllm.Metrics, 1)}
	if cfg.Events.Endpoint != "" {
		if cfg.Events.Logger == nil {
			cfg.Events.Logger = cfg.Logger
		}
		cfg.Events.Handle = e.handle
		sub, err := kvevents.New(cfg.Events)
		if err != nil {
			return fmt.Errorf("worker %s: %w", name, err)
		}
		st.sub = sub
	}
	if old := w.workers[name]; old != nil {
		old.stop()
	}
	ctx, cancel := context.WithCancel(context.Background())
	wd := &watched{cancel: cancel, done: make(chan struct{}), stats: func() EngineStats { return st.stats(name) }, engine: e}
	w.workers[name] = wd
	go e.run(ctx, wd.done)
	return nil
}

// Engines returns the counts of every engine followed.
func (w *Watcher) Engines() []EngineStats {
	w.mu.RLock()
	defer w.mu.RUnlock()
	out := make([]EngineStats, 0, len(w.workers))
	for _, wd := range w.workers {
		if wd.stats != nil {
			out = append(out, wd.stats())
		}
	}
	return out
}

// engine feeds one engine's load and events to the index. Its fields
// below mu are the applying goroutines': the engine's, which applies its
// loads, and its subscriber's, which applies its events.
type engine struct {
	idx   *kvindex.Index
	name  string
	cfg   EngineConfig
	st    *engineState
	w     *Watcher
	ready chan struct{} // closed once the index knows the worker
	// scrapes holds the latest usable load, scraped here or relayed by
	// another replica, until the engine's goroutine applies it.
	scrapes chan vllm.Metrics
	// relayedAt is when another replica's report of the engine's load
	// last came (Unix nanoseconds; 0 never).
	relayedAt atomic.Int64

	mu        sync.Mutex
	seq       uint64 // of the last event applied
	load      kvindex.Load
	metricsBS int // block size the metrics say, 0 unknown
	blockSize int // block size given to the index
	tr        *Translator
	lastErr   string // of the index, logged once per change
}

func (e *engine) run(ctx context.Context, done chan<- struct{}) {
	defer close(done)
	scrapes := e.scrapes
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		e.scrape(ctx, scrapes)
	}()
	defer wg.Wait()
	if e.st.sub != nil {
		defer e.st.sub.Close()
	}
	// The index knows the worker (and its block size) before any event.
	e.mu.Lock()
	e.setInfo()
	if e.st.sub == nil {
		e.logIndexErr(e.idx.Learn(e.name, e.cfg.Capacity))
	}
	e.apply(kvindex.Event{Snapshot: &kvindex.Snapshot{}})
	e.mu.Unlock()
	close(e.ready)
	for {
		select {
		case <-ctx.Done():
			return
		case m := <-scrapes:
			e.mu.Lock()
			e.scraped(m)
			e.mu.Unlock()
		}
	}
}

// handle applies a subscriber's message on the subscriber's goroutine: a
// batch is received, decoded, translated and applied without a hand-off.
func (e *engine) handle(m kvevents.Message) {
	<-e.ready
	e.mu.Lock()
	e.message(m)
	e.mu.Unlock()
}

// relayFresh is the part of its interval within which another replica's
// relayed report of an engine's load stands for this replica's own scrape
// (Config.Relay); collided, the part within which two replicas'
// scrapes of one turn are taken to have collided.
const (
	relayFresh = 0.75
	collided   = 0.25
)

// scrape scrapes the engine every ScrapeInterval until ctx ends, sending
// the usable results on out, and with Config.Relay handing them to it. A
// turn at which another replica's report came within relayFresh of the
// interval is skipped (the applier has that report). Replicas whose turns
// fall within a relay's time of each other would each scrape at every
// turn: one that sees another's report come just after its own scrape
// waits up to half an interval more, at random, before its next turn,
// and keeps that phase, so that one of the two turns comes first.
//
// With more engines than the Watcher's ScrapesPerSecond allows at their
// intervals, the interval stretches (Watcher.scrapeInterval): it is
// computed anew after each scrape, so it follows the fleet's size.
func (e *engine) scrape(ctx context.Context, out chan vllm.Metrics) {
	e.w.scraping.Add(1)
	defer e.w.scraping.Add(-1)
	every := e.w.scrapeInterval(e.cfg.ScrapeInterval)
	e.st.interval.Store(int64(every))
	t := time.NewTicker(every)
	defer t.Stop()
	relay := e.w.cfg.Relay
	var last string // the problem last logged
	var mine int64  // when this replica last scraped, Unix nanoseconds
	for {
		start := time.Now()
		now := start.UnixNano()
		if relay != nil && now-e.relayedAt.Load() < int64(relayFresh*float64(every)) {
			e.st.skipped.Add(1)
			e.w.turn(now, false)
		} else {
			e.w.turn(now, true)
			mine = now
			if m, ok := e.scrapeOnce(ctx, &last); ok {
				offer(out, m)
				if relay != nil {
					relay(e.name, start, m)
				}
			}
			if ctx.Err() != nil {
				return
			}
		}
		if d := e.w.scrapeInterval(e.cfg.ScrapeInterval); d != every {
			every = d
			e.st.interval.Store(int64(every))
			t.Reset(every)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if r := e.relayedAt.Load(); relay != nil && r > mine && r-mine < int64(collided*float64(every)) {
			select {
			case <-ctx.Done():
				return
			case <-time.After(rand.N(max(every/2, 1))):
			}
			t.Reset(every)
		}
	}
}

// scrapeOnce scrapes the engine once, counting the outcome and logging a
// new problem (last is the one logged before), and returns what may be
// applied: the metrics when the scrape succeeded or read some of them.
func (e *engine) scrapeOnce(ctx context.Context, last *string) (vllm.Metrics, bool) {
	sctx, cancel := context.WithTimeout(ctx, e.cfg.ScrapeTimeout)
	m, err := e.cfg.Metrics.Scrape(sctx)
	cancel()
	if ctx.Err() != nil {
		return m, false
	}
	switch {
	case err == nil:
		e.st.ok.Add(1)
		if *last != "" {
			e.cfg.Logger.Info("engine metrics usable again", "worker", e.name)
			*last = ""
		}
	case errors.Is(err, vllm.ErrGarbage):
		e.st.garbage.Add(1)
	default:
		e.st.failed.Add(1)
	}
	if err != nil && err.Error() != *last {
		*last = err.Error()
		e.cfg.Logger.Warn("engine metrics unusable; keeping the last load", "worker", e.name, "err", err)
	}
	return m, err == nil || m.HasLoad || m.BlockSize > 0
}

// relayed takes another replica's report of the engine's load: applied
// on the caller's goroutine when the engine's lock is free (reports come
// a batch at a time, and waking the engine's goroutine for each would
// cost more than applying it), else left for the engine's goroutine.
func (e *engine) relayed(m vllm.Metrics) {
	e.relayedAt.Store(time.Now().UnixNano())
	e.st.relayed.Add(1)
	select {
	case <-e.ready:
		if e.mu.TryLock() {
			e.scraped(m)
			e.mu.Unlock()
			return
		}
	default:
	}
	offer(e.scrapes, m)
}

// offer leaves m in ch, a channel of one, in place of what it held.
func offer(ch chan vllm.Metrics, m vllm.Metrics) {
	for {
		select {
		case ch <- m:
			return
		default:
		}
		select {
		case <-ch: // drop the stale one
		default:
		}
	}
}

// scraped applies a scrape's block size, load and LoRA adapters.
func (e *engine) scraped(m vllm.Metrics) {
	if m.HasLoRA && e.cfg.OnAdapters != nil {
		e.cfg.OnAdapters(m.Adapters, m.MaxLoRAs)
	}
	if m.BlockSize > 0 && m.BlockSize != e.metricsBS {
		e.metricsBS = m.BlockSize
		e.setInfo()
	}
	if !m.HasLoad {
		return
	}
	used, total := m.Blocks(e.blockSize)
	e.load = kvindex.Load{Running: m.Running, Waiting: m.Waiting, GPUBlocksUsed: used, GPUBlocksTotal: total, Slots: m.Slots}
	l := e.load
	e.apply(kvindex.Event{Load: &l})
}

// message applies a subscriber's message: its batch's events, translated,
// or a reset.
func (e *engine) message(m kvevents.Message) {
	model := e.cfg.Model()
	switch {
	case e.tr == nil:
		e.tr = NewTranslator(TranslatorConfig{Model: model})
		e.st.tr.Store(e.tr)
	case model != "" && model != e.tr.Model():
		// The model was not known when the first events came (a worker
		// that had not described itself yet), or the engine now serves
		// another: what was keyed without it matches no request.
		e.cfg.Logger.Info("engine's events now keyed by its model", "worker", e.name, "model", model, "was", e.tr.Model())
		e.applyEvents([]kvindex.Event{e.tr.SetModel(model)})
	}
	if m.Reset {
		e.applyEvents([]kvindex.Event{e.tr.Reset()})
	} else {
		e.applyEvents(e.tr.Translate(m.Batch))
		m.Release()
	}
	if e.cfg.BlockSize == 0 && e.metricsBS == 0 && e.tr.BlockSize() > 0 && e.tr.BlockSize() != e.blockSize {
		e.setInfo()
	}
}

// applyEvents applies translated events in order; a snapshot among them
// carries the engine's latest load, which it replaces too.
func (e *engine) applyEvents(evs []kvindex.Event) {
	for _, ev := range evs {
		if ev.Snapshot != nil {
			ev.Snapshot.Load = e.load
		}
		e.apply(ev)
	}
}

// apply numbers ev in the engine's own sequence (load reports and
// translated events interleave) and applies it.
func (e *engine) apply(ev kvindex.Event) {
	e.seq++
	ev.Seq = e.seq
	e.logIndexErr(e.idx.Apply(e.name, ev))
}

// setInfo gives the index the engine's block size: the configured one,
// else the metrics', else the events', else DefaultBlockSize.
func (e *engine) setInfo() {
	bs := e.cfg.BlockSize
	if bs == 0 {
		bs = e.metricsBS
	}
	if bs == 0 && e.tr != nil {
		bs = e.tr.BlockSize()
	}
	if bs == 0 {
		bs = DefaultBlockSize
	}
	e.blockSize = bs
	info := kvindex.Info{BlockTokens: bs}
	if e.cfg.Cost != nil {
		info.Cost, info.HasCost = e.cfg.Cost()
	}
	e.logIndexErr(e.idx.SetInfo(e.name, info))
}

func (e *engine) logIndexErr(err error) {
	switch {
	case err == nil:
		e.lastErr = ""
	case err.Error() != e.lastErr:
		e.lastErr = err.Error()
		e.cfg.Logger.Warn("engine not indexed; kv_aware treats it as holding nothing", "worker", e.name, "err", err)
	}
}
