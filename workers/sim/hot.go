package sim

import (
	"context"
	"time"

	"github.com/batonllm/baton/transfer"
)

// The engine's side of fleet-wide prefix popularity, kept in the shared
// tier (transfer.HotTracker): recording the prefixes it reuses, keeping
// their blocks in the tier, and the start-up warm-up that reads them back.

const (
	// hotQueue bounds the touches waiting for the toucher; more are
	// dropped (and counted), which only samples the popularity.
	hotQueue = 256
	// hotRewrite is how often, at most, the blocks of one hot prefix are
	// written to the shared tier again (refreshing their TTL there).
	hotRewrite = 10 * time.Minute
	// hotWrittenMax bounds the prefixes whose last write is remembered.
	hotWrittenMax = 4096
	// warmupTimeout bounds the whole start-up warm-up, in real time.
	warmupTimeout = 10 * time.Second
)

// hotTouch is one use of a reused prefix: its chain, leading block first.
type hotTouch struct {
	ns   transfer.Namespace
	keys []uint64 // a prefix of a seq's keys, never modified
}

// touch hands one use of the prefix keys to the toucher without blocking:
// when its queue is full the use is dropped and counted. Step loop.
func (e *Engine) touch(ns transfer.Namespace, keys []uint64) {
	if e.hot == nil {
		return
	}
	select {
	case e.touches <- hotTouch{ns, keys}:
	default:
		e.statsMu.Lock()
		e.stats.HotTouchDropped++
		e.statsMu.Unlock()
	}
}

// toucher records queued uses in the tracker, one Touch each bounded by
// Config.Tiers.StoreTimeout, and queues the blocks of each prefix it
// touches for writing to the shared tier, at most once per hotRewrite: a
// prefix reused here stays local (with StorePolicy "demotion" it would
// never be written), yet a worker that joins can only warm what the tier
// holds.
func (e *Engine) toucher() {
	defer e.wg.Done()
	written := make(map[string]time.Time)
	for {
		var t hotTouch
		select {
		case t = <-e.touches:
		case <-e.quit:
			return
		}
		ctx, cancel := context.WithTimeout(e.ctx, e.cfg.Tiers.StoreTimeout)
		err := e.hot.Touch(ctx, t.ns, t.keys)
		cancel()
		e.statsMu.Lock()
		if err != nil {
			e.stats.HotTouchErrors++
		} else {
			e.stats.HotTouches++
		}
		e.statsMu.Unlock()

		keys := t.keys[:min(len(t.keys), transfer.MaxHotChain)]
		id := transfer.HotID(t.ns, keys[len(keys)-1])
		if last, ok := written[id]; ok && time.Since(last) < hotRewrite {
			continue
		}
		if len(written) >= hotWrittenMax {
			clear(written)
		}
		written[id] = time.Now()
		for _, k := range keys {
			e.queueWrite(t.ns, k)
		}
		e.statsMu.Lock()
		e.stats.HotWriteBlocks += uint64(len(keys))
		e.statsMu.Unlock()
	}
}

// WarmupDone is closed when the start-up warm-up has ended: at once
// without one, else when its prefixes are warmed, it fails, it times out
// (warmupTimeout) or the engine closes.
func (e *Engine) WarmupDone() <-chan struct{} { return e.warmDone }

// warmup is the start-up warm-up (Config.Warmup.TopK). It lists the
// prefixes to warm, hottest first, with Config.Warmup.Keys if given, else
// from the shared tier's tracker (the TopK hottest of each model
// served), then warms them coldest first, so that the hottest are the
// most recently used should they not all fit. The whole is bounded by
// warmupTimeout; errors only cost the warm-up.
func (e *Engine) warmup() {
	defer e.wg.Done()
	defer close(e.warmDone)
	ctx, cancel := context.WithTimeout(e.ctx, warmupTimeout)
	defer cancel()
	var prefixes []transfer.HotPrefix
	if e.cfg.Warmup.Keys != nil {
		spaces, keys, err := e.cfg.Warmup.Keys(ctx)
		if err != nil {
			return
		}
		for i := 0; i < len(spaces) && i < len(keys) && i < e.cfg.Warmup.TopK; i++ {
			prefixes = append(prefixes, transfer.HotPrefix{NS: spaces[i], Keys: keys[i]})
		}
	} else {
		for _, m := range e.cfg.Models {
			hs, err := e.hot.Hottest(ctx, m, e.cfg.Warmup.TopK)
			if err != nil {
				continue
			}
			prefixes = append(prefixes, hs...)
		}
	}
	e.statsMu.Lock()
	e.stats.WarmupPrefixes += uint64(len(prefixes))
	e.statsMu.Unlock()
	for i := len(prefixes) - 1; i >= 0; i-- {
		p := prefixes[i]
		wctx, wcancel := context.WithTimeout(ctx, storeWriteFactor*e.cfg.Tiers.StoreTimeout)
		n, err := e.Warm(wctx, p.NS, p.Keys)
		wcancel()
		if ctx.Err() != nil {
			return
		}
		if err == nil && (n > 0 || len(p.Keys) > 0 && e.cache.Lookup(p.Keys) == len(p.Keys)) {
			e.statsMu.Lock()
			e.stats.WarmedPrefixes++
			e.statsMu.Unlock()
		}
	}
}
