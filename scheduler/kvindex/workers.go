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
// published to atomics besides, in its slot's record (see record): a
// decision over a thousand workers takes none of their locks, and reads
// the records of a group one after the other.

// worker is one indexed worker. name, grp and slot are fixed; mu guards
// the fields after it but the atomics.
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
	routed      float64        // Match.Routed as of routedAt
	routedAt    int64          // Unix nanoseconds
	corr        correctionSums // none observed while corr.predicted is 0

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
	return &worker{name: name, grp: g, slot: slot, cost: DefaultCost, blockTokens: defaultBlockTokens}
}

// record is the state Lookup reads of a slot's worker, copied from the
// fields its mu guards whenever they change: a sequence lock, whose
// writers hold mu and workers.mu for reading (so that the slot does not
// change hands under them), and whose readers retry a read that
// overlapped a write (and, should a writer stall mid-write, wait for mu).
// Every field is an atomic, so a read never races with a write; the
// sequence makes the fields it returns those of one moment. A record is
// two cache lines (recordSize), the records of a group contiguous.
type record struct {
	seq                 atomic.Uint64 // odd while a write is under way
	load                [loadFields]atomic.Int64
	pending, pendingAt  atomic.Int64
	routed              atomic.Uint64 // float64 bits
	routedAt            atomic.Int64
	achieved, predicted atomic.Uint64 // the correction's sums (float64 bits)
	correctedAt         atomic.Int64
}

// recordSize is the size of a record, in bytes.
const recordSize = 128

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

// publish copies the state Lookup reads into the worker's record, if it
// still holds its slot. w.mu is held, and workers.mu at least for
// reading.
func (w *worker) publish() {
	if w.grp.slots[w.slot] != w {
		return // removed: the slot's record is no longer its
	}
	r := &w.grp.recs[w.slot]
	r.seq.Add(1)
	l := &w.load
	for i, v := range [loadFields]int64{int64(l.Running), int64(l.Waiting), l.WaitingPrefillTokens,
		l.GPUBlocksUsed, l.GPUBlocksTotal, l.CPUBlocksUsed, l.CPUBlocksTotal, int64(l.Slots)} {
		r.load[i].Store(v)
	}
	r.pending.Store(w.pending)
	r.pendingAt.Store(w.pendingAt)
	r.routed.Store(math.Float64bits(w.routed))
	r.routedAt.Store(w.routedAt)
	r.achieved.Store(math.Float64bits(w.corr.achieved))
	r.predicted.Store(math.Float64bits(w.corr.predicted))
	r.correctedAt.Store(w.corr.at)
	r.seq.Add(1)
}

// read returns the state of slot s's record, its load into l, without
// its worker's mu unless a write stalls. It writes the load field by
// field, as it loads them: a decision reads a record per worker.
// workers.mu is held.
func (g *group) read(s int, l *Load) (pending, pendingAt int64, routed float64, routedAt int64, corr correctionSums) {
	r := &g.recs[s]
	for range 4 {
		seq := r.seq.Load()
		if seq&1 != 0 {
			continue
		}
		l.Running, l.Waiting, l.WaitingPrefillTokens = int(r.load[0].Load()), int(r.load[1].Load()), r.load[2].Load()
		l.GPUBlocksUsed, l.GPUBlocksTotal = r.load[3].Load(), r.load[4].Load()
		l.CPUBlocksUsed, l.CPUBlocksTotal, l.Slots = r.load[5].Load(), r.load[6].Load(), int(r.load[7].Load())
		pending, pendingAt = r.pending.Load(), r.pendingAt.Load()
		routed, routedAt = math.Float64frombits(r.routed.Load()), r.routedAt.Load()
		corr = correctionSums{achieved: math.Float64frombits(r.achieved.Load()),
			predicted: math.Float64frombits(r.predicted.Load()), at: r.correctedAt.Load()}
		if r.seq.Load() == seq {
			return pending, pendingAt, routed, routedAt, corr
		}
	}
	// A writer holds mu mid-write (descheduled, or writing again and
	// again): read under it.
	w := g.slots[s]
	w.mu.Lock()
	defer w.mu.Unlock()
	*l = w.load
	return w.pending, w.pendingAt, w.routed, w.routedAt, w.corr
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
	if !ws.owns(w) {
		return
	}
	w.grp.infos[w.slot].Store(in.get(workerInfo{cost: w.cost, hasCost: w.hasCost, blockTokens: w.blockTokens}))
	if info.RedisTier {
		w.grp.redis.Or(w.bit())
	} else {
		w.grp.redis.And(^w.bit())
	}
}

