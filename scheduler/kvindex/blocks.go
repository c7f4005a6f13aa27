package kvindex

import (
	"sync"
	"sync/atomic"
)

// blocks is the block index: for each block key, the workers that hold
// it in their GPU and CPU tiers or are predicted to, and whether the
// shared Redis tier holds it. A worker is a holder: a slot bit of its
// group (see workers); the caller holds the membership's read lock while
// it uses one. The whole fleet shares the table, its lock and its cap.
type blocks struct {
	max int // blocks indexed at most (see over)

	mu      sync.RWMutex
	t       table
	evicted uint64
	// warmed counts nothing: it consumes table.warm's loads.
	warmed atomic.Uint64
	// betweenChunks, for tests, is called between two chunks of
	// clearSlotChunked, the lock not held.
	betweenChunks func()
}

// holder is a worker in the holder sets: its group and its slot's bit.
type holder struct {
	grp uint8
	bit uint64
}

func (b *blocks) init(maxBlocks int) {
	b.max = maxBlocks
	b.t.init(maxBlocks)
}

// over reports whether the table holds more than the cap once extra more
// blocks are added. The cap counts each entry as a block, and each two
// parts of spilled arrays as one more (a part is 32 bytes, an entry 56
// and its slots 10.7 to 21.3), so that the index's memory stays within MaxBlocks ×
// BytesPerBlock or so whatever the fleet's size.
func (b *blocks) over(extra int) bool { return b.t.n+b.t.sp.used/2+extra > b.max }

// trim forgets the least recently touched blocks while above the cap.
// b.mu is held.
func (b *blocks) trim() {
	for b.over(0) && b.t.tail != none {
		b.t.remove(b.t.tail)
		b.evicted++
	}
}

// apply applies one cache event of the worker h. b.mu is held.
// It takes the keys warmBatch at a time, warming each batch's slots and
// entries first (see table.warm): the keys of an event are scattered over
// the table, and on a table larger than the CPU's caches their misses then
// overlap instead of coming one after the other.
func (b *blocks) apply(h holder, ce *CacheEvent) {
	to, from := ce.Tier, ce.From
	for keys := ce.Keys; len(keys) > 0; {
		batch := keys[:min(len(keys), warmBatch)]
		keys = keys[len(batch):]
		if len(batch) > 1 {
			sink, absent := b.t.warmCount(batch)
			// Storing absent keys at the cap evicts as many blocks first
			// (upsert): warm those too.
			if ce.Kind != Removed && absent > 0 && b.over(absent) {
				sink += b.t.warmVictims(b.t.n + b.t.sp.used/2 + absent - b.max)
			}
			if sink == 0x5eed {
				b.warmed.Add(1)
			}
		}
		switch ce.Kind {
		case Stored:
			for _, k := range batch {
				b.set(k, h, to)
			}
		case Removed:
			// Their entries are warm: warm their LRU neighbours too, which
			// removing an entry that no longer holds anything rewrites.
			var idx [warmBatch]uint32
			for j, k := range batch {
				idx[j] = b.t.find(k)
			}
			if b.t.warmLinks(idx[:len(batch)]) == 0x5eed {
				b.warmed.Add(1)
			}
			for j, k := range batch {
				// A key twice in the batch: its entry may be gone.
				if i := idx[j]; i != none && b.t.at(i).key == k && b.t.at(i).flags&flagUsed != 0 {
					b.clearAt(i, h, to)
				}
			}
		case Moved:
			for _, k := range batch {
				if ce.HasFrom && from != to {
					b.clear(k, h, from)
				}
				b.set(k, h, to)
			}
		}
	}
	b.trim()
}

// applyChunked is apply taking the lock writeChunk keys at a time. A
// lookup in between sees part of the event applied: a stored chain's
// leading blocks (a prefix like any other), or a removal's first blocks
// gone, which can only shorten the prefix it credits.
func (b *blocks) applyChunked(h holder, ce *CacheEvent) {
	part := *ce
	for keys := ce.Keys; len(keys) > 0; {
		part.Keys = keys[:min(len(keys), writeChunk)]
		keys = keys[len(part.Keys):]
		b.mu.Lock()
		b.apply(h, &part)
		b.mu.Unlock()
	}
}

