// Package kvindex is the scheduler's KV index. Its block index
// (blocks.go) says, for each block key, which workers hold the block in
// their GPU and CPU tiers, and whether the fleet's shared Redis tier holds
// it; its per-worker state (workers.go) holds each worker's latest load,
// pending prefill, cost figures and how its observed times compare with
// predictions. Each has its own locks: load reports and feedback never
// wait for the block table, and what a lookup reads of a worker is
// published to atomics (a sequence lock), so that a decision over a
// thousand workers takes none of their locks.
//
// Watch goroutines feed it with Apply (one stream per worker); request
// goroutines read it with Visit or Lookup (every worker's match: its
// overlap with the prompt and its state; a Roster's Visit for workers
// visited request after request) or Overlaps (the overlaps of the
// workers holding the prompt alone), which neither block for long nor
// allocate, and record with Predict the blocks a routed request will
// create. Each scheduler replica keeps its own index, fed by its own watch
// streams.
//
// Memory is bounded by Config.MaxBlocks. An indexed block costs
// BytesPerBlock bytes or less: a 56-byte entry in a pointer-free slab plus
// 10.7–21.3 bytes of hash table (8-byte slots filled to between 3/8 and
// 3/4). When full, the least recently touched block
// (stored, moved or predicted; entries touched within the latest eighth of
// the cap's worth of touches keep their place) is forgotten. Workers
// occupy one of MaxWorkers slots of a group each, and a block's holders
// in one group are 64-bit masks in its entry; the whole fleet shares one
// table, so a lookup reads each block it visits once whatever the fleet's
// size. A block held in several groups (a fleet of more than MaxWorkers)
// keeps a 32-byte part per further group in an array of a second
// pointer-free slab, which the cap counts as half a block each (see
// blocks.over).
package kvindex

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sync"
	"time"
)

// MaxWorkers is the number of workers of one group: the workers whose
// holding of a block is one 64-bit mask, one bit each.
const MaxWorkers = 64

// MaxTracked is the number of workers an Index tracks at once. Blocks of
// further workers are not indexed (Apply returns ErrTooManyWorkers); such
// workers are still routable, with no known cache.
const MaxTracked = 4096

// BytesPerBlock bounds the memory of one indexed block held in one group
// once the index has grown to it: a 56-byte entry plus at most 21.3 bytes
// of hash table (more only while the first slab chunk of 65,536 entries
// fills). A block held in several groups adds 32 bytes per further group,
// rounded up to a power of two, which the cap counts.
const BytesPerBlock = entrySize + 22

// Defaults of Config.
const (
	// DefaultMaxBlocks is 4 Mi blocks, about 256 MiB: 64 GPUs of 80 GB
	// hold about 2.5 Mi blocks of 2 MiB (Llama-3.1-8B, 16 tokens), with
	// room left for their CPU tiers' recent blocks and Redis.
	DefaultMaxBlocks = 4 << 20
	// DefaultPredictTTL is how long a predicted block counts when no event
	// confirms it: long enough for a prefill of a few thousand tokens and
	// its events to arrive, short enough that a request that failed stops
	// attracting its siblings quickly.
	DefaultPredictTTL = 2 * time.Second
	// DefaultRoutedHalfLife is the half-life of Match.Routed: a minute,
	// long enough to reflect the traffic the prefixes a worker holds
	// attract (which its instantaneous load does not yet show), short
	// enough to follow a shift of that traffic.
	DefaultRoutedHalfLife = time.Minute
)

// The correction factor is (A + k)/(P + k), where A and P sum the achieved
// and the predicted TTFT (seconds) of the worker's observed requests, each
// weighing half as much every correctionHalfLife, and k is correctionPrior:
// long prefills, whose estimates decide where uncached prefixes go, weigh
// more than short ones; a handful of requests cannot swing it far from 1;
// and a worker that stops being observed drifts back to 1 rather than
// keeping a factor that keeps traffic away from it. Requests predicted to
// take less than minObservedSteps decode steps are not observed: their
// TTFT is mostly the rest of the step they arrived in, which no estimate
// sees, and says nothing of the worker's cost figures. An achieved TTFT
// counts at most maxCorrection times the predicted one and at least
// minCorrection of it, so one outlier (a GC pause, a cold start) cannot
// swing routing.
const (
	correctionHalfLife = 30 * time.Second
	correctionPrior    = 1.0 // seconds of predicted TTFT
	minObservedSteps   = 10
	minCorrection      = 0.25
	maxCorrection      = 4
)

