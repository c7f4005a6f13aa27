package sim

import (
	"errors"
	"slices"
	"sync"
	"time"
)

// ErrSlowSubscriber ends a Subscription whose reader fell more than
// Config.WatchBuffer events behind; it should resubscribe.
var ErrSlowSubscriber = errors.New("watch subscriber too slow")

// WatchEvent is one event of a Subscription: exactly one of Snapshot,
// Load and Cache is set. Seq is 1 for the snapshot and increases by one
// per event of the subscription. Adapters, with Load, are the LoRA
// adapters the engine holds then (nil when it serves none).
type WatchEvent struct {
	Seq      uint64
	Snapshot *Snapshot
	Load     *Load
	Cache    *CacheEvent
	Adapters []string
}

// Snapshot is the state a subscription starts from: the load and every
// block of the GPU tier (Keys) and of the CPU tier (CPUKeys). Events that
// follow apply to it. What the shared (Redis) tier holds is not part of
// it: the worker only knows the blocks it wrote or found missing, which
// it announces as events (tier Redis) when it learns of them.
type Snapshot struct {
	Load    Load
	Keys    []uint64
	CPUKeys []uint64
	// Adapters are the LoRA adapters the engine holds (nil when it serves
	// none).
	Adapters []string
}

// Subscription streams an engine's load reports and cache events. C is
// closed when the subscription ends (Close, engine closed, or the reader
// fell behind); Err then says why.
type Subscription struct {
	C <-chan WatchEvent

	h   *hub
	ch  chan WatchEvent
	seq uint64 // guarded by h.mu
	err error  // guarded by h.mu
}

// Err returns why C was closed: ErrClosed, ErrSlowSubscriber, or nil after
// Close.
func (s *Subscription) Err() error {
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	return s.err
}

// Close ends the subscription. It is idempotent.
func (s *Subscription) Close() { s.h.drop(s, nil) }

// Subscribe starts a subscription whose first event is a snapshot
// consistent with the events that follow. The subscription must not block
// the engine: a reader that falls behind by Config.WatchBuffer events is
// dropped (C closed, Err ErrSlowSubscriber).
func (e *Engine) Subscribe() (*Subscription, error) {
	var (
		sub *Subscription
		err error
	)
	e.cache.Snapshot(func(keys, cpu []uint64, used int64) {
		snap := &Snapshot{
			Load: Load{
				Running:     int(e.running.Load()),
				Waiting:     int(e.waiting.Load()),
				BlocksUsed:  used,
				BlocksTotal: e.cache.Capacity(),

				CPUBlocksUsed:        int64(len(cpu)),
				CPUBlocksTotal:       e.cache.CPUCapacity(),
				WaitingPrefillTokens: e.batch.WaitingPrefill(),
			},
			Keys:     append([]uint64(nil), keys...),
			CPUKeys:  append([]uint64(nil), cpu...),
			Adapters: e.reportedAdapters(),
		}
		sub, err = e.hub.add(snap)
	})
	return sub, err
}

// hub fans events out to subscriptions. Cache events are published with
// the cache's lock held (lock order: cache, then hub).
type hub struct {
	mu     sync.Mutex
	buf    int
	subs   map[*Subscription]struct{}
	closed error
}

func (h *hub) init(buf int) {
	h.buf = buf
	h.subs = make(map[*Subscription]struct{})
}

func (h *hub) add(snap *Snapshot) (*Subscription, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed != nil {
		return nil, h.closed
	}
	ch := make(chan WatchEvent, h.buf)
	s := &Subscription{C: ch, h: h, ch: ch, seq: 1}
	ch <- WatchEvent{Seq: 1, Snapshot: snap}
	h.subs[s] = struct{}{}
	return s, nil
}

func (h *hub) publishCache(ev CacheEvent) {
	h.publish(WatchEvent{Cache: &ev})
}

func (h *hub) publishLoad(l Load, adapters []string) {
	h.publish(WatchEvent{Load: &l, Adapters: adapters})
}

func (h *hub) publish(ev WatchEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		s.seq++
		ev.Seq = s.seq
		select {
		case s.ch <- ev:
		default:
			h.dropLocked(s, ErrSlowSubscriber)
		}
	}
}

func (h *hub) drop(s *Subscription, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.dropLocked(s, err)
}

func (h *hub) dropLocked(s *Subscription, err error) {
	if _, ok := h.subs[s]; !ok {
		return
	}
	delete(h.subs, s)
	s.err = err
	close(s.ch)
}

// close ends every subscription with err and refuses new ones.
func (h *hub) close(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = err
	for s := range h.subs {
		h.dropLocked(s, err)
	}
}

// reportLoad publishes the load every LoadInterval of real time when it,
// or the adapters the engine holds, changed, until Close.
func (e *Engine) reportLoad() {
	defer e.wg.Done()
	t := time.NewTicker(e.cfg.LoadInterval)
	defer t.Stop()
	var (
		last      Load
		lastLoRAs []string
	)
	for {
		select {
		case <-t.C:
			l, a := e.Load(), e.reportedAdapters()
			if l != last || !slices.Equal(a, lastLoRAs) {
				last, lastLoRAs = l, a
				e.hub.publishLoad(l, a)
			}
		case <-e.quit:
			return
		}
	}
}