// masks returns e's masks of group g for an update, adding them if absent
// and add is set (spilling e, or moving its parts to a larger array); nil
// if absent and not added. b.mu is held.
func (b *blocks) masks(e *entry, g uint8, add bool) *masks {
	if e.grp == g {
		return &e.m
	}
	if e.m == (masks{}) && e.flags&flagSpill == 0 {
		if !add {
			return nil
		}
		e.grp = g
		return &e.m
	}
	var ps []part
	if e.flags&flagSpill != 0 {
		all := b.t.sp.parts(e.class(), e.ext)
		k := 0
		for ; k < len(all) && all[k].grp != noGroup; k++ {
			if all[k].grp == g {
				return &all[k].m
			}
		}
		ps = all[:k]
	}
	if !add {
		return nil
	}
	switch {
	case e.flags&flagSpill == 0:
		e.ext = b.t.sp.alloc(0)
		e.flags |= flagSpill
	case len(ps) == cap(ps):
		class := e.class() + 1
		i := b.t.sp.alloc(class)
		copy(b.t.sp.parts(class, i), ps)
		b.t.sp.release(e.class(), e.ext)
		e.ext, e.flags = i, e.flags&(1<<classShift-1)|uint8(class)<<classShift
	}
	ps = b.t.sp.parts(e.class(), e.ext)[:len(ps)+1]
	p := &ps[len(ps)-1]
	p.grp = g
	return &p.m
}

// compact drops the groups of e that hold nothing, moving a part into the
// entry if its own masks hold nothing, and frees the parts' array once
// empty. b.mu is held.
func (b *blocks) compact(e *entry) {
	if e.flags&flagSpill == 0 {
		return
	}
	ps := b.t.extra(e)
	n := 0
	for _, p := range ps {
		if p.m != (masks{}) {
			ps[n] = p
			n++
		}
	}
	if e.m == (masks{}) && n > 0 {
		n--
		e.m, e.grp = ps[n].m, ps[n].grp
	}
	for k := n; k < len(ps); k++ {
		ps[k] = part{grp: noGroup}
	}
	if n == 0 {
		b.t.sp.release(e.class(), e.ext)
		e.flags &= flagUsed | flagRedis
		e.ext = 0
	}
}

// set records that h holds key in tier, confirming a prediction.
func (b *blocks) set(key uint64, h holder, tier Tier) {
	e := b.t.at(b.upsert(key))
	if tier == TierRedis {
		e.flags |= flagRedis
		return
	}
	m := b.masks(e, h.grp, true)
	if tier == TierCPU {
		m[maskCPU] |= h.bit
	} else {
		m[maskGPU] |= h.bit
	}
	m[maskPred] &^= h.bit
}

// clear records that h no longer holds key in tier; for Redis, that the
// shared tier no longer holds it.
func (b *blocks) clear(key uint64, h holder, tier Tier) {
	if i := b.t.find(key); i != none {
		b.clearAt(i, h, tier)
	}
}

// clearAt is clear of entry i.
func (b *blocks) clearAt(i uint32, h holder, tier Tier) {
	e := b.t.at(i)
	switch tier {
	case TierRedis:
		e.flags &^= flagRedis
	default:
		m := b.masks(e, h.grp, false)
		if m == nil {
			return
		}
		if tier == TierCPU {
			m[maskCPU] &^= h.bit
		} else {
			m[maskGPU] &^= h.bit
			m[maskPred] &^= h.bit
		}
		if *m == (masks{}) {
			b.compact(e)
		}
	}
	b.dropIfEmpty(i)
}

