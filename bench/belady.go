package bench

import "math"

// Belady's offline optimum (MIN) over a sequence of block references.
//
// Why it bounds every router, prefix chaining included: a worker's hit on
// a request counts the leading run of its blocks the worker holds in any
// tier. Those blocks are in the union of the fleet's caches, which never
// holds more distinct blocks than the fleet's total capacity and only gains
// a block when some request computes it (a transfer or a shared-tier fetch
// copies a block the union already holds). So the union is one demand-fed
// cache of that capacity seeing the same references, and its hits, counted
// block by block without asking that the run before a block be cached
// too, are at least the fleet's. MIN has the fewest misses of any cache of
// that capacity on that sequence, so its block hits bound the union's.
// The bound lets MIN decline to cache a missed block (bypass), which can
// only raise its hits: it then holds without assuming that an engine keeps
// every block it computes.
// Prefix chaining needs no special case: a key stands for its whole prefix,
// so block i of a chain is always referenced just before block j > i and
// its next use comes strictly sooner; MIN therefore never keeps j while
// evicting i, and its hits on each request form a leading run as the
// engines' do (TestBeladyHitsAreLeadingRuns checks it).
//
// Two qualifications. The sequence is the requests' arrival order; a fleet
// serves requests in flight at once in its own order, so the bound is
// exact for the order caches see requests in, which queueing can permute
// slightly. And MIN counts every hit block as 16 tokens, while the engine
// never reports a prompt's last token as cached: the bound can sit up to
// one token per request above what a perfect router could be credited
// with, which keeps it a bound.

// beladyInf is the next use of a block never referenced again.
const beladyInf = math.MaxInt32

// beladyHits replays refs (block keys, in order) through a cache of
// capacity blocks evicting, on a miss when full, the block whose next use
// is furthest away; with bypass, the missed block itself is not cached if
// its own next use is furthest (otherwise every missed block is cached, as
// in textbook demand paging). It returns whether each reference hit.
// O(n log n) time: the next uses are precomputed and the cache is a
// max-heap on next use with lazily dropped stale entries.
func beladyHits(refs []uint64, capacity int64, bypass bool) []bool {
	n := len(refs)
	hit := make([]bool, n)
	if capacity <= 0 || n == 0 {
		return hit
	}
	// Dense ids, then each reference's next use.
	ids := make([]int32, n)
	var index keyIndex
	for i, k := range refs {
		ids[i] = index.id(k)
	}
	distinct := index.n
	next := make([]int32, n)
	last := make([]int32, distinct)
	for i := range last {
		last[i] = beladyInf
	}
	for i := n - 1; i >= 0; i-- {
		next[i] = last[ids[i]]
		last[ids[i]] = int32(i)
	}
	// cur[id] is the cached block's next use, -1 when not cached. A heap
	// entry (next use, id) is live while cur[id] equals its next use.
	cur := last // reuse: reset to -1
	for i := range cur {
		cur[i] = -1
	}
	h := beladyHeap{}
	var size int64
	for i := 0; i < n; i++ {
		id, nx := ids[i], next[i]
		if cur[id] >= 0 {
			hit[i] = true
			cur[id] = nx
			h.push(nx, id)
			continue
		}
		if size == capacity {
			for {
				top, tid := h.top()
				if cur[tid] == top {
					break
				}
				h.pop() // stale
			}
			top, tid := h.top()
			if bypass && top <= nx {
				continue // the missed block is the one to drop
			}
			h.pop()
			cur[tid] = -1
			size--
		}
		cur[id] = nx
		h.push(nx, id)
		size++
		if len(h) > 4*int(min(capacity, int64(distinct)))+1024 {
			h.compact(cur)
		}
	}
	return hit
}

// beladyHeap is a max-heap of (next use, id) packed in a uint64, next use
// in the high half so the packed order is the next-use order.
type beladyHeap []uint64

func (h *beladyHeap) push(next, id int32) {
	*h = append(*h, uint64(uint32(next))<<32|uint64(uint32(id)))
	s := *h
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 2
		if s[p] >= s[i] {
			break
		}
		s[p], s[i] = s[i], s[p]
		i = p
	}
}

func (h beladyHeap) top() (next, id int32) {
	return int32(h[0] >> 32), int32(uint32(h[0]))
}

func (h *beladyHeap) pop() {
	s := *h
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	*h = s
	h.down(0)
}

func (h beladyHeap) down(i int) {
	n := len(h)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		c := l
		if r := l + 1; r < n && h[r] > h[l] {
			c = r
		}
		if h[i] >= h[c] {
			return
		}
		h[i], h[c] = h[c], h[i]
		i = c
	}
}

// compact drops stale entries and re-heapifies, so the heap stays within a
// few times the cache's size however many hits refresh entries.
func (h *beladyHeap) compact(cur []int32) {
	s := (*h)[:0]
	for _, e := range *h {
		if cur[int32(uint32(e))] == int32(e>>32) {
			s = append(s, e)
		}
	}
	*h = s
	for i := len(s)/2 - 1; i >= 0; i-- {
		s.down(i)
	}
}

// keyIndex numbers distinct block keys 0, 1, ... in order of first sight:
// open addressing on the key itself (keys are already hashes), several
// times faster than a map at millions of keys.
type keyIndex struct {
	keys []uint64
	ids  []int32 // id+1; 0: empty slot
	n    int
}

func (x *keyIndex) id(k uint64) int32 {
	if 2*(x.n+1) > len(x.keys) {
		x.grow()
	}
	mask := uint64(len(x.keys) - 1)
	for i := k & mask; ; i = (i + 1) & mask {
		switch {
		case x.ids[i] == 0:
			x.keys[i], x.ids[i] = k, int32(x.n+1)
			x.n++
			return int32(x.n - 1)
		case x.keys[i] == k:
			return x.ids[i] - 1
		}
	}
}

func (x *keyIndex) grow() {
	keys, ids := x.keys, x.ids
	size := max(1024, 2*len(keys))
	x.keys, x.ids = make([]uint64, size), make([]int32, size)
	mask := uint64(size - 1)
	for j, id := range ids {
		if id == 0 {
			continue
		}
		i := keys[j] & mask
		for x.ids[i] != 0 {
			i = (i + 1) & mask
		}
		x.keys[i], x.ids[i] = keys[j], id
	}
}
