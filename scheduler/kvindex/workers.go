package kvindex

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// Per-worker state: what a worker's stream and the routed requests tell of
// it besides its blocks (its load, pending prefill, cost figures,
// correction and recent traffic), each worker under its own lock, so that
// a load report, a prediction's bookkeeping or a first token's correction
// never waits for the block table nor holds it.

// worker is one indexed worker. name and slot are fixed; mu guards the
// fields after it, but correction, which is read without it.
type worker struct {
	name string
	slot int

	mu          sync.Mutex
	synced      bool   // a snapshot was applied, and no gap seen since
	lastSeq     uint64 // of the last event applied
	load        Load
	pending     int64  // prompt tokens routed by Predict since pendingAt
	pendingAt   int64  // Unix nanoseconds: the last load report, or the first Predict after PredictTTL
	pendingGen  uint64 // counts the resets of pending
	cost        Cost
	hasCost     bool
	blockTokens int
	routed      float64 // Match.Routed as of routedAt
	routedAt    int64   // Unix nanoseconds

	redisTier atomic.Bool // set by setInfo; read without mu by Lookup

	corrMu     sync.Mutex                     // serializes ObserveTTFT's updates
	correction atomic.Pointer[correctionSums] // read by Lookup

	// isLearned is set once, by Learn; lrn is guarded by the block
	// table's lock.
	isLearned atomic.Bool
	lrn       *learned
}

// learning reports whether the worker's blocks are learned (see
// Index.Learn).
func (w *worker) learning() bool { return w.isLearned.Load() }

func newWorker(name string, slot int) *worker {
	return &worker{name: name, slot: slot, cost: DefaultCost, blockTokens: defaultBlockTokens}
}

// routedNow returns w.routed decayed to now. w.mu is held.
func (w *worker) routedNow(now int64, halfLife time.Duration) float64 {
	if w.routed == 0 {
		return 0
	}
	return w.routed * decay(w.routedAt, now, halfLife)
}

// setInfo records what the worker told of itself.
func (w *worker) setInfo(info Info) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cost, w.hasCost = DefaultCost, info.HasCost
	if info.HasCost {
		w.cost = info.Cost
	}
	w.blockTokens = defaultBlockTokens
	if info.BlockTokens > 0 {
		w.blockTokens = info.BlockTokens
	}
	w.redisTier.Store(info.RedisTier)
}

// setLoad records a load report at now. w.mu is held.
func (w *worker) setLoad(l Load, now int64) {
	w.load = l
	// The report counts what was routed to the worker before it; the
	// pending tokens of requests routed since are approximated as counted.
	w.pending, w.pendingAt = 0, now
	w.pendingGen++
}

// predicted counts a routed request whose prefill adds blocks new blocks
// to the worker's pending tokens and its Routed. It returns the pending
// tokens' generation, for held.
func (w *worker) predicted(blocks int64, now int64, cfg *Config) (gen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now-w.pendingAt >= int64(cfg.PredictTTL) {
		w.pending, w.pendingAt = 0, now
		w.pendingGen++
	}
	w.pending += blocks * int64(w.blockTokens)
	w.routed, w.routedAt = w.routedNow(now, cfg.RoutedHalfLife)+1, now
	return w.pendingGen
}

// held takes off the pending tokens blocks that predicted counted and the
// worker turned out to hold, unless the pending tokens were reset since
// (generation gen): a load report counts the request's actual prefill.
func (w *worker) held(blocks int64, gen uint64) {
	if blocks <= 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pendingGen == gen {
		w.pending = max(w.pending-blocks*int64(w.blockTokens), 0)
	}
}

// prefilled takes tokens off the worker's pending tokens.
func (w *worker) prefilled(tokens int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pending = max(w.pending-int64(tokens), 0)
}

// match fills m with the worker's state at now (all but the block counts).
func (w *worker) match(m *Match, now int64, cfg *Config) {
	w.mu.Lock()
	pending := w.pending
	if now-w.pendingAt >= int64(cfg.PredictTTL) {
		pending = 0
	}
	*m = Match{
		Known:         true,
		Load:          w.load,
		PendingTokens: pending,
		Cost:          w.cost,
		HasCost:       w.hasCost,
		BlockTokens:   w.blockTokens,
		Routed:        w.routedNow(now, cfg.RoutedHalfLife),
	}
	w.mu.Unlock()
	m.Correction = w.correction.Load().factor(now)
}

// observe feeds the correction factor with one request's predicted and
// achieved seconds (see Index.ObserveTTFT).
func (w *worker) observe(p, a float64, now int64) {
	w.mu.Lock()
	step := w.cost.DecodeStepSeconds
	w.mu.Unlock()
	if p < minObservedSteps*step {
		return
	}
	w.corrMu.Lock()
	defer w.corrMu.Unlock()
	next := &correctionSums{achieved: a, predicted: p, at: now}
	if old := w.correction.Load(); old != nil {
		f := decay(old.at, now, correctionHalfLife)
		next.achieved += old.achieved * f
		next.predicted += old.predicted * f
	}
	w.correction.Store(next)
}

// workers is the index's membership: which worker holds which of the
// MaxWorkers slots, whose bit it is in the block table's holder masks.
// It changes when a worker joins or leaves, rarely; readers hold mu's read
// lock for as long as they use a slot, so that a slot is not reused under
// them.
type workers struct {
	mu     sync.RWMutex
	byName map[string]*worker
	slots  [MaxWorkers]*worker

	// hints remembers the worker last found under a name's bytes, indexed
	// by their address: callers pass the same strings request after
	// request (the pool's worker names), and a hint costs a few loads
	// where the map hashes the name. Readers set them under the read lock.
	// A hint may outlive its worker's removal, which find checks.
	hints [1 << hintBits]atomic.Pointer[worker]
}

const hintBits = 8

// get returns name's state, nil if untracked. w.mu is held.
func (ws *workers) get(name string) *worker { return ws.byName[name] }

// find is get, trying name's hint first. A hint counts only if its worker
// still holds its slot (RemoveWorker frees it) and has that name, so it
// returns what get would. ws.mu is held.
func (ws *workers) find(name string) *worker {
	h := &ws.hints[(uint64(uintptr(unsafe.Pointer(unsafe.StringData(name))))*0x9e3779b97f4a7c15)>>(64-hintBits)]
	if w := h.Load(); w != nil && ws.slots[w.slot] == w && w.name == name {
		return w
	}
	w := ws.byName[name]
	if w != nil {
		h.Store(w)
	}
	return w
}

// add returns name's state, creating it in a free slot if needed. ws.mu
// is held for writing.
func (ws *workers) add(name string) (*worker, error) {
	if w := ws.byName[name]; w != nil {
		return w, nil
	}
	for i, w := range ws.slots {
		if w == nil {
			w = newWorker(name, i)
			ws.slots[i] = w
			ws.byName[name] = w
			return w, nil
		}
	}
	return nil, fmt.Errorf("worker %s: %w (%d)", name, ErrTooManyWorkers, MaxWorkers)
}

// remove frees w's slot. ws.mu is held for writing.
func (ws *workers) remove(w *worker) {
	delete(ws.byName, w.name)
	ws.slots[w.slot] = nil
}
