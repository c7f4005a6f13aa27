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

// worker is one indexed worker. name, grp and slot are fixed; mu guards
// the fields after it, but correction, which is read without it.
type worker struct {
	name string
	grp  *group
	slot int // in grp

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

func newWorker(name string, g *group, slot int) *worker {
	return &worker{name: name, grp: g, slot: slot, cost: DefaultCost, blockTokens: defaultBlockTokens}
}

// bit is the worker's bit in its group's holder masks.
func (w *worker) bit() uint64 { return uint64(1) << w.slot }

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
	w.routed, w.routedAt = w.routedNow(now, cfg.RoutedHalfLife)+1, now
	return w.addPendingLocked(blocks, now, cfg)
}

// addPending adds blocks' tokens to the worker's pending prefill, as
// predicted does, without counting a request routed here.
func (w *worker) addPending(blocks int64, now int64, cfg *Config) (gen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.addPendingLocked(blocks, now, cfg)
}

func (w *worker) addPendingLocked(blocks int64, now int64, cfg *Config) (gen uint64) {
	if now-w.pendingAt >= int64(cfg.PredictTTL) {
		w.pending, w.pendingAt = 0, now
		w.pendingGen++
	}
	w.pending += blocks * int64(w.blockTokens)
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

// group is MaxWorkers worker slots and the block table of their blocks,
// whose holder masks have one bit per slot. A fleet larger than
// MaxWorkers takes several groups: a block held by workers of several
// groups has an entry in each group's table, and the groups' tables lock,
// fill and evict apart, so that events of workers of different groups
// never wait for one another.
type group struct {
	blocks blocks
	slots  [MaxWorkers]*worker // guarded by workers.mu
	n      int                 // slots in use; guarded by workers.mu
}

// workers is the index's membership: which worker holds which slot of
// which group, whose bit it is in the group's block table's holder masks.
// It changes when a worker joins or leaves, rarely; readers hold mu's read
// lock for as long as they use a slot, so that a slot is not reused under
// them.
type workers struct {
	mu        sync.RWMutex
	byName    map[string]*worker
	groups    []*group // never shrinks: a group's table outlives its workers
	n         int      // workers tracked
	maxBlocks int      // Config.MaxBlocks, shared out among the groups

	// hints remembers the worker last found under a name's bytes, indexed
	// by their address: callers pass the same strings request after
	// request (the pool's worker names), and a hint costs a few loads
	// where the map hashes the name. Readers set them under the read lock.
	// A hint may outlive its worker's removal, which find checks.
	hints [1 << hintBits]atomic.Pointer[worker]
}

const hintBits = 12

// maxGroups bounds the groups, and so the workers tracked (MaxTracked).
const maxGroups = MaxTracked / MaxWorkers

// newGroup adds an empty group. ws.mu is held for writing.
func (ws *workers) newGroup() *group {
	g := &group{}
	g.blocks.init(ws.maxBlocks)
	ws.groups = append(ws.groups, g)
	return g
}

// get returns name's state, nil if untracked. w.mu is held.
func (ws *workers) get(name string) *worker { return ws.byName[name] }

// find is get, trying name's hint first. A hint counts only if its worker
// still holds its slot (RemoveWorker frees it) and has that name, so it
// returns what get would. ws.mu is held.
func (ws *workers) find(name string) *worker {
	h := &ws.hints[(uint64(uintptr(unsafe.Pointer(unsafe.StringData(name))))*0x9e3779b97f4a7c15)>>(64-hintBits)]
	if w := h.Load(); w != nil && w.grp.slots[w.slot] == w && w.name == name {
		return w
	}
	w := ws.byName[name]
	if w != nil {
		h.Store(w)
	}
	return w
}

// add returns name's state, creating it in a free slot if needed: of the
// first group with one, or of a new group. ws.mu is held for writing.
func (ws *workers) add(name string) (*worker, error) {
	if w := ws.byName[name]; w != nil {
		return w, nil
	}
	var g *group
	for _, o := range ws.groups {
		if o.n < MaxWorkers {
			g = o
			break
		}
	}
	if g == nil {
		if len(ws.groups) >= maxGroups {
			return nil, fmt.Errorf("worker %s: %w (%d)", name, ErrTooManyWorkers, MaxTracked)
		}
		g = ws.newGroup()
	}
	for i, o := range g.slots {
		if o == nil {
			w := newWorker(name, g, i)
			g.slots[i] = w
			g.n++
			ws.byName[name] = w
			ws.n++
			ws.share()
			return w, nil
		}
	}
	panic("kvindex: group with a free slot has none")
}

// remove frees w's slot. ws.mu is held for writing.
func (ws *workers) remove(w *worker) {
	delete(ws.byName, w.name)
	w.grp.slots[w.slot] = nil
	w.grp.n--
	ws.n--
	ws.share()
}

// share gives each group its share of Config.MaxBlocks, in proportion to
// its workers: one group takes it all. A group above its new share, as
// when workers join other groups, forgets its least recently touched
// blocks down to it. ws.mu is held for writing.
func (ws *workers) share() {
	if len(ws.groups) == 1 {
		return // New's group keeps the whole cap
	}
	for _, g := range ws.groups {
		g.blocks.mu.Lock()
		g.blocks.setMax(max(1, ws.maxBlocks*g.n/max(ws.n, 1)))
		g.blocks.trim()
		g.blocks.mu.Unlock()
	}
}
