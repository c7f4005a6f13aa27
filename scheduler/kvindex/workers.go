package kvindex

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// Per-worker state: what a worker's stream and the routed requests tell of
// it besides its blocks (its load, pending prefill, cost figures,
// correction and recent traffic), each worker under its own lock, so that
// a load report, a prediction's bookkeeping or a first token's correction
// never waits for the block table nor holds it. What Lookup reads of it is
// published to atomics besides (see published): a decision over a
// thousand workers takes none of their locks.

// worker is one indexed worker. name, grp and slot are fixed; mu guards
// the fields after it, but pub, correction and the atomics, which are
// read without it.
type worker struct {
	// What Lookup reads comes first, in as few cache lines as it takes.
	name       string
	grp        *group
	slot       int                            // in grp
	correction atomic.Pointer[correctionSums] // set by observe
	pub        published                      // written under mu

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

	corrMu sync.Mutex // serializes ObserveTTFT's updates

	// mayHold is set once the worker may hold a block in the table (an
	// event or a prediction put it there): until then its snapshot need
	// not scan the table for its bits.
	mayHold atomic.Bool

	// isLearned is set once, by Learn; lrn is guarded by the block
	// table's lock.
	isLearned atomic.Bool
	lrn       *learned
}

// mayHeld records that the worker may hold a block in the table (see
// mayHold), writing the flag only the first time: lookups read the
// worker's cache line.
func (w *worker) mayHeld() {
	if !w.mayHold.Load() {
		w.mayHold.Store(true)
	}
}

// learning reports whether the worker's blocks are learned (see
// Index.Learn).
func (w *worker) learning() bool { return w.isLearned.Load() }

func newWorker(name string, g *group, slot int) *worker {
	w := &worker{name: name, grp: g, slot: slot, cost: DefaultCost, blockTokens: defaultBlockTokens}
	w.pub.info.Store(&defaultInfo)
	return w
}

// published is the worker state Lookup reads, copied from the fields mu
// guards whenever they change: a sequence lock, whose writers hold mu and
// whose readers retry a read that overlapped a write (and, should a
// writer stall mid-write, wait for mu). Every field is an atomic, so a
// read never races with a write; the sequence makes the fields it
// returns those of one moment.
type published struct {
	seq                atomic.Uint64 // odd while a write is under way
	load               [loadFields]atomic.Int64
	pending, pendingAt atomic.Int64
	routed             atomic.Uint64 // float64 bits
	routedAt           atomic.Int64
	info               atomic.Pointer[workerInfo] // replaced, never changed
}

// workerInfo is what a worker's Info sets of its state.
type workerInfo struct {
	cost        Cost
	hasCost     bool
	blockTokens int
}

var defaultInfo = workerInfo{cost: DefaultCost, blockTokens: defaultBlockTokens}

// interned keeps one copy of each workerInfo the workers told, so that a
// fleet of alike workers (the usual one) shares one, which a decision
// over all of them reads from one place rather than from each worker's.
type interned struct {
	mu sync.Mutex
	m  map[workerInfo]*workerInfo
}

// maxInterned bounds interned: past it, it starts over (only sharing is
// lost), so that workers whose figures keep changing do not grow it.
const maxInterned = 4096

func (in *interned) get(v workerInfo) *workerInfo {
	in.mu.Lock()
	defer in.mu.Unlock()
	if p := in.m[v]; p != nil {
		return p
	}
	if in.m == nil || len(in.m) >= maxInterned {
		in.m = make(map[workerInfo]*workerInfo)
	}
	p := &v
	in.m[v] = p
	return p
}

// loadFields is the number of Load's fields.
const loadFields = 8

// publish copies the state Lookup reads into w.pub. w.mu is held.
func (w *worker) publish() {
	p := &w.pub
	p.seq.Add(1)
	l := &w.load
	for i, v := range [loadFields]int64{int64(l.Running), int64(l.Waiting), l.WaitingPrefillTokens,
		l.GPUBlocksUsed, l.GPUBlocksTotal, l.CPUBlocksUsed, l.CPUBlocksTotal, int64(l.Slots)} {
		p.load[i].Store(v)
	}
	p.pending.Store(w.pending)
	p.pendingAt.Store(w.pendingAt)
	p.routed.Store(math.Float64bits(w.routed))
	p.routedAt.Store(w.routedAt)
	p.seq.Add(1)
}

// state is one consistent read of w.pub.
type state struct {
	load                         Load
	pending, pendingAt, routedAt int64
	routed                       float64
}