// correctionSums are a worker's decayed sums, as of at.
type correctionSums struct {
	achieved, predicted float64
	at                  int64 // Unix nanoseconds
}

// factor returns the correction factor at now.
func (c *correctionSums) factor(now int64) float64 {
	f := decay(c.at, now, correctionHalfLife)
	return (c.achieved*f + correctionPrior) / (c.predicted*f + correctionPrior)
}

// decay returns the weight at now of a value recorded at, halving every
// halfLife: 1 if now is not after at. Times are Unix nanoseconds.
func decay(at, now int64, halfLife time.Duration) float64 {
	if now <= at {
		return 1
	}
	return math.Exp2(-float64(now-at) / float64(halfLife))
}

// Errors of Apply. The watcher resubscribes (for a fresh snapshot) on
// ErrGap and ErrNoSnapshot.
var (
	// ErrGap: the event's sequence number skips past the next expected
	// one; events were lost. The event is not applied, and the worker's
	// further events are refused until its next snapshot.
	ErrGap = errors.New("sequence gap")
	// ErrNoSnapshot: an event arrived for a worker before its snapshot.
	ErrNoSnapshot = errors.New("no snapshot")
	// ErrTooManyWorkers: MaxTracked workers are already indexed.
	ErrTooManyWorkers = errors.New("too many workers")
)

// Config configures an Index. The zero value means every default.
type Config struct {
	// MaxBlocks caps the blocks indexed; 0 means DefaultMaxBlocks.
	MaxBlocks int
	// PredictTTL is how long Predict's entries count unconfirmed; 0 means
	// DefaultPredictTTL.
	PredictTTL time.Duration
	// RoutedHalfLife is the half-life of Match.Routed; 0 means
	// DefaultRoutedHalfLife.
	RoutedHalfLife time.Duration
	// Now returns the current time; nil means time.Now. Tests set it.
	Now func() time.Time
	// OnPredict, when set, hears each Predict of a tracked worker, after
	// it was recorded, from Predict's caller: the scheduler shares it
	// with its other replicas, which record it with Shared. It must not
	// block nor keep p.Keys.
	OnPredict func(p Prediction)
	// OnObserve, when set, hears each valid ObserveTTFT of a tracked
	// worker, from ObserveTTFT's caller, for another index to record with
	// SharedTTFT: indexes that do correct their estimates of a worker
	// alike, from all the requests it served. bench/vsim does so on
	// request; the scheduler's replicas do not (docs/replica-sync.md).
	// It must not block.
	OnObserve func(o Observation)
}

// Observation is one request's time to first token on Worker, beside
// kv_aware's prediction of it (see Index.ObserveTTFT).
type Observation struct {
	Worker              string
	Predicted, Achieved time.Duration
}

// Prediction is one committed decision as Predict recorded it, which
// the other scheduler replicas record with Shared.
type Prediction struct {
	// Worker is the worker the request was sent to, Keys its prompt's
	// blocks.
	Worker string
	Keys   []uint64
	// Pending is how many of Keys the worker held neither cached nor
	// predicted when the decision was made: the request's prefill, which
	// counts in the worker's pending tokens until its next load report.
	// Negative: unknown (a message of an older replica); Shared then
	// counts the blocks the worker does not hold when it records them.
	Pending int
	// At is when the decision was made, on the deciding replica's clock.
	At time.Time
}

