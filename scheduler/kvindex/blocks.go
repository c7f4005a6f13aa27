package kvindex

import (
	"math/bits"
	"sync"
	"sync/atomic"
)

// blocks is the block index: for each block key, the worker slots that
// hold it in their GPU and CPU tiers or are predicted to, and whether the
// shared Redis tier holds it. Holders are slot bits (see workers); the
// caller holds the membership's read lock while it uses a slot.
type blocks struct {
	max int // blocks indexed at most

	mu      sync.RWMutex
	t       table
	evicted uint64
	// warmed counts nothing: it consumes table.warm's loads.
	warmed atomic.Uint64
}

func (b *blocks) init(maxBlocks int) {
	b.max = maxBlocks
	b.t.init(maxBlocks)
}

// trim forgets the least recently touched blocks while above the cap.
// b.mu is held.
func (b *blocks) trim() {
	for b.t.n > b.max && b.t.tail != none {
		b.t.remove(b.t.tail)
		b.evicted++
	}
}

// setMax changes the cap (see workers.share). b.mu is held.
func (b *blocks) setMax(maxBlocks int) {
	b.max = maxBlocks
	b.t.fresh = uint32(min(maxBlocks/8, 1<<30))
}

// apply applies one cache event of the worker in slot bit. b.mu is held.
// It takes the keys warmBatch at a time, warming each batch's slots and
// entries first (see table.warm): the keys of an event are scattered over
// the table, and on a table larger than the CPU's caches their misses then
// overlap instead of coming one after the other.
func (b *blocks) apply(bit uint64, ce *CacheEvent) {
	to, from := ce.Tier, ce.From
	for keys := ce.Keys; len(keys) > 0; {
		batch := keys[:min(len(keys), warmBatch)]
		keys = keys[len(batch):]
		if len(batch) > 1 && b.t.warm(batch) == 0x5eed {
			b.warmed.Add(1)
		}
		switch ce.Kind {
		case Stored:
			for _, k := range batch {
				b.set(k, bit, to)
			}
		case Removed:
			for _, k := range batch {
				b.clear(k, bit, to)
			}
		case Moved:
			for _, k := range batch {
				if ce.HasFrom && from != to {
					b.clear(k, bit, from)
				}
				b.set(k, bit, to)
			}
		}
	}
}

// applyChunked is apply taking the lock writeChunk keys at a time. A
// lookup in between sees part of the event applied: a stored chain's
// leading blocks (a prefix like any other), or a removal's first blocks
// gone, which can only shorten the prefix it credits.
func (b *blocks) applyChunked(bit uint64, ce *CacheEvent) {
	part := *ce
	for keys := ce.Keys; len(keys) > 0; {
		part.Keys = keys[:min(len(keys), writeChunk)]
		keys = keys[len(part.Keys):]
		b.mu.Lock()
		b.apply(bit, &part)
		b.mu.Unlock()
	}
}

// set records that the worker of bit holds key in tier, confirming a
// prediction.
func (b *blocks) set(key, bit uint64, tier Tier) {
	e := b.t.at(b.upsert(key))
	switch tier {
	case TierRedis:
		e.flags |= flagRedis
	case TierCPU:
		e.cpu |= bit
		e.pred &^= bit
	default:
		e.gpu |= bit
		e.pred &^= bit
	}
}

// clear records that the worker of bit no longer holds key in tier; for
// Redis, that the shared tier no longer holds it.
func (b *blocks) clear(key, bit uint64, tier Tier) {
	i := b.t.find(key)
	if i == none {
		return
	}
	e := b.t.at(i)
	switch tier {
	case TierRedis:
		e.flags &^= flagRedis
	case TierCPU:
		e.cpu &^= bit
	default:
		e.gpu &^= bit
		e.pred &^= bit
	}
	b.dropIfEmpty(i)
}

// upsert returns key's entry, touched, inserting it (and evicting the
// least recently touched entry if full) if absent.
func (b *blocks) upsert(key uint64) uint32 {
	if i := b.t.find(key); i != none {
		b.t.touch(i)
		return i
	}
	for b.t.n >= b.max && b.t.tail != none {
		b.t.remove(b.t.tail)
		b.evicted++
	}
	return b.t.insert(key)
}

func (b *blocks) dropIfEmpty(i uint32) {
	e := b.t.at(i)
	if e.gpu|e.cpu|e.pred == 0 && e.flags&flagRedis == 0 {
		b.t.remove(i)
	}
}

// clearSlot clears slot's GPU and CPU bits, and its predictions too if
// pred, from every entry. It scans the slab: about a millisecond per
// million blocks. b.mu is held.
func (b *blocks) clearSlot(slot int, pred bool) {
	mask := ^(uint64(1) << slot)
	for i := uint32(0); i < b.t.hi; i++ {
		e := b.t.at(i)
		if e.flags&flagUsed == 0 {
			continue
		}
		e.gpu &= mask
		e.cpu &= mask
		if pred {
			e.pred &= mask
		}
		b.dropIfEmpty(i)
	}
}

// writeChunk is how many keys a write takes the table's lock for at once:
// a lookup waits for at most one chunk (a few µs on a cold table), not a
// whole prompt's hundreds of blocks.
const writeChunk = 64