// read returns w.pub's state, without w.mu unless a write stalls.
func (w *worker) read(s *state) {
	p := &w.pub
	for range 4 {
		seq := p.seq.Load()
		if seq&1 != 0 {
			continue
		}
		s.load = Load{
			Running: int(p.load[0].Load()), Waiting: int(p.load[1].Load()), WaitingPrefillTokens: p.load[2].Load(),
			GPUBlocksUsed: p.load[3].Load(), GPUBlocksTotal: p.load[4].Load(),
			CPUBlocksUsed: p.load[5].Load(), CPUBlocksTotal: p.load[6].Load(), Slots: int(p.load[7].Load()),
		}
		s.pending, s.pendingAt = p.pending.Load(), p.pendingAt.Load()
		s.routed, s.routedAt = math.Float64frombits(p.routed.Load()), p.routedAt.Load()
		if p.seq.Load() == seq {
			return
		}
	}
	// A writer holds mu mid-write (descheduled, or writing again and
	// again): read under it.
	w.mu.Lock()
	*s = state{load: w.load, pending: w.pending, pendingAt: w.pendingAt, routed: w.routed, routedAt: w.routedAt}
	w.mu.Unlock()
}

// bit is the worker's bit in its group's holder masks.
func (w *worker) bit() uint64 { return uint64(1) << w.slot }

// at is the worker's place among every group's slots.
func (w *worker) at() place { return place(w.grp.id*MaxWorkers + w.slot) }

// holder is the worker in the block table's holder sets.
func (w *worker) holder() holder { return holder{grp: uint8(w.grp.id), bit: w.bit()} }

// routedNow returns w.routed decayed to now. w.mu is held.
func (w *worker) routedNow(now int64, halfLife time.Duration) float64 {
	if w.routed == 0 {
		return 0
	}
	return w.routed * decay(w.routedAt, now, halfLife)
}

// setInfo records what the worker told of itself; its published copy is
// in's, shared with every worker that told the same. ws.mu is held for
// reading, so that the worker's Redis bit is not set in a slot another
// worker took since.
func (w *worker) setInfo(info Info, in *interned, ws *workers) {
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
	w.pub.info.Store(in.get(workerInfo{cost: w.cost, hasCost: w.hasCost, blockTokens: w.blockTokens}))
	if !ws.owns(w) {
		return
	}
	if info.RedisTier {
		w.grp.redis.Or(w.bit())
	} else {
		w.grp.redis.And(^w.bit())
	}
}

// setLoad records a load report at now. w.mu is held.
func (w *worker) setLoad(l Load, now int64) {
	w.load = l
	// The report counts what was routed to the worker before it; the
	// pending tokens of requests routed since are approximated as counted.
	w.pending, w.pendingAt = 0, now
	w.pendingGen++
	w.publish()
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
	w.publish()
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
		w.publish()
	}
}

// prefilled takes tokens off the worker's pending tokens.
func (w *worker) prefilled(tokens int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pending = max(w.pending-int64(tokens), 0)
	w.publish()
}