// upsert returns key's entry, touched, inserting it (and evicting the
// least recently touched entries if full) if absent.
func (b *blocks) upsert(key uint64) uint32 {
	if i := b.t.find(key); i != none {
		b.t.touch(i)
		return i
	}
	for b.over(1) && b.t.tail != none {
		b.t.remove(b.t.tail)
		b.evicted++
	}
	return b.t.insert(key)
}

// dropIfEmpty forgets entry i if nothing holds its block.
func (b *blocks) dropIfEmpty(i uint32) {
	e := b.t.at(i)
	if e.flags&(flagSpill|flagRedis) == 0 && e.m == (masks{}) {
		b.t.remove(i)
	}
}

// clearSlot clears h's GPU and CPU bits, and its predictions too if pred,
// from every entry. It scans the slab: about a millisecond per million
// blocks. b.mu is held.
func (b *blocks) clearSlot(h holder, pred bool) { b.clearRange(h, pred, 0, b.t.hi) }

// scanChunk is how many entries clearSlotChunked scans per taking of the
// lock: a lookup waits a millisecond or less, not a scan of the whole
// fleet's table.
const scanChunk = 1 << 16

// clearSlotChunked is clearSlot taking the lock scanChunk entries at a
// time. Only h's own events may set its GPU and CPU bits meanwhile, and
// the caller applies none.
func (b *blocks) clearSlotChunked(h holder, pred bool) {
	for from := uint32(0); ; from += scanChunk {
		b.mu.Lock()
		hi := b.t.hi
		if from < hi {
			b.clearRange(h, pred, from, min(from+scanChunk, hi))
		}
		b.mu.Unlock()
		if from+scanChunk >= hi {
			return
		}
		if f := b.betweenChunks; f != nil {
			f()
		}
	}
}

// clearRange is clearSlot of the entries from up to to. b.mu is held.
func (b *blocks) clearRange(h holder, pred bool, from, to uint32) {
	keep := ^h.bit
	for i := from; i < to; i++ {
		e := b.t.at(i)
		if e.flags&flagUsed == 0 {
			continue
		}
		m := b.masks(e, h.grp, false)
		if m == nil {
			continue
		}
		m[maskGPU] &= keep
		m[maskCPU] &= keep
		if pred {
			m[maskPred] &= keep
		}
		if *m == (masks{}) {
			b.compact(e)
		}
		b.dropIfEmpty(i)
	}
}

// writeChunk is how many keys a write takes the table's lock for at once:
// a lookup waits for at most one chunk (a few µs on a cold table), not a
// whole prompt's hundreds of blocks.
const writeChunk = 64

// predict marks keys as predicted on h until until (Unix nanoseconds), and
// returns how many of them h held in no tier. It marks them from the
// first, writeChunk at a time, so a lookup in between sees a leading part
// of the chain predicted, which is a prefix like any other.
func (b *blocks) predict(keys []uint64, h holder, now, until int64) (added int64) {
	nowMS, untilMS := millis(now), millisUp(until)
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), writeChunk)]
		keys = keys[len(chunk):]
		b.mu.Lock()
		for _, k := range chunk {
			e := b.t.at(b.upsert(k))
			if e.until() <= nowMS {
				b.expire(e)
			}
			m := b.masks(e, h.grp, true)
			if (m[maskGPU]|m[maskCPU]|m[maskPred])&h.bit == 0 {
				added++
			}
			m[maskPred] |= h.bit
			e.setUntil(untilMS)
		}
		b.trim()
		b.mu.Unlock()
	}
	return added
}

// millis returns the Unix milliseconds of Unix nanoseconds ns, rounded
// down; millisUp rounds up, so that a prediction lasts at least its TTL.
func millis(ns int64) int64   { return max(ns, 0) / 1e6 }
func millisUp(ns int64) int64 { return (max(ns, 0) + 1e6 - 1) / 1e6 }

// expire drops e's predictions, which have expired. b.mu is held.
func (b *blocks) expire(e *entry) {
	e.m[maskPred] = 0
	ps := b.t.extra(e)
	for k := range ps {
		ps[k].m[maskPred] = 0
	}
	b.compact(e)
}