// setLoad records a load report at now. w.mu is held, and workers.mu
// for reading.
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
// tokens' generation, for held. Like every method that publishes, it is
// called with workers.mu held for reading.
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

// sharedPending adds the prefill of another replica's decision made at
// at, blocks new blocks, to the worker's pending tokens, unless the
// worker reported its load since (the report counts it) or at is
// PredictTTL old. Called with workers.mu held for reading.
func (w *worker) sharedPending(blocks, at, now int64, cfg *Config) {
	if blocks <= 0 || now-at >= int64(cfg.PredictTTL) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if now-w.pendingAt >= int64(cfg.PredictTTL) {
		// The pending tokens lapsed, as addPending would find; the
		// decision is the oldest they count.
		w.pending, w.pendingAt = 0, at
		w.pendingGen++
	}
	if at < w.pendingAt {
		return
	}
	w.pending += blocks * int64(w.blockTokens)
	w.publish()
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

// prefilled takes tokens off the worker's pending tokens. workers.mu is
// held for reading.
func (w *worker) prefilled(tokens int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pending = max(w.pending-int64(tokens), 0)
	w.publish()
}

// match fills m with the state at now of slot s's worker (all but the
// block counts), from its record, without its lock, and returns the
// worker's Info; m's Info fields are left as they are when that is has,
// which m holds already. workers.mu is held.
func (g *group) match(s int, m *Match, now int64, cfg *Config, has *workerInfo) *workerInfo {
	pending, pendingAt, routed, routedAt, corr := g.read(s, &m.Load)
	info := g.infos[s].Load()
	m.Known, m.GPU, m.CPU, m.Redis = true, 0, 0, 0
	m.PendingTokens = 0
	if now-pendingAt < int64(cfg.PredictTTL) {
		m.PendingTokens = pending
	}
	if info != has {
		m.Cost, m.HasCost, m.BlockTokens = info.cost, info.hasCost, info.blockTokens
	}
	m.Correction, m.Routed = 1, 0
	if corr.predicted != 0 {
		m.Correction = corr.factor(now)
	}
	if routed != 0 {
		m.Routed = routed * decay(routedAt, now, cfg.RoutedHalfLife)
	}
	return info
}

// observe feeds the correction factor with one request's predicted and
// achieved seconds (see Index.ObserveTTFT). workers.mu is held for
// reading.
func (w *worker) observe(p, a float64, now int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if p < minObservedSteps*w.cost.DecodeStepSeconds {
		return
	}
	next := correctionSums{achieved: a, predicted: p, at: now}
	if old := w.corr; old.predicted != 0 {
		f := decay(old.at, now, correctionHalfLife)
		next.achieved += old.achieved * f
		next.predicted += old.predicted * f
	}
	w.corr = next
	w.publish()
}

// group is MaxWorkers worker slots, whose workers' bits make up one
// 64-bit holder mask in the block table. A fleet larger than MaxWorkers
// takes several groups; a block held in several has a mask for each (see
// entry). What a lookup reads of the slots sits in arrays of the group,
// so that a lookup over many workers reads a few contiguous bytes of each
// rather than the scattered workers.
type group struct {
	recs  *[MaxWorkers]record                    // the slots' records
	infos [MaxWorkers]atomic.Pointer[workerInfo] // the slots' workers' Info, each replaced, never changed
	id    int                                    // in workers.groups
	slots [MaxWorkers]*worker                    // guarded by workers.mu
	names [MaxWorkers]string                     // the slots' workers' names, which lookups read; guarded by workers.mu
	n     int                                    // slots in use; guarded by workers.mu
	used  uint64                                 // their bits (but retired workers'); guarded by workers.mu
	redis atomic.Uint64                          // the bits of the workers that read the Redis tier (Info.RedisTier)
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
	// gen counts the changes of which worker holds which place (a worker
	// added or retired), for the rosters' places (see Roster).
	gen uint64

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
	// A block of 8 KiB, as the records are, is a page of the allocator's,
	// so that the records do not straddle cache lines.
	g := &group{recs: new([MaxWorkers]record), id: len(ws.groups)}
	ws.groups = append(ws.groups, g)
	return g
}

// get returns name's state, nil if untracked. w.mu is held.
func (ws *workers) get(name string) *worker { return ws.byName[name] }

// owns reports whether w holds its slot: it was not removed. ws.mu is
// held.
func (ws *workers) owns(w *worker) bool { return w.grp.slots[w.slot] == w }

// hintAt returns the index of the hint a name whose bytes are at addr
// takes first; it may take the others of its line (hintWays).
func hintAt(addr uint64) int { return int((addr * hintMix) >> (64 - hintBits)) }

// hintAddrOf returns the address bits of name's bytes a hint keeps.
func hintAddrOf(name string) uint64 {
	return uint64(uintptr(unsafe.Pointer(unsafe.StringData(name)))) & hintAddr
}

// hint returns the place last found under name's bytes, which may not
// be name's worker's (see check), or noPlace: the first hint of name's
// line, which is nearly always name's, so that a loop of hints reads one
// each, their misses overlapping; check reads the rest of the line if
// need be. ws.mu is held.
func (ws *workers) hint(name string) place {
	addr := hintAddrOf(name)
	if h := ws.hints[hintAt(addr)].Load(); h&^(hintSet-1) == addr<<16|hintSet {
		return place(h & (hintSet - 1))
	}
	return noPlace
}

// lineOf returns the indexes of the hints of the i-th's line, the i-th
// first.
func lineOf(i int) (line [hintWays]int) {
	for k := range line {
		line[k] = i&^(hintWays-1) | (i+k)&(hintWays-1)
	}
	return line
}

// holds reports whether name's worker holds place p. It reads the
// group's arrays, not the worker. ws.mu is held.
func (ws *workers) holds(p place, name string) bool {
	if p == noPlace {
		return false
	}
	g, s := ws.groups[p/MaxWorkers], p%MaxWorkers
	return g.used&(1<<s) != 0 && g.names[s] == name
}

// check returns p if name's worker holds it, else the place the other
// hints of name's line give it, else the place of name's worker from the
// map (noPlace if untracked), which becomes name's hint. ws.mu is held.
func (ws *workers) check(p place, name string) place {
	if ws.holds(p, name) {
		return p
	}
	return ws.lookup(name)
}

// lookup is check when name's first hint is not its worker's.
func (ws *workers) lookup(name string) place {
	addr := hintAddrOf(name)
	line := lineOf(hintAt(addr))
	for _, j := range line[1:] {
		if h := ws.hints[j].Load(); h&^(hintSet-1) == addr<<16|hintSet {
			if p := place(h & (hintSet - 1)); ws.holds(p, name) {
				return p
			}
		}
	}
	w := ws.byName[name]
	if w == nil {
		return noPlace
	}
	p := w.at()
	// The first of the line's hints that is free or has name's address,
	// else the one name takes first.
	k := line[0]
	for _, j := range line {
		if h := ws.hints[j].Load(); h == 0 || h>>16 == addr {
			k = j
			break
		}
	}
	ws.hints[k].Store(addr<<16 | hintSet | uint64(p))
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
			g.infos[i].Store(&defaultInfo)
			w.publish()
			ws.byName[name] = w
			ws.n++
			ws.gen++
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
	ws.gen++
}

// release frees the slot of w, retired, once none of the block table's
// entries holds its bits. ws.mu is held for writing.
func (ws *workers) release(w *worker) {
	w.grp.slots[w.slot] = nil
	w.grp.n--
}

// retiredSlot takes the slot of a worker being removed.
var retiredSlot = &worker{}
