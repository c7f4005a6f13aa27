package kvindex

import "math/bits"

// A fleet of more than MaxWorkers workers keeps its blocks in several
// groups' tables. walkGroups walks a prompt once for all of them rather
// than once per table: it reads each block it visits in every table whose
// workers still hold the prompt, those reads independent of one another so
// that their cache misses overlap, and it visits the blocks where the
// holders change in any table, as walk does for one. A prompt whose
// holders change at every block (a short one, held by many workers to
// different lengths) costs one round of misses a block, not one per table
// and block.

// walkGroup is one table a walk reads and what it knows of it.
type walkGroup struct {
	grp            *group
	b              *blocks
	alive, redisOK uint64 // the workers looked up, and those reading Redis
	cnt            *counts
	held           uint64 // set by the walk: the workers holding the first block, the only ones counted
	g, c, r        uint64 // the current run's holders by tier
	pg, pc, pr     uint64 // the holders of the block just probed
}

// probe reads key in the groups live of gs into their pg, pc, pr, and
// reports whether any group's differ from its run's (g, c, r). It loads
// every group's slot, then every entry found, before the finds that use
// them.
func probe(gs []walkGroup, live []uint8, key uint64, now int64) (changed bool) {
	var idx [maxGroups]uint32
	for j, k := range live {
		t := &gs[k].b.t
		idx[j] = t.slots[t.home(key)]
	}
	var sink uint64
	for j, k := range live {
		if v := idx[j]; v != 0 {
			sink += gs[k].b.t.at(v - 1).key
		}
	}
	for _, k := range live {
		w := &gs[k]
		w.pg, w.pc, w.pr = w.b.holders(key, w.alive, w.redisOK, now)
		changed = changed || w.pg != w.g || w.pc != w.c || w.pr != w.r
	}
	if sink == 0x5eed {
		gs[0].b.warmed.Add(1)
	}
	return changed
}

// walkGroups counts, for each group of gs, the request's leading blocks
// its workers in alive find in each tier, as walk does for one table,
// into its counts, which must be zero but for workers outside held. The
// caller holds the membership's read lock; walkGroups takes each table's
// read lock, in the groups' order. It does not allocate.
func walkGroups(gs []walkGroup, keys []uint64, now int64) {
	n := len(keys)
	if n == 0 || len(gs) == 0 {
		return
	}
	for k := range gs {
		gs[k].b.mu.RLock()
	}
	defer func() {
		for k := range gs {
			gs[k].b.mu.RUnlock()
		}
	}()
	// live are the groups some of whose workers still hold the prompt:
	// those holding none of the first block drop out at once.
	var buf [maxGroups]uint8
	live := buf[:len(gs)]
	for k := range live {
		live[k] = uint8(k)
	}
	probe(gs, live, keys[0], now)
	live = narrow(gs, live)
	for _, k := range live {
		gs[k].held = gs[k].alive
	}
	if len(live) == 1 {
		// One table holds the prompt (a prefix few workers hold): its own
		// walk, which warms the blocks it will read ahead of reading them.
		w := &gs[live[0]]
		w.b.walkLocked(keys, w.held, w.redisOK, now, w.cnt)
		return
	}
	j := 0
	for len(live) > 0 {
		// lo: the last block known to have the run's holders; hi: the
		// first known not to (n: none).
		lo, hi := j, n
		for step := walkStride; lo < n-1; step *= 2 {
			p := min(lo+step, n-1)
			if probe(gs, live, keys[p], now) {
				hi = p
				break
			}
			lo = p
		}
		// Bisect, then the last walkStride blocks one by one: exact where
		// a cache has a hole.
		for hi < n && hi-lo > walkStride {
			mid := lo + (hi-lo)/2
			if probe(gs, live, keys[mid], now) {
				hi = mid
			} else {
				lo = mid
			}
		}
		for k := lo + 1; hi < n && k < hi; k++ {
			if probe(gs, live, keys[k], now) {
				hi = k
				break
			}
		}
		run := int32(hi - j)
		for _, k := range live {
			w := &gs[k]
			for m := w.g; m != 0; m &= m - 1 {
				w.cnt[bits.TrailingZeros64(m)][0] += run
			}
			for m := w.c; m != 0; m &= m - 1 {
				w.cnt[bits.TrailingZeros64(m)][1] += run
			}
			for m := w.r; m != 0; m &= m - 1 {
				w.cnt[bits.TrailingZeros64(m)][2] += run
			}
		}
		if hi >= n {
			return
		}
		// The holders of block hi, where the next run starts (a later
		// probe may have read another block since).
		probe(gs, live, keys[hi], now)
		j = hi
		live = narrow(gs, live)
	}
}

// narrow makes the probed holders of each group of live its run's, the
// workers that dropped out no longer looked at, and returns the groups
// left with any, in order, in place.
func narrow(gs []walkGroup, live []uint8) []uint8 {
	out := live[:0]
	for _, k := range live {
		w := &gs[k]
		w.g, w.c, w.r = w.pg, w.pc, w.pr
		w.alive = w.g | w.c | w.r
		if w.alive != 0 {
			out = append(out, k)
		}
	}
	return out
}
