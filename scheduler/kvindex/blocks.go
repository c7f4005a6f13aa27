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

// apply applies one cache event of the worker in slot bit. b.mu is held.
func (b *blocks) apply(bit uint64, ce *CacheEvent) {
	to, from := ce.Tier, ce.From
	switch ce.Kind {
	case Stored:
		for _, k := range ce.Keys {
			b.set(k, bit, to)
		}
	case Removed:
		for _, k := range ce.Keys {
			b.clear(k, bit, to)
		}
	case Moved:
		for _, k := range ce.Keys {
			if ce.HasFrom && from != to {
				b.clear(k, bit, from)
			}
			b.set(k, bit, to)
		}
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

// predict marks keys as predicted on the worker of bit until until, and
// returns how many of them the worker held in no tier.
func (b *blocks) predict(keys []uint64, bit uint64, now, until int64) (added int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, k := range keys {
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
	return added
}

// counts are, per slot, the leading blocks found in GPU, CPU and Redis.
type counts [MaxWorkers][3]int32

// walkStride is how far walk leaps along a long prompt. A worker that
// holds a block holds the blocks before it: engines match cached prefixes
// block by block from the start, so a block past a missing one is of no
// use, and their caches evict a chain from its end (its first blocks are
// touched whenever a later one is). So where the holders of two blocks
// walkStride apart are the same, so are the holders of every block
// between, and walk credits them without reading them; it reads block by
// block only where the holders change. On an index too large for the CPU's
// caches each block read costs a cache miss or two, and a prompt of 8,000
// tokens has 500 blocks.
const walkStride = 8

// walk counts, for the slots in alive, the request's leading blocks found
// in each tier (see Match), Redis only for the slots in redisOK. It holds
// the read lock and does not allocate.
func (b *blocks) walk(keys []uint64, alive, redisOK uint64, now int64, cnt *counts) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	// holders returns the tiers' sets of the workers in alive holding key.
	holders := func(k, alive uint64) (g, c, r uint64) {
		if i := b.t.find(k); i != none {
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
	// Walk the keys, keeping per tier the set of workers whose leading
	// run of blocks continues in that tier. Runs of keys with the same
	// sets are credited at once when the sets change, so the cost is per
	// key plus per change, not per key and worker.
	var runG, runC, runR uint64
	var run int32
	flush := func() {
		for m := runG; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][0] += run
		}
		for m := runC; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][1] += run
		}
		for m := runR; m != 0; m &= m - 1 {
			cnt[bits.TrailingZeros64(m)][2] += run
		}
	}
	// step credits key k to the runs; false when no worker holds it.
	step := func(k uint64) bool {
		g, c, r := holders(k, alive)
		if g != runG || c != runC || r != runR {
			flush()
			runG, runC, runR, run = g, c, r, 0
		}
		run++
		alive = g | c | r
		return alive != 0
	}
	warmed := 0 // keys before it were warmed
	for j := 0; j < len(keys); {
		if j >= warmed {
			if b.t.warmStrided(keys[j:], walkStride) == 0x5eed {
				b.warmed.Add(1)
			}
			warmed = j + warmBatch*walkStride
		}
		if !step(keys[j]) {
			break
		}
		j++
		end := j + walkStride - 1
		if end >= len(keys) {
			continue
		}
		// Leap when the block walkStride-1 ahead has the same holders.
		if g, c, r := holders(keys[end], alive); g == runG && c == runC && r == runR {
			run += walkStride
			j = end + 1
			continue
		}
		// The holders change within the leap: read it block by block.
		if b.t.warm(keys[j:end]) == 0x5eed {
			b.warmed.Add(1)
		}
		for ; j < end; j++ {
			if !step(keys[j]) {
				flush()
				return
			}
		}
	}
	flush()
}