// predict marks keys as predicted on the worker of bit until until, and
// returns how many of them the worker held in no tier. It marks them from
// the first, writeChunk at a time, so a lookup in between sees a leading
// part of the chain predicted, which is a prefix like any other.
func (b *blocks) predict(keys []uint64, bit uint64, now, until int64) (added int64) {
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), writeChunk)]
		keys = keys[len(chunk):]
		b.mu.Lock()
		for _, k := range chunk {
			e := b.t.at(b.upsert(k))
			if e.predUntil <= now {
				e.pred = 0
			}
			if (e.gpu|e.cpu|e.pred)&bit == 0 {
				added++
			}
			e.pred |= bit
			e.predUntil = until
		}
		b.mu.Unlock()
	}
	return added
}

// holders returns the tiers' sets of the workers in alive holding key at
// now (see Match), Redis only for those in redisOK. b.mu is held.
func (b *blocks) holders(key, alive, redisOK uint64, now int64) (g, c, r uint64) {
	if i := b.t.find(key); i != none {
		e := b.t.at(i)
		g = e.gpu
		if now < e.predUntil {
			g |= e.pred
		}
		g &= alive
		c = e.cpu &^ g & alive
		if e.flags&flagRedis != 0 {
			r = alive &^ (g | c) & redisOK
		}
	}
	return g, c, r
}

// counts are, per slot, the leading blocks found in GPU, CPU and Redis.
type counts [MaxWorkers][3]int32

// walkStride is walk's first leap along a prompt. A worker that holds a
// block holds the blocks before it: engines match cached prefixes block by
// block from the start, so a block past a missing one is of no use, and
// their caches evict a chain from its end (its first blocks are touched
// whenever a later one is). So the holders of a prompt's blocks, tier by
// tier, change only a few times along it, and where the holders of two
// blocks are the same, so are those of every block between. walk gallops:
// from a block it reads the blocks walkStride, 3×walkStride, 7×walkStride…
// ahead while their holders stay the same, then bisects the last leap down
// to walkStride blocks and reads those one by one to find where they
// change. On an index too large for the CPU's caches each
// block read costs a cache miss or two; a prompt of 8,000 tokens has 500
// blocks, and one whose holders do not change costs seven reads.
const walkStride = 8

// walk counts, for the slots in alive, the request's leading blocks found
// in each tier (see Match), Redis only for the slots in redisOK, and
// reports whether any of them holds the first. It holds the read lock and
// does not allocate.
func (b *blocks) walk(keys []uint64, alive, redisOK uint64, now int64, cnt *counts) bool {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.walkLocked(keys, alive, redisOK, now, cnt)
}

// walkLocked is walk with the read lock held.
func (b *blocks) walkLocked(keys []uint64, alive, redisOK uint64, now int64, cnt *counts) bool {
	holders := func(k, alive uint64) (g, c, r uint64) { return b.holders(k, alive, redisOK, now) }
	n := len(keys)
	if n == 0 {
		return false
	}
	// The run from block j has holders g, c, r; a worker that drops out
	// of it never counts again (alive narrows). Most tables of a large
	// fleet's hold none of the first block: one probe for those.
	j := 0
	g, c, r := holders(keys[0], alive)
	if g|c|r == 0 {
		return false
	}
	for g|c|r != 0 {
		alive = g | c | r
		// lo: the last block known to have the run's holders; hi: the
		// first known not to (n: none), whose holders are ng, nc, nr.
		lo, hi := j, n
		var ng, nc, nr uint64
		if b.t.warmGallop(keys, lo, walkStride, false) == 0x5eed {
			b.warmed.Add(1)
		}
		for step := walkStride; lo < n-1; step *= 2 {
			p := min(lo+step, n-1)
			pg, pc, pr := holders(keys[p], alive)
			if pg != g || pc != c || pr != r {
				hi, ng, nc, nr = p, pg, pc, pr
				break
			}
			lo = p
		}
		for hi < n && hi-lo > walkStride {
			if b.t.warmBisect(keys, lo, hi, walkStride) == 0x5eed {
				b.warmed.Add(1)
			}
			for range bisectLevels {
				if hi-lo <= walkStride {
					break
				}
				mid := lo + (hi-lo)/2
				mg, mc, mr := holders(keys[mid], alive)
				if mg == g && mc == c && mr == r {
					lo = mid
				} else {
					hi, ng, nc, nr = mid, mg, mc, mr
				}
			}
		}
		// The last walkStride blocks block by block: exact where a cache
		// has a hole (a block dropped from a tier in mid-chain).
		if hi < n && hi-lo > 1 {
			if b.t.warm(keys[lo+1:hi]) == 0x5eed {
				b.warmed.Add(1)
			}
			for k := lo + 1; k < hi; k++ {
				if kg, kc, kr := holders(keys[k], alive); kg != g || kc != c || kr != r {
					hi, ng, nc, nr = k, kg, kc, kr
					break
				}
			}
		}
		run := int32(hi - j)
		for m := g; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][0] += run
		}
		for m := c; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][1] += run
		}
		for m := r; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][2] += run
		}
		if hi >= n {
			return true
		}
		j, g, c, r = hi, ng, nc, nr
	}
	return true
}
