package watch

import (
	"math/bits"

	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// digests maps engine hashes' digests to their entries in the
// translator's slab: open addressing with linear probing in one array of
// slots, so that a lookup reads one cache line or two and an entry costs
// no allocation. Removal shifts the entries that follow back, leaving no
// tombstones. It grows to keep at most 3/4 of its slots used and never
// shrinks: the translator's MaxEntries bounds it.
type digests struct {
	slots []digestSlot // a power of two of them, or none
	shift uint8        // 64 − log2(len(slots))
	n     int
}

type digestSlot struct {
	d  uint64 // the hash's Digest
	el int32  // index in the slab, plus one; 0: the slot is empty
}

const minDigestSlots = 64

// home is d's first slot. Digests of integer hashes are the integers
// themselves, often sequential or aligned: Fibonacci hashing spreads them.
func (t *digests) home(d uint64) int { return int((d * 0x9e3779b97f4a7c15) >> t.shift) }

// get returns the slab index of digest d.
func (t *digests) get(d uint64) (int32, bool) {
	if t.n == 0 {
		return 0, false
	}
	mask := len(t.slots) - 1
	for i := t.home(d); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.el == 0 {
			return 0, false
		}
		if s.d == d {
			return s.el - 1, true
		}
	}
}

// set maps d to the slab index el.
func (t *digests) set(d uint64, el int32) {
	if (t.n+1)*4 > len(t.slots)*3 {
		t.grow()
	}
	mask := len(t.slots) - 1
	for i := t.home(d); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.el == 0 {
			*s = digestSlot{d: d, el: el + 1}
			t.n++
			return
		}
		if s.d == d {
			s.el = el + 1
			return
		}
	}
}

// del unmaps d, if mapped.
func (t *digests) del(d uint64) {
	if t.n == 0 {
		return
	}
	mask := len(t.slots) - 1
	i := t.home(d)
	for ; t.slots[i].d != d; i = (i + 1) & mask {
		if t.slots[i].el == 0 {
			return
		}
	}
	if t.slots[i].el == 0 {
		return
	}
	// Shift back each following entry of the run whose home is not
	// between the hole and it (cyclically): it would not be found past
	// the hole otherwise.
	for j := (i + 1) & mask; t.slots[j].el != 0; j = (j + 1) & mask {
		if h := t.home(t.slots[j].d); (j-h)&mask >= (j-i)&mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = digestSlot{}
	t.n--
}

// warmBatch is how many hashes warm loads at once: enough misses in
// flight to fill the CPU's queue of them.
const warmBatch = 32

// warm loads the home slots of up to warmBatch hashes and, if slab is not
// nil, the entries they map in it and those entries' LRU neighbours,
// which removing them rewrites: the loads of each pass are independent, so
// that on tables larger than the CPU's caches their misses overlap
// instead of coming one after the other. It returns a value of the loads,
// which the caller must keep so that the compiler keeps them.
func (t *digests) warm(hs []kvevents.Hash, slab []entry) uint64 {
	if t.n == 0 {
		return 0
	}
	var els [warmBatch]int32
	hs = hs[:min(len(hs), warmBatch)]
	for j, h := range hs {
		els[j] = t.slots[t.home(h.Digest())].el
	}
	if slab == nil {
		return uint64(els[0] + els[len(hs)-1])
	}
	var sink uint64
	var links [2 * warmBatch]int32
	n := 0
	for _, el := range els[:len(hs)] {
		if el > 0 && int(el) <= len(slab) {
			e := &slab[el-1]
			sink += e.key
			links[n], links[n+1] = e.prev, e.next
			n += 2
		}
	}
	for _, i := range links[:n] {
		if i >= 0 && int(i) < len(slab) {
			sink += slab[i].key
		}
	}
	return sink
}

// len returns the digests mapped.
func (t *digests) len() int { return t.n }

// reset unmaps every digest, keeping the slots.
func (t *digests) reset() {
	clear(t.slots)
	t.n = 0
}

func (t *digests) grow() {
	old := t.slots
	size := max(minDigestSlots, 2*len(old))
	t.slots = make([]digestSlot, size)
	t.shift = uint8(64 - bits.TrailingZeros(uint(size)))
	t.n = 0
	for _, s := range old {
		if s.el != 0 {
			t.set(s.d, s.el-1)
		}
	}
}