func (c Config) withDefaults() Config {
	if c.MaxBlocks <= 0 {
		c.MaxBlocks = DefaultMaxBlocks
	}
	if c.PredictTTL <= 0 {
		c.PredictTTL = DefaultPredictTTL
	}
	if c.RoutedHalfLife <= 0 {
		c.RoutedHalfLife = DefaultRoutedHalfLife
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// Load is a worker's latest load report.
type Load struct {
	Running, Waiting     int
	WaitingPrefillTokens int64
	GPUBlocksUsed        int64
	GPUBlocksTotal       int64
	CPUBlocksUsed        int64
	CPUBlocksTotal       int64
	// Slots is the prompts the worker keeps cached at once when it keeps
	// one per slot (llama-server), 0 otherwise: the learned index keeps
	// that many chains for it (see Capacity).
	Slots int
}

// Match is what Lookup tells of one worker for one request.
type Match struct {
	// Known reports that the worker is indexed (it has a snapshot, an
	// Info or predictions). For unknown workers every other field is
	// zero but Cost (DefaultCost), BlockTokens and Correction (1).
	Known bool
	// GPU, CPU and Redis count the request's leading blocks the worker
	// would find: a block counts as GPU if the worker holds it there (or
	// is predicted to), else as CPU if in its CPU tier, else as Redis if
	// the worker uses the Redis tier and Redis holds it. The count stops
	// at the first block found nowhere.
	GPU, CPU, Redis int
	// Load is the worker's latest load report, and PendingTokens the
	// prompt tokens routed to it by Predict since that report (at most
	// PredictTTL ago: workers without load reports, such as HTTP engines,
	// count the tokens routed in the last PredictTTL or so).
	Load          Load
	PendingTokens int64
	// Cost is the worker's cost figures (from Info), DefaultCost's where
	// it reported none; HasCost says whether it reported any.
	Cost    Cost
	HasCost bool
	// BlockTokens is the tokens of one block (Info's block_chars ÷ 4;
	// 16 by default).
	BlockTokens int
	// Correction is achieved over predicted TTFT as observed (see
	// ObserveTTFT): 1 until observed, and drifting back to 1 unobserved.
	Correction float64
	// Routed is the requests Predict routed to the worker, each weighing
	// half as much every RoutedHalfLife: its share of recent traffic,
	// including the requests the prefixes it was given keep attracting.
	Routed float64
}

// defaultBlockTokens is 64 characters at 4 characters a token.
const defaultBlockTokens = 16

// Index is the KV index: the block index (blocks.go) and the per-worker
// state (workers.go), each under its own locks. Its methods are safe for
// concurrent use. Locks are taken in the order membership, block table,
// worker.
type Index struct {
	cfg     Config
	workers workers
	blocks  blocks
	infos   interned
}

// New returns an empty index.
func New(cfg Config) *Index {
	x := &Index{cfg: cfg.withDefaults()}
	x.workers.byName = make(map[string]*worker)
	x.workers.hints = new(hintTable)
	x.workers.newGroup()
	x.blocks.init(x.cfg.MaxBlocks)
	return x
}

// Len returns the number of blocks indexed.
func (x *Index) Len() int {
	x.blocks.mu.RLock()
	defer x.blocks.mu.RUnlock()
	return x.blocks.t.n
}

// Evicted returns the number of blocks forgotten because the index was
// full.
func (x *Index) Evicted() uint64 {
	x.blocks.mu.RLock()
	defer x.blocks.mu.RUnlock()
	return x.blocks.evicted
}

// AddWorker tracks the worker without a watch stream, so that Predict
// records predictions for it (see Learn for workers that never report
// their blocks). Watched workers are tracked from their first Info or
// snapshot; RemoveWorker forgets either.
func (x *Index) AddWorker(name string) error {
	_, err := x.worker(name)
	return err
}

// Learn tracks the worker as one that publishes no cache events (an
// OpenAI-compatible HTTP engine, llama-server, vLLM or SGLang without KV
// events), within capacity c: the requests Predict records on it stay
// there, as the engine would keep them (least recently used out, within
// c), not for PredictTTL, and Finished corrects them with the cached
// tokens each response reports. Calling it again changes the capacity;
// what the worker holds beyond it goes at the next request.
func (x *Index) Learn(name string, c Capacity) error {
	w, err := x.worker(name)
	if err != nil {
		return err
	}
	b := &x.blocks
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.lrn == nil {
		w.lrn = &learned{refs: make(map[uint64]int32)}
		w.isLearned.Store(true)
	}
	w.lrn.cap = c
	return nil
}

// worker returns name's state, tracking it if needed.
func (x *Index) worker(name string) (*worker, error) {
	x.workers.mu.RLock()
	w := x.workers.get(name)
	x.workers.mu.RUnlock()
	if w != nil {
		return w, nil
	}
	x.workers.mu.Lock()
	defer x.workers.mu.Unlock()
	return x.workers.add(name)
}

// SetInfo records what the worker told of itself: its cost figures, block
// size and whether it uses the Redis tier. The watcher calls it on every
// (re)subscription.
func (x *Index) SetInfo(name string, info Info) error {
	w, err := x.worker(name)
	if err != nil {
		return err
	}
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w.setInfo(info, &x.infos, &x.workers)
	return nil
}

// Apply applies one event of the worker's watch stream. A snapshot
// replaces every GPU and CPU block the index had for the worker (its
// predictions stay); a lookup meanwhile may find some of the blocks it
// replaces gone before its own are there. Other events must follow in sequence: an event
// already applied (seq not above the last) is ignored, so Apply is
// idempotent; one that skips ahead returns ErrGap, and events before the
// first snapshot return ErrNoSnapshot. In both cases the caller should
// resubscribe. Events of one worker must not be applied concurrently.
// A load report takes only the worker's lock, never the block table's.
func (x *Index) Apply(name string, ev Event) error {
	if snap := ev.Snapshot; snap != nil {
		if _, err := x.worker(name); err != nil {
			return err
		}
	}
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w := x.workers.get(name)
	if w == nil {
		return fmt.Errorf("worker %s: %w", name, ErrNoSnapshot)
	}
	h, b := w.holder(), &x.blocks
	if snap := ev.Snapshot; snap != nil {
		if w.mayHold.Load() {
			b.clearSlotChunked(h, false)
		}
		b.mu.Lock()
		if w.lrn != nil {
			w.lrn.clear(b, h)
		}
		for i := range snap.Blocks {
			if len(snap.Blocks[i].Keys) > 0 {
				w.mayHeld()
			}
			b.apply(h, &snap.Blocks[i])
		}
		b.mu.Unlock()
		w.mu.Lock()
		w.setLoad(snap.Load, x.cfg.Now().UnixNano())
		w.synced, w.lastSeq = true, ev.Seq
		w.mu.Unlock()
		return nil
	}
	w.mu.Lock()
	switch seq := ev.Seq; {
	case !w.synced:
		w.mu.Unlock()
		return fmt.Errorf("worker %s: %w", name, ErrNoSnapshot)
	case seq <= w.lastSeq:
		w.mu.Unlock()
		return nil
	case seq != w.lastSeq+1:
		w.synced = false
		last := w.lastSeq
		w.mu.Unlock()
		return fmt.Errorf("worker %s: %w: seq %d after %d", name, ErrGap, seq, last)
	}
	w.lastSeq = ev.Seq
	if ev.Load != nil {
		w.setLoad(*ev.Load, x.cfg.Now().UnixNano())
	}
	w.mu.Unlock()
	if ev.Cache != nil {
		if len(ev.Cache.Keys) > 0 {
			w.mayHeld()
		}
		b.applyChunked(h, ev.Cache)
	}
	return nil
}

// RemoveWorker forgets the worker: its blocks, predictions, load and
// slot. The watcher calls it when the worker leaves the pool. Lookups
// stop seeing the worker at once; its bits are then cleared from the
// block table a chunk at a time, so that lookups and writes wait a
// millisecond or less rather than for a scan of the whole table, and its
// slot is free for another worker once they are.
func (x *Index) RemoveWorker(name string) {
	x.workers.mu.Lock()
	w := x.workers.get(name)
	if w == nil {
		x.workers.mu.Unlock()
		return
	}
	x.workers.retire(w)
	x.workers.mu.Unlock()
	if w.mayHold.Load() {
		x.blocks.clearSlotChunked(w.holder(), true)
	}
	x.workers.mu.Lock()
	x.workers.release(w)
	x.workers.mu.Unlock()
}

// Predict records that the worker will hold keys in its GPU tier once the
// request just routed to it is prefilled: until an event confirms each
// block, or PredictTTL passes, Lookup counts them as GPU blocks of the
// worker. The blocks the worker did not hold are added to its pending
// prefill tokens until its next load report; a Lookup concurrent with
// Predict sees all of keys pending, never none. Predict is called when a
// kv_aware decision is committed; it takes the block table's write lock
// for about 10 ns a key and does not allocate once the index has grown.
// It also counts the request in the worker's Routed. A worker the index
// does not track (see AddWorker) is ignored, so a request routed while its
// worker is removed does not bring the worker back. On a learned worker
// (see Learn) the blocks are recorded as held, without a TTL, until the
// worker's capacity or Finished drops them; call Finished when the
// request ends.
func (x *Index) Predict(name string, keys []uint64) {
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w := x.workers.get(name)
	if w == nil {
		return
	}
	// Requests routed while the blocks are written, which waits for the
	// table's lock, see this one's prefill pending at once: every block
	// counts until the write finds those the worker held.
	added := x.place(w, keys, w.predicted(int64(len(keys)), now, &x.cfg), now, true)
	if x.cfg.OnPredict != nil {
		x.cfg.OnPredict(Prediction{Worker: name, Keys: keys, Pending: int(added), At: time.Unix(0, now)})
	}
}

// Shared records another scheduler replica's committed decision (see
// Config.OnPredict) as Predict does its own: its keys on the worker, and
// its prefill (p.Pending blocks) in the worker's pending tokens, unless a
// load report of the worker reached this replica after the decision (the
// report counts the request, as it counts this replica's own) or the
// decision is older than PredictTTL. What the worker holds by the time
// the decision arrives does not shorten the prefill: a worker's cache
// events for the request itself can reach this replica before the
// decision does, and the prefill they announce still takes its time.
// Unlike Predict it does not count the request in the worker's Routed
// (this replica's own routing) nor, on a learned worker, keep a request
// to finish. A worker the index does not track is ignored, and Shared
// reports false; otherwise true.
func (x *Index) Shared(p Prediction) bool {
	if len(p.Keys) == 0 {
		return true
	}
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w := x.workers.get(p.Worker)
	if w == nil {
		return false
	}
	if p.Pending < 0 {
		x.place(w, p.Keys, w.addPending(int64(len(p.Keys)), now, &x.cfg), now, false)
		return true
	}
	w.mayHeld()
	if w.learning() {
		x.learn(w, p.Keys, false)
	} else {
		x.blocks.predict(p.Keys, w.holder(), now, now+int64(x.cfg.PredictTTL))
	}
	w.sharedPending(int64(p.Pending), p.At.UnixNano(), now, &x.cfg)
	return true
}

// place records keys as predicted on w (held, on a learned worker, as a
// request in flight when busy), all of them counted in its pending
// prefill (generation gen) and those it held taken off again, and
// returns how many it did not hold. x.workers.mu is held.
func (x *Index) place(w *worker, keys []uint64, gen uint64, now int64, busy bool) int64 {
	all := int64(len(keys))
	if all > 0 {
		w.mayHeld()
	}
	var added int64
	if w.learning() {
		added = x.learn(w, keys, busy)
	} else {
		added = x.blocks.predict(keys, w.holder(), now, now+int64(x.cfg.PredictTTL))
	}
	w.held(all-added, gen)
	return added
}

// learn records keys on the learned worker w, within its capacity, as a
// request in flight there when busy. x.workers.mu is held.
func (x *Index) learn(w *worker, keys []uint64, busy bool) int64 {
	if len(keys) == 0 {
		return 0
	}
	w.mu.Lock()
	load := w.load
	w.mu.Unlock()
	b := &x.blocks
	b.mu.Lock()
	defer b.mu.Unlock()
	l := w.lrn
	prompts, blocks := l.cap.Prompts, l.cap.Blocks
	if prompts <= 0 {
		prompts = load.Slots
	}
	if blocks <= 0 {
		blocks = load.GPUBlocksTotal
	}
	if blocks <= 0 {
		blocks = DefaultLearnedBlocks
	}
	added := l.record(b, w.holder(), keys, prompts, blocks, busy)
	b.trim()
	return added
}

// Finished reports the end of a request Predict recorded on a learned
// worker (see Learn), with keys as given to Predict and what the worker
// reported (u): a hit shorter than u.PredictedTokens drops what the
// worker turned out not to hold (see learned.finish). Other workers
// ignore it.
func (x *Index) Finished(name string, keys []uint64, u Usage) {
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w := x.workers.get(name)
	if w == nil || !w.learning() {
		return
	}
	w.mu.Lock()
	bt := w.blockTokens
	w.mu.Unlock()
	b := &x.blocks
	b.mu.Lock()
	defer b.mu.Unlock()
	w.lrn.finish(b, w.holder(), keys, u, bt)
}

// Prefilled records that a request routed to the worker has been prefilled
// (its first token arrived): its tokens, counted as pending by Predict,
// no longer wait. Without it a fast request would weigh on the worker's
// queue estimate until the next load report.
func (x *Index) Prefilled(name string, tokens int) {
	if tokens <= 0 {
		return
	}
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	if w := x.workers.get(name); w != nil {
		w.prefilled(tokens)
	}
}

// ObserveTTFT feeds the worker's correction factor with one request's
// achieved time to first token and the time kv_aware predicted. The front
// end calls it when the first token arrives. Non-positive durations, and
// predictions shorter than ten of the worker's decode steps, are ignored
// (see the comment on correctionHalfLife).
func (x *Index) ObserveTTFT(name string, predicted, achieved time.Duration) {
	o := Observation{Worker: name, Predicted: predicted, Achieved: achieved}
	if x.observe(o) && x.cfg.OnObserve != nil {
		x.cfg.OnObserve(o)
	}
}

// SharedTTFT records another scheduler replica's observation (see
// Config.OnObserve) as ObserveTTFT does this replica's own, and reports
// whether the index tracks its worker.
func (x *Index) SharedTTFT(o Observation) bool {
	if o.Predicted <= 0 || o.Achieved <= 0 {
		return true
	}
	return x.observe(o)
}

// observe feeds o to its worker's correction factor, and reports whether
// it was a valid observation of a tracked worker.
func (x *Index) observe(o Observation) bool {
	if o.Predicted <= 0 || o.Achieved <= 0 {
		return false
	}
	p := o.Predicted.Seconds()
	a := min(max(o.Achieved.Seconds(), p*minCorrection), p*maxCorrection)
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	w := x.workers.get(o.Worker)
	if w == nil {
		return false
	}
	w.observe(p, a, now)
	return true
}

// Lookup fills out[i] with what workers[i] would find of the request whose
// block keys are keys (see Match); out must be at least as long as
// workers. It is Visit, copying each match into out.
func (x *Index) Lookup(keys []uint64, workers []string, out []Match) {
	x.visit(keys, workers, out[:len(workers)], nil)
}

// A MatchVisitor hears Visit's matches one worker at a time.
type MatchVisitor interface {
	// VisitMatch is called with the match of workers[i], for each i in
	// order, from Visit's caller; m is valid during the call only. It
	// must not call the Index nor change m.
	VisitMatch(i int, m *Match)
}

// Visit hands v what each of workers would find of the request whose
// block keys are keys (see Match). It walks the keys once, under the
// block table's read lock (one probe when none of the workers holds the
// first block), then reads each worker's state without the worker's lock
// (see record): the walk may wait for a write to the table, and the load and pending tokens it reports
// then count the requests Predict recorded meanwhile (a burst's picks
// queued behind one write would otherwise all see none). It does not
// allocate once warm, and costs about 25 ns per worker plus 10–20 ns per
// block read; pass every worker in one call. Unlike Lookup, it writes no
// array of matches, which over a thousand workers would be much of its
// cost.
func (x *Index) Visit(keys []uint64, workers []string, v MatchVisitor) {
	x.visit(keys, workers, nil, v)
}

// visit is Lookup (into out) or Visit (to v).
func (x *Index) visit(keys []uint64, workers []string, out []Match, v MatchVisitor) {
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	ls := lookupScratchPool.Get().(*lookupScratch) // put back only if all went well: see lookupScratch
	found := ls.places(len(workers))
	// The hints, then the places they name: each pass's loads are
	// independent of one another, so that on a cold cache their misses
	// overlap.
	for i, name := range workers {
		found[i] = x.workers.hint(name)
	}
	for i, name := range workers {
		found[i] = x.workers.check(found[i], name)
	}
	x.visitPlaces(ls, keys, found, now, out, v)
}

// visitPlaces is visit once the workers' places are found (noPlace for
// an untracked worker): it walks keys for them and fills out[i], or hands
// v, the match of the worker at found[i]. workers.mu is held for reading;
// it puts ls back.
func (x *Index) visitPlaces(ls *lookupScratch, keys []uint64, found []place, now int64, out []Match, v MatchVisitor) {
	groups := x.workers.groups
	ws, ngroups := &ls.walk, len(groups)
	ws.reset(ngroups)
	for _, p := range found {
		if p != noPlace {
			ws.g[p/MaxWorkers].alive |= 1 << (p % MaxWorkers)
		}
	}
	for k, g := range groups {
		ws.g[k].redisOK = ws.g[k].alive & g.redis.Load()
	}
	if len(keys) > 0 {
		ws.start(ngroups)
		x.blocks.walk(ws, keys, now)
	}
	// fill fills m with the match of the worker at p, but for m's Info
	// fields when they are has's (see group.match), and returns the Info
	// they are now.
	fill := func(m *Match, p place, has *workerInfo) *workerInfo {
		if p == noPlace {
			*m = Match{Cost: DefaultCost, BlockTokens: defaultBlockTokens, Correction: 1}
			return nil
		}
		k, s := p/MaxWorkers, p%MaxWorkers
		info := groups[k].match(int(s), m, now, &x.cfg, has)
		if ws.g[k].held&(1<<s) != 0 {
			c := &ws.cnt[k][s]
			m.GPU, m.CPU, m.Redis = int(c[0]), int(c[1]), int(c[2])
		}
		return info
	}
	// out's matches never reach v, so that a caller's array of them does
	// not escape to the heap. A visit fills one match for every worker,
	// whose cost figures are copied only when a worker's Info differs from
	// the one before's (alike workers share one, see interned).
	var has *workerInfo
	for i, p := range found {
		if v == nil {
			fill(&out[i], p, nil)
			continue
		}
		has = fill(&ls.one, p, has)
		v.VisitMatch(i, &ls.one)
	}
	for k := range ngroups {
		for m := ws.g[k].held; m != 0; m &= m - 1 {
			ws.cnt[k][bits.TrailingZeros64(m)] = [3]int32{}
		}
	}
	lookupScratchPool.Put(ls)
}

// Overlap is how much of a prompt one worker holds: its leading blocks
// in the GPU and CPU tiers, counted as Match counts them (predicted
// blocks as GPU).
type Overlap struct {
	Worker   string
	GPU, CPU int
}

// Overlaps appends to out the overlap of each worker that holds the
// prompt's first block in its GPU or CPU tier, or is predicted to, and
// returns it. It is the sparse match a router that keeps the workers'
// load apart needs (Dynamo's indexer answers such queries): one walk of
// the prompt (one probe when no worker holds its first block), and no
// worker's state read. Blocks only the shared Redis tier holds are not
// counted. It does not allocate when out
// has room.
func (x *Index) Overlaps(keys []uint64, out []Overlap) []Overlap {
	if len(keys) == 0 {
		return out
	}
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	ls := lookupScratchPool.Get().(*lookupScratch) // put back only if all went well: see lookupScratch
	ws, groups := &ls.walk, x.workers.groups
	ws.reset(len(groups))
	for k, g := range groups {
		ws.g[k].alive = g.used
	}
	ws.start(len(groups))
	x.blocks.walk(ws, keys, now)
	for k, g := range groups {
		for m := ws.g[k].held; m != 0; m &= m - 1 {
			s := bits.TrailingZeros64(m)
			c := &ws.cnt[k][s]
			if c[0]+c[1] > 0 {
				out = append(out, Overlap{Worker: g.names[s], GPU: int(c[0]), CPU: int(c[1])})
			}
			*c = [3]int32{}
		}
	}
	lookupScratchPool.Put(ls)
	return out
}

// lookupScratch is Lookup's working memory: the workers looked up and the
// walk's state. Its counts are all zero when it is not in use: who reads
// a count zeroes it, and a lookup that panics (in a visitor) does not put
// it back.
type lookupScratch struct {
	found []place
	walk  walkState
	one   Match // Visit's
}

// places returns ls's buffer for n workers' places.
func (ls *lookupScratch) places(n int) []place {
	if cap(ls.found) < n {
		ls.found = make([]place, n)
	}
	return ls.found[:n]
}

var lookupScratchPool = sync.Pool{New: func() any { return new(lookupScratch) }}