// match fills m with the worker's state at now (all but the block
// counts), without its lock.
func (w *worker) match(m *Match, now int64, cfg *Config) {
	var s state
	w.read(&s)
	info := w.pub.info.Load()
	m.Known, m.GPU, m.CPU, m.Redis = true, 0, 0, 0
	m.Load, m.PendingTokens = s.load, 0
	if now-s.pendingAt < int64(cfg.PredictTTL) {
		m.PendingTokens = s.pending
	}
	m.Cost, m.HasCost, m.BlockTokens = info.cost, info.hasCost, info.blockTokens
	m.Correction, m.Routed = 1, 0
	if c := w.correction.Load(); c != nil {
		m.Correction = c.factor(now)
	}
	if s.routed != 0 {
		m.Routed = s.routed * decay(s.routedAt, now, cfg.RoutedHalfLife)
	}
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

// group is MaxWorkers worker slots, whose workers' bits make up one
// 64-bit holder mask in the block table. A fleet larger than MaxWorkers
// takes several groups; a block held in several has a mask for each (see
// entry). What a lookup reads of the slots sits in arrays of the group,
// so that a lookup over many workers reads a few contiguous bytes of each
// rather than the scattered workers.
type group struct {
	id    int                 // in workers.groups
	slots [MaxWorkers]*worker // guarded by workers.mu
	names [MaxWorkers]string  // the slots' workers' names, which lookups read; guarded by workers.mu
	n     int                 // slots in use; guarded by workers.mu
	used  uint64              // their bits (but retired workers'); guarded by workers.mu
	redis atomic.Uint64       // the bits of the workers that read the Redis tier (Info.RedisTier)
}

// place is a worker's slot among every group's: the group's id times
// MaxWorkers plus the slot.
type place uint16

// noPlace is no worker's place.
const noPlace = ^place(0)

// workers is the index's membership: which worker holds which slot of
// which group, whose bit it is in the group's holder masks.
// It changes when a worker joins or leaves, rarely; readers hold mu's read
// lock for as long as they use a slot, so that a slot is not reused under
// them.
type workers struct {
	mu     sync.RWMutex
	byName map[string]*worker
	groups []*group // never shrinks
	n      int      // workers tracked

	// hints remembers the place of the worker last found under a name's
	// bytes, by their address: callers pass the same strings request
	// after request (the pool's worker names), and a hint costs a load
	// where the map hashes the name. See hintTable.
	hints *hintTable
}

// hintTable is the workers' hints, each a name's bytes' address (its low
// 48 bits) and a place: hintWays of them share a cache line, any of
// which a name may take, so that names whose addresses hash alike do not
// evict one another. Readers set hints under the read lock. A hint may
// outlive its worker's removal, or name another string at the address,
// which check sees.
type hintTable [1 << hintBits]atomic.Uint64

const (
	hintBits = 12
	hintWays = 8         // a cache line's worth of hints
	hintSet  = 1 << 15   // a hint is set
	hintAddr = 1<<48 - 1 // the address bits a hint keeps
	hintMix  = 0x9e3779b97f4a7c15
)

// maxGroups bounds the groups, and so the workers tracked (MaxTracked).
const maxGroups = MaxTracked / MaxWorkers

// newGroup adds an empty group. ws.mu is held for writing.
func (ws *workers) newGroup() *group {
	g := &group{id: len(ws.groups)}
	ws.groups = append(ws.groups, g)
	return g
}

// get returns name's state, nil if untracked. w.mu is held.
func (ws *workers) get(name string) *worker { return ws.byName[name] }

// owns reports whether w holds its slot: it was not removed. ws.mu is
// held.
func (ws *workers) owns(w *worker) bool { return w.grp.slots[w.slot] == w }

// hintLine returns the hints a name whose bytes are at addr may take,
// and the one it takes first.
func (ws *workers) hintLine(addr uint64) (line []atomic.Uint64, first int) {
	i := int((addr * hintMix) >> (64 - hintBits))
	return ws.hints[i&^(hintWays-1):][:hintWays], i & (hintWays - 1)
}

// hint returns the place last found under name's bytes, which may not
// be name's worker's (see check), or noPlace. ws.mu is held.
func (ws *workers) hint(name string) place {
	addr := uint64(uintptr(unsafe.Pointer(unsafe.StringData(name)))) & hintAddr
	line, _ := ws.hintLine(addr)
	for k := range line {
		if h := line[k].Load(); h>>16 == addr && h&hintSet != 0 {
			return place(h & (hintSet - 1))
		}
	}
	return noPlace
}

// check returns p if name's worker holds it, else the place of name's
// worker from the map (noPlace if untracked), which becomes name's hint.
// It reads the group's arrays, not the worker. ws.mu is held.
func (ws *workers) check(p place, name string) place {
	if p != noPlace {
		g, s := ws.groups[p/MaxWorkers], p%MaxWorkers
		if g.used&(1<<s) != 0 && g.names[s] == name {
			return p
		}
	}
	w := ws.byName[name]
	if w == nil {
		return noPlace
	}
	p = w.at()
	addr := uint64(uintptr(unsafe.Pointer(unsafe.StringData(name)))) & hintAddr
	line, k := ws.hintLine(addr)
	// The hint with name's address if any, else a free one, else k.
	for j := range line {
		if h := line[j].Load(); h>>16 == addr || h == 0 {
			k = j
			if h != 0 {
				break
			}
		}
	}
	line[k].Store(addr<<16 | hintSet | uint64(p))
	return p
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
			g.slots[i], g.names[i] = w, name
			g.n++
			g.used |= w.bit()
			g.redis.And(^w.bit())
			ws.byName[name] = w
			ws.n++
			return w, nil
		}
	}
	panic("kvindex: group with a free slot has none")
}

// retire takes w out of the tracked workers (its name, its bit in the
// group's live workers) but keeps its slot taken, by retiredSlot, until
// release: its bits may still be in the block table. ws.mu is held for
// writing.
func (ws *workers) retire(w *worker) {
	delete(ws.byName, w.name)
	w.grp.slots[w.slot], w.grp.names[w.slot] = retiredSlot, ""
	w.grp.used &^= w.bit()
	ws.n--
}

// release frees the slot of w, retired, once none of the block table's
// entries holds its bits. ws.mu is held for writing.
func (ws *workers) release(w *worker) {
	w.grp.slots[w.slot] = nil
	w.grp.n--
}

// retiredSlot takes the slot of a worker being removed.
var retiredSlot = &worker{}
