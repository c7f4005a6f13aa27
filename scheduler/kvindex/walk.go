package kvindex

import "math/bits"

// counts are, per slot of a group, the leading blocks found in GPU, CPU
// and Redis.
type counts [MaxWorkers][3]int32

// walkGroup is what a walk knows of one group's workers.
type walkGroup struct {
	alive, redisOK uint64 // the workers looked up (narrowed to the run's holders), and those reading Redis
	held           uint64 // set by the walk: the workers holding the first block, the only ones counted
	g, c, r        uint64 // the current run's holders by tier
	pg, pc, pr     uint64 // the holders of the block just probed
}

// walkState is a walk's working memory: by group, its workers and their
// counts. Its counts are zero but for the held workers of a walk.
type walkState struct {
	g     [maxGroups]walkGroup
	cnt   [maxGroups]counts
	buf   [maxGroups]uint8
	live  []uint8 // the groups some of whose workers still hold the prompt
	nowMS int64   // the walk's time, in Unix milliseconds (see entry.until)
}

// reset readies ws for a walk over the first n groups, whose workers the
// caller then adds to alive and redisOK.
func (ws *walkState) reset(n int) {
	clear(ws.g[:n])
	ws.live = ws.buf[:0]
}

// start makes the groups with workers in alive the live ones.
func (ws *walkState) start(n int) {
	ws.live = ws.buf[:0]
	for k := range n {
		if ws.g[k].alive != 0 {
			ws.live = append(ws.live, uint8(k))
		}
	}
}

// probe reads key's holders among the live groups' workers into their
// pg, pc, pr, and reports whether any group's differ from its run's (g,
// c, r). b.mu is held.
func (b *blocks) probe(ws *walkState, key uint64) (changed bool) {
	for _, k := range ws.live {
		w := &ws.g[k]
		w.pg, w.pc, w.pr = 0, 0, 0
	}
	if i := b.t.find(key); i != none {
		e := b.t.at(i)
		predOK := ws.nowMS < e.until()
		ws.add(e.grp, &e.m, predOK)
		if e.flags&flagSpill != 0 {
			ps := b.t.sp.parts(e.class(), e.ext)
			for k := 0; k < len(ps) && ps[k].grp != noGroup; k++ {
				ws.add(ps[k].grp, &ps[k].m, predOK)
			}
		}
		if e.flags&flagRedis != 0 {
			for _, k := range ws.live {
				w := &ws.g[k]
				w.pr = w.alive &^ (w.pg | w.pc) & w.redisOK
			}
		}
	}
	for _, k := range ws.live {
		w := &ws.g[k]
		changed = changed || w.pg != w.g || w.pc != w.c || w.pr != w.r
	}
	return changed
}

// add records holders of group grp for probe (see Match for the tiers).
func (ws *walkState) add(grp uint8, m *masks, predOK bool) {
	w := &ws.g[grp]
	if w.alive == 0 {
		return
	}
	g := m[maskGPU]
	if predOK {
		g |= m[maskPred]
	}
	w.pg = g & w.alive
	w.pc = m[maskCPU] &^ w.pg & w.alive
}

// narrow makes the probed holders of each live group its run's, the
// workers that dropped out no longer looked at, and leaves live the
// groups left with any, in order.
func (ws *walkState) narrow() {
	out := ws.live[:0]
	for _, k := range ws.live {
		w := &ws.g[k]
		w.g, w.c, w.r = w.pg, w.pc, w.pr
		w.alive = w.g | w.c | w.r
		if w.alive != 0 {
			out = append(out, k)
		}
	}
	ws.live = out
}

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

// walk counts, for the workers in the live groups of ws, the request's
// leading blocks found in each tier (see Match) into ws.cnt, Redis only
// for those in redisOK, and sets each group's held. One read of a block
// gives its holders in every group: a fleet of any size costs a walk of
// one table. It holds the read lock and does not allocate.
func (b *blocks) walk(ws *walkState, keys []uint64, now int64) {
	ws.nowMS = millis(now)
	b.mu.RLock()
	defer b.mu.RUnlock()
	n := len(keys)
	if n == 0 || len(ws.live) == 0 {
		return
	}
	// The run from block j has holders g, c, r by group; a worker that
	// drops out of it never counts again (alive narrows). Most prompts'
	// first block is held by few workers or none: one probe for those.
	b.probe(ws, keys[0])
	ws.narrow()
	for _, k := range ws.live {
		ws.g[k].held = ws.g[k].alive
	}
	j := 0
	for len(ws.live) > 0 {
		// lo: the last block known to have the run's holders; hi: the
		// first known not to (n: none).
		lo, hi := j, n
		if b.t.warmGallop(keys, lo, walkStride, false) == 0x5eed {
			b.warmed.Add(1)
		}
		for step := walkStride; lo < n-1; step *= 2 {
			p := min(lo+step, n-1)
			if b.probe(ws, keys[p]) {
				hi = p
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
				if b.probe(ws, keys[mid]) {
					hi = mid
				} else {
					lo = mid
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
				if b.probe(ws, keys[k]) {
					hi = k
					break
				}
			}
		}
		run := int32(hi - j)
		for _, k := range ws.live {
			w, cnt := &ws.g[k], &ws.cnt[k]
			for m := w.g; m != 0; m &= m - 1 {
				cnt[bits.TrailingZeros64(m)][0] += run
			}
			for m := w.c; m != 0; m &= m - 1 {
				cnt[bits.TrailingZeros64(m)][1] += run
			}
			for m := w.r; m != 0; m &= m - 1 {
				cnt[bits.TrailingZeros64(m)][2] += run
			}
		}
		if hi >= n {
			return
		}
		// The holders of block hi, where the next run starts (a later
		// probe may have read another block since).
		b.probe(ws, keys[hi])
		j = hi
		ws.narrow()
	}
}
