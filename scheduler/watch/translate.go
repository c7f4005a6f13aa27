package watch

import (
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// DefaultMaxEntries bounds a Translator's map of engine hashes: a GPU of
// tens of thousands of blocks plus a CPU tier a few times larger, at about
// 150 bytes an entry.
const DefaultMaxEntries = 1 << 18

// TranslatorConfig configures a Translator. The zero value is usable.
type TranslatorConfig struct {
	// Model salts every chain's first key, as requests' keys are salted:
	// blockkey.Salt(Model, adapter, tenant).
	Model string
	// Tenant returns the tenant that salts a chain whose first block ev
	// stores. Nil means EventTenant. The request side must salt with the
	// same tenant, so the engine must be sent it (vLLM's cache_salt).
	Tenant func(ev *kvevents.BlockStored) string
	// Group is the KV cache group whose events are indexed (vLLM's
	// group_idx, for hybrid models); events without a group always are.
	// Default 0.
	Group int64
	// MaxEntries bounds the map engine hash → baton key. Default
	// DefaultMaxEntries. When full, the least recently used entry is
	// dropped and its key reported Removed, so the index never keeps a key
	// the translator could no longer remove.
	MaxEntries int
}

// TranslatorStats counts what a Translator did.
type TranslatorStats struct {
	Stored  uint64 // blocks reported stored
	Removed uint64 // blocks reported removed
	Cleared uint64 // kvevents.AllBlocksCleared events
	// UnknownParent counts kvevents.BlockStored events dropped because their parent
	// hash (not 0 nor nil: see kvevents.NoParent) was never seen (the translator
	// started mid-sequence, or the parent was evicted from the map): their
	// keys cannot be chained. Their blocks are not indexed, and neither are
	// their children's, whose parents are then unknown too.
	UnknownParent uint64
	// UnknownRemoved counts removed hashes that were not mapped.
	UnknownRemoved uint64
	// BadStored counts kvevents.BlockStored events whose token count is not blocks
	// times block size (or, without a block size, not a multiple of the
	// blocks).
	BadStored uint64
	// OtherMedium counts events of a medium the index has no tier for (disk,
	// external pools): their hashes are mapped, for chaining, not indexed.
	OtherMedium uint64
	// OtherGroup counts events of another KV cache group, skipped.
	OtherGroup uint64
	// Evicted counts map entries dropped to stay within MaxEntries.
	Evicted uint64
}

// Translator turns one engine's decoded batches into the scheduler's index
// events, with baton's keys. It is used from one goroutine; Stats may be
// read from any.
//
// Its events are numbered by the translator and start with a snapshot of
// no blocks, which the index needs before anything else. Apply them to the
// index in order.
type Translator struct {
	cfg       TranslatorConfig
	seq       uint64  // of the last event returned
	synced    bool    // a snapshot was returned since the last reset
	entries   digests // by the hash's Digest: index in lru's slab
	lru       lru
	blockSize atomic.Int64
	pending   []uint64 // scratch for evictions' removals, by tier bit
	warmed    uint64   // keeps digests.warm's loads
	// Translate's results, reused by the next call: its events, their
	// cache events and their keys.
	out    []kvindex.Event
	caches []kvindex.CacheEvent
	keys   []uint64
	stats  struct {
		stored, removed, cleared, unknownParent, unknownRemoved atomic.Uint64
		badStored, otherMedium, otherGroup, evicted             atomic.Uint64
	}
}

// entry is what the translator knows of one engine hash. It holds no
// pointer, so that the collector need not scan the slab, and half a cache
// line: an integer hash is its digest; another's Hash is kept aside, in
// lru.long.
type entry struct {
	d          uint64 // the hash's Digest
	key        uint64
	prev, next int32 // in the LRU list; -1 none
	bits       uint8 // tierBits where the engine holds the block
	long       bool  // not an integer hash: lru.long holds it
}

// lru is the translator's entries in a slab, linked most recently used
// first: no allocation per entry once the slab has grown.
type lru struct {
	slab []entry
	// long holds the hashes of the entries that are not integers, at
	// their entries' indexes; nil until the first.
	long       []kvevents.Hash
	free       []int32
	head, tail int32
	n          int
}

func (l *lru) init() {
	l.slab, l.free = l.slab[:0], l.free[:0]
	clear(l.long)
	l.long = l.long[:0]
	l.head, l.tail, l.n = -1, -1, 0
}

func (l *lru) at(i int32) *entry { return &l.slab[i] }

// is reports whether entry i is of h, whose digest is d.
func (l *lru) is(i int32, h kvevents.Hash, d uint64) bool {
	e := &l.slab[i]
	if e.d != d {
		return false
	}
	if e.long {
		return l.long[i] == h
	}
	_, isInt := h.Uint64()
	return isInt
}

// pushFront adds the entry of h (whose digest e.d holds) at the front.
func (l *lru) pushFront(e entry, h kvevents.Hash) int32 {
	var i int32
	if k := len(l.free); k > 0 {
		i = l.free[k-1]
		l.free = l.free[:k-1]
	} else {
		i = int32(len(l.slab))
		l.slab = append(l.slab, entry{})
		if l.long != nil {
			l.long = append(l.long, kvevents.Hash{})
		}
	}
	if _, isInt := h.Uint64(); !isInt {
		e.long = true
		if l.long == nil {
			l.long = make([]kvevents.Hash, len(l.slab), cap(l.slab))
		}
		l.long[i] = h
	}
	e.prev, e.next = -1, l.head
	l.slab[i] = e
	if l.head >= 0 {
		l.slab[l.head].prev = i
	} else {
		l.tail = i
	}
	l.head = i
	l.n++
	return i
}

func (l *lru) unlink(i int32) {
	e := &l.slab[i]
	if e.prev >= 0 {
		l.slab[e.prev].next = e.next
	} else {
		l.head = e.next
	}
	if e.next >= 0 {
		l.slab[e.next].prev = e.prev
	} else {
		l.tail = e.prev
	}
}

func (l *lru) remove(i int32) {
	l.unlink(i)
	if l.slab[i].long {
		l.long[i] = kvevents.Hash{}
	}
	l.slab[i] = entry{}
	l.free = append(l.free, i)
	l.n--
}

func (l *lru) moveToFront(i int32) {
	if l.head == i {
		return
	}
	l.unlink(i)
	e := &l.slab[i]
	e.prev, e.next = -1, l.head
	l.slab[l.head].prev = i
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
}

// Bits of entry.bits.
const (
	bitGPU   uint8 = 1 << iota
	bitCPU         // kvindex.TierCPU
	bitOther       // a medium the index has no tier for
)

// NewTranslator returns a Translator for one engine (one data-parallel
// rank: each publishes its own stream).
func NewTranslator(cfg TranslatorConfig) *Translator {
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.Tenant == nil {
		cfg.Tenant = EventTenant
	}
	t := &Translator{cfg: cfg}
	t.lru.init()
	return t
}

// EventTenant returns the tenant of a chain whose first block ev stores:
// SGLang's cache_salt, or the last string of vLLM's extra keys of the first
// block after the LoRA name (vLLM orders them LoRA name, multimodal ids,
// cache salt; multimodal ids are tuples in current versions).
func EventTenant(ev *kvevents.BlockStored) string {
	if ev.CacheSalt != "" {
		return ev.CacheSalt
	}
	if len(ev.ExtraKeys) == 0 {
		return ""
	}
	strs := ev.ExtraKeys[0]
	if ev.LoRAName != "" && len(strs) > 0 && strs[0] == ev.LoRAName {
		strs = strs[1:]
	}
	if len(strs) == 0 {
		return ""
	}
	return strs[len(strs)-1]
}

// Adapter returns the LoRA adapter that salts ev's chain: its name, or
// "lora-id:N" from engines that send only the id.
func Adapter(ev *kvevents.BlockStored) string {
	switch {
	case ev.LoRAName != "":
		return ev.LoRAName
	case ev.HasLoRAID:
		return "lora-id:" + strconv.FormatInt(ev.LoRAID, 10)
	}
	return ""
}

// TierOf returns the index tier of an engine's medium; ok is false for
// media the index does not track (disk, external pools).
func TierOf(medium string) (tier kvindex.Tier, ok bool) {
	switch strings.ToUpper(medium) {
	case "", "GPU", "CUDA":
		return kvindex.TierGPU, true
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kvindex.TierCPU, true
	}
	return 0, false
}

func bitOf(medium string) (uint8, kvindex.Tier, bool) {
	tier, ok := TierOf(medium)
	switch {
	case !ok:
		return bitOther, 0, false
	case tier == kvindex.TierCPU:
		return bitCPU, tier, true
	}
	return bitGPU, tier, true
}

// BlockSize returns the block size of the engine's last stored blocks, 0
// before any: the block size requests' keys must be computed with.
func (t *Translator) BlockSize() int { return int(t.blockSize.Load()) }

// Translate returns the index events of a batch, in order. They and their
// keys are the translator's memory, valid until its next Translate: apply
// them (the index keeps nothing of them) or copy them before.
func (t *Translator) Translate(b kvevents.Batch) []kvindex.Event {
	out := t.out[:0]
	t.caches, t.keys = t.caches[:0], t.keys[:0]
	if !t.synced {
		out = append(out, t.snapshot())
	}
	for _, ev := range b.Events {
		switch ev := ev.(type) {
		case *kvevents.BlockStored:
			out = t.stored(out, ev)
		case *kvevents.BlockRemoved:
			out = t.removed(out, ev)
		case *kvevents.AllBlocksCleared:
			t.stats.cleared.Add(1)
			out = append(out, t.Reset())
		}
	}
	t.out = out
	return out
}

// Reset forgets every hash and returns the event that drops the engine's
// entries from the index: a snapshot of no blocks. Call it when the
// subscriber reports a reset. A snapshot also replaces the worker's load in
// the index: set its Load to the latest load report before applying it.
func (t *Translator) Reset() kvindex.Event {
	t.entries.reset()
	t.lru.init()
	return t.snapshot()
}

// Model returns the model that salts the translator's keys.
func (t *Translator) Model() string { return t.cfg.Model }

// SetModel changes the model that salts the chains the translator keys
// from now on. The blocks it translated under the old model keep keys no
// request of the new one has, and their engine hashes would chain new
// blocks onto them: it forgets them, and returns the snapshot of no blocks
// that empties the engine's entries in the index, as Reset does.
func (t *Translator) SetModel(model string) kvindex.Event {
	t.cfg.Model = model
	return t.Reset()
}

func (t *Translator) snapshot() kvindex.Event {
	t.synced = true
	t.seq++
	return kvindex.Event{Seq: t.seq, Snapshot: &kvindex.Snapshot{}}
}

// cache returns the next event: the cache event of keys, which t.keys
// holds from index from on.
func (t *Translator) cache(kind kvindex.CacheKind, tier kvindex.Tier, from int) kvindex.Event {
	t.seq++
	if len(t.caches) == cap(t.caches) {
		// Not grown in place: the events returned so far point into it.
		t.caches = make([]kvindex.CacheEvent, 0, max(8, 2*cap(t.caches)))
	}
	t.caches = append(t.caches, kvindex.CacheEvent{Kind: kind, Tier: tier, Keys: t.keys[from:len(t.keys):len(t.keys)]})
	return kvindex.Event{Seq: t.seq, Cache: &t.caches[len(t.caches)-1]}
}

func (t *Translator) stored(out []kvindex.Event, ev *kvevents.BlockStored) []kvindex.Event {
	if ev.HasGroup && ev.Group != t.cfg.Group {
		t.stats.otherGroup.Add(1)
		return out
	}
	n, bs := len(ev.BlockHashes), ev.BlockSize
	if n == 0 {
		return out
	}
	if bs <= 0 && len(ev.TokenIDs)%n == 0 {
		// Some publishers leave block_size 0; the blocks are full, so
		// their size is the tokens a block.
		bs = len(ev.TokenIDs) / n
	}
	if bs <= 0 || len(ev.TokenIDs) != n*bs {
		t.stats.badStored.Add(1)
		return out
	}
	var prev uint64
	if kvevents.NoParent(ev.Parent) {
		prev = blockkey.TokenSeed(blockkey.Salt(t.cfg.Model, Adapter(ev), t.cfg.Tenant(ev)))
	} else {
		el, ok := t.find(ev.Parent)
		if !ok {
			// Not keyed from the tokens as a chain of its own: a block's
			// key covers every token before it, and these tokens follow a
			// prefix the event does not carry. Keyed as a first block, they
			// would stand for a prompt that starts with them, which the
			// engine does not hold, and draw such prompts to it.
			t.stats.unknownParent.Add(1)
			return out
		}
		t.lru.moveToFront(el)
		prev = t.lru.at(el).key
	}
	t.blockSize.Store(int64(bs))
	bit, tier, tracked := bitOf(ev.Medium)
	from := len(t.keys)
	t.pending = t.pending[:0]
	for i, h := range ev.BlockHashes {
		if i%warmBatch == 0 {
			t.warmed += t.entries.warm(ev.BlockHashes[i:], nil)
		}
		prev = blockkey.NextTokenKey(prev, ev.TokenIDs[i*bs:(i+1)*bs])
		t.put(h, prev, bit)
		if tracked {
			t.keys = append(t.keys, prev)
		}
	}
	if tracked {
		out = append(out, t.cache(kvindex.Stored, tier, from))
		t.stats.stored.Add(uint64(n))
	} else {
		t.stats.otherMedium.Add(1)
	}
	// Removals of evicted entries follow the store: one of them may be a
	// block this very event stored, when MaxEntries is smaller than it.
	return t.flushPending(out)
}

// put maps h to key in the tier of bit, queueing the removals its evictions
// (or a changed key) call for in t.pending as (bit, key) pairs.
func (t *Translator) put(h kvevents.Hash, key uint64, bit uint8) {
	d := h.Digest()
	if el, ok := t.entries.get(d); ok {
		e := t.lru.at(el)
		if t.lru.is(el, h, d) {
			if e.key != key {
				// The same engine hash on another chain: the old key goes.
				t.queueRemoval(e)
				e.key, e.bits = key, 0
			}
			e.bits |= bit
			t.lru.moveToFront(el)
			return
		}
		// Another hash of the same digest: it goes, as if evicted.
		old := *e
		t.lru.remove(el)
		t.queueRemoval(&old)
	}
	t.entries.set(d, t.lru.pushFront(entry{d: d, key: key, bits: bit}, h))
	for t.lru.n > t.cfg.MaxEntries {
		el := t.lru.tail
		e := *t.lru.at(el)
		t.lru.remove(el)
		t.entries.del(e.d)
		t.queueRemoval(&e)
		t.stats.evicted.Add(1)
	}
}

// find returns the slab index of h's entry.
func (t *Translator) find(h kvevents.Hash) (int32, bool) {
	d := h.Digest()
	el, ok := t.entries.get(d)
	if !ok || !t.lru.is(el, h, d) {
		return 0, false
	}
	return el, true
}

func (t *Translator) queueRemoval(e *entry) {
	for _, b := range [...]uint8{bitGPU, bitCPU} {
		if e.bits&b != 0 {
			t.pending = append(t.pending, uint64(b), e.key)
		}
	}
}

func (t *Translator) flushPending(out []kvindex.Event) []kvindex.Event {
	for i := 0; i < len(t.pending); i += 2 {
		tier := kvindex.TierGPU
		if uint8(t.pending[i]) == bitCPU {
			tier = kvindex.TierCPU
		}
		t.keys = append(t.keys, t.pending[i+1])
		out = append(out, t.cache(kvindex.Removed, tier, len(t.keys)-1))
		t.stats.removed.Add(1)
	}
	t.pending = t.pending[:0]
	return out
}

func (t *Translator) removed(out []kvindex.Event, ev *kvevents.BlockRemoved) []kvindex.Event {
	if ev.HasGroup && ev.Group != t.cfg.Group {
		t.stats.otherGroup.Add(1)
		return out
	}
	bit, tier, tracked := bitOf(ev.Medium)
	if !tracked {
		t.stats.otherMedium.Add(1)
	}
	from := len(t.keys)
	for i, h := range ev.BlockHashes {
		if i%warmBatch == 0 {
			t.warmed += t.entries.warm(ev.BlockHashes[i:], t.lru.slab)
		}
		el, ok := t.find(h)
		if !ok || t.lru.at(el).bits&bit == 0 {
			t.stats.unknownRemoved.Add(1)
			continue
		}
		e := t.lru.at(el)
		e.bits &^= bit
		if tracked {
			t.keys = append(t.keys, e.key)
		}
		if e.bits == 0 {
			d := e.d
			t.lru.remove(el)
			t.entries.del(d)
		}
	}
	if n := len(t.keys) - from; n > 0 {
		out = append(out, t.cache(kvindex.Removed, tier, from))
		t.stats.removed.Add(uint64(n))
	}
	return out
}

// Len returns the number of engine hashes mapped.
func (t *Translator) Len() int { return t.entries.len() }

// Stats returns the translator's counters.
func (t *Translator) Stats() TranslatorStats {
	s := &t.stats
	return TranslatorStats{
		Stored: s.stored.Load(), Removed: s.removed.Load(), Cleared: s.cleared.Load(),
		UnknownParent: s.unknownParent.Load(), UnknownRemoved: s.unknownRemoved.Load(),
		BadStored: s.badStored.Load(), OtherMedium: s.otherMedium.Load(),
		OtherGroup: s.otherGroup.Load(), Evicted: s.evicted.Load(),
	}
}
