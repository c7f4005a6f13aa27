package kvindex

// The block table: an open-addressing hash table of uint32 entry indexes
// over a slab of fixed-size entries, with an intrusive LRU list, and a
// slab of parts for the blocks held in several groups (see part). No entry
// nor part holds a pointer, so the garbage collector never scans the
// slabs, and the memory per block is the entry (entrySize) plus 10.7 to
// 21.3 bytes of table (8-byte slots at a load factor between 3/8 and 3/4),
// plus its parts' for a block held in several groups.

import (
	"math/bits"
)

// entry is one indexed block: which workers hold it in GPU and CPU, which
// are predicted to hold it (and until when), and whether the shared Redis
// tier holds it. Its holders of one group (the usual block, and every
// block of a fleet of MaxWorkers at most) are masks of that group's slots
// in the entry itself; a block held in several groups is spilled: the
// masks of its further groups, a part each, sit in an array of the part
// slab that ext locates.
type entry struct {
	key     uint64
	m       masks  // of group grp
	prev    uint32 // LRU neighbours (towards the head: more recent)
	next    uint32 // also the free-list link of a free entry
	stamp   uint32 // table.tick when last moved to the head
	ext     uint32 // spilled: the parts' array, of size class flags>>classShift
	untilLo uint32 // the predictions' expiry (see until), for every group's
	untilHi uint16
	grp     uint8
	flags   uint8
}

// masks are one group's holders of a block: bit i for slot i.
type masks [3]uint64

// Masks.
const (
	maskGPU  = iota // holds the block in its GPU tier
	maskCPU         // in its CPU tier
	maskPred        // is predicted to hold it in GPU, while now < the entry's until
)

const (
	flagUsed   = 1 << iota // the entry holds a block (else it is free)
	flagRedis              // the shared Redis tier holds the block
	flagSpill              // further groups' masks are in ext's parts
	classShift = 4         // flags>>classShift: ext's size class
)

// until returns the predictions' expiry, in Unix milliseconds (48 bits:
// an entry has no room for nanoseconds).
func (e *entry) until() int64 { return int64(e.untilHi)<<32 | int64(e.untilLo) }

func (e *entry) setUntil(ms int64) { e.untilHi, e.untilLo = uint16(ms>>32), uint32(ms) }

// class returns the size class of ext.
func (e *entry) class() int { return int(e.flags >> classShift) }

// part is a spilled block's masks of one group beyond the entry's.
type part struct {
	m   masks
	grp uint8 // noGroup: unused, as are the parts after it
}

const noGroup = 0xff

// partSize is the size of a part in the slab, in bytes.
const partSize = 32

// Spilled blocks' parts sit in arrays of 1, 2, 4 … 64 parts (spillClasses
// sizes), each size in its own chunked slab with its own free list, so
// that an array never straddles a chunk and a freed one is reused whole.
// A block gaining a group past its array's size moves to the next size.
const spillClasses = 7

// spill is the part slabs.
type spill struct {
	class [spillClasses]struct {
		chunks [][]part
		hi     uint32 // arrays ever allocated
		free   uint32 // head of the free list (in the first part's masks), or none
	}
	used int // parts in the arrays in use, whether holding a group or not
}

// parts returns the array i of class.
func (sp *spill) parts(class int, i uint32) []part {
	size := uint32(1) << class
	off := i << class
	c := sp.class[class].chunks[off>>chunkBits]
	off &= chunkMask
	return c[off : off+size : off+size]
}

// alloc returns a free array of class's size, every part unused.
func (sp *spill) alloc(class int) uint32 {
	c := &sp.class[class]
	sp.used += 1 << class
	i := c.free
	if i != none {
		c.free = uint32(sp.parts(class, i)[0].m[0])
	} else {
		i = c.hi
		if (i<<class)&chunkMask == 0 {
			c.chunks = append(c.chunks, make([]part, 1<<chunkBits))
		}
		c.hi++
	}
	ps := sp.parts(class, i)
	for k := range ps {
		ps[k] = part{grp: noGroup}
	}
	return i
}

// release frees the array i of class.
func (sp *spill) release(class int, i uint32) {
	c := &sp.class[class]
	sp.used -= 1 << class
	sp.parts(class, i)[0] = part{m: masks{uint64(c.free)}, grp: noGroup}
	c.free = i
}

// extra returns e's parts in use (none unless spilled).
func (t *table) extra(e *entry) []part {
	if e.flags&flagSpill == 0 {
		return nil
	}
	ps := t.sp.parts(e.class(), e.ext)
	for k := range ps {
		if ps[k].grp == noGroup {
			return ps[:k]
		}
	}
	return ps
}

// entrySize is the size of an entry in the slab, in bytes.
const entrySize = 56

const (
	none      = ^uint32(0) // no entry
	chunkBits = 16         // entries per slab chunk: 65,536 (3.5 MiB)
	chunkMask = 1<<chunkBits - 1
	minTable  = 1 << 10
)

// table maps block keys to entries. It is not safe for concurrent use: the
// Index guards it.
//
// A slot holds, besides its entry's index, the top 32 bits of its key's
// hash (its tag), whose leading bits are the slot's home (the table has
// fewer than 2³² slots: its entries' indexes are 32-bit). A probe reads an
// entry only when the tags agree (keys of different homes never do, keys
// of the same home by one chance in 2^(32−log2(len(slots)))), a key not
// indexed reads none, and a removal's backward shift and growing read
// slots alone. The tags make a long probe run cheap (8-byte slots, eight
// to a cache line), so the table fills to 3/4 before it doubles.
type table struct {
	slots  []uint64 // 0: empty; otherwise tag<<32 | entry index + 1
	shift  uint     // 64 - log2(len(slots))
	chunks [][]entry
	n      int    // entries in use
	hi     uint32 // entries ever allocated (the slab's high-water mark)
	free   uint32 // head of the free list, or none
	head   uint32 // most recently touched, or none
	tail   uint32 // least recently touched, or none
	// tick counts moves to the head. An entry moved there at stamp is at
	// most tick−stamp places from it, so touch leaves entries fresher than
	// fresh where they are: eviction stays least-recently-touched but for
	// the freshest eighth, which it never reaches, and a hot request's
	// blocks cost no list surgery.
	tick  uint32
	fresh uint32
	sp    spill
}

func (t *table) init(maxBlocks int) {
	t.fresh = uint32(min(maxBlocks/8, 1<<30))
	t.slots = make([]uint64, minTable)
	t.shift = 64 - uint(bits.TrailingZeros(minTable))
	t.free, t.head, t.tail = none, none, none
	for c := range t.sp.class {
		t.sp.class[c].free = none
	}
}

// at returns entry i.
func (t *table) at(i uint32) *entry { return &t.chunks[i>>chunkBits][i&chunkMask] }

// hash is key's hash (Fibonacci hashing, so that keys that are not random
// still spread): its top bits are the key's home and its tag.
func hash(key uint64) uint64 { return key * 0x9e3779b97f4a7c15 }

// home returns the preferred slot of key.
func (t *table) home(key uint64) uint64 { return hash(key) >> t.shift }

// slotHome returns the home of the key of the slot value v, from its tag.
func (t *table) slotHome(v uint64) uint64 { return v >> t.shift }

// tagOf returns the tag bits of a slot value: v with the index cleared.
func tagOf(v uint64) uint64 { return v &^ (1<<32 - 1) }

// find returns the index of key's entry, or none.
func (t *table) find(key uint64) uint32 {
	h := hash(key)
	mask := uint64(len(t.slots) - 1)
	tag := tagOf(h)
	for s := h >> t.shift; ; s = (s + 1) & mask {
		v := t.slots[s]
		if v == 0 {
			return none
		}
		if tagOf(v) == tag {
			if i := uint32(v) - 1; t.at(i).key == key {
				return i
			}
		}
	}
}

// probe returns the entry index of the first slot of key's probe run whose
// tag is key's (none if there is none before an empty slot or past n
// slots): the entry find would read first.
func (t *table) probe(key uint64, n int) uint32 {
	h := hash(key)
	mask := uint64(len(t.slots) - 1)
	tag := tagOf(h)
	for s, r := h>>t.shift, 0; r < n; s, r = (s+1)&mask, r+1 {
		v := t.slots[s]
		if v == 0 {
			break
		}
		if tagOf(v) == tag {
			return uint32(v) - 1
		}
	}
	return none
}

// warmBatch is how many keys warm loads at once: about the misses a core
// keeps in flight.
const warmBatch = 16

// warm loads the slots, then the entries, of up to warmBatch keys (and a
// spilled entry's first parts), so that their finds that follow hit the
// cache. The loads of each pass are independent, so the CPU overlaps their
// cache misses instead of taking them one by one; on a large index this
// makes a cold lookup several times faster. It returns a value derived
// from the loads, which the caller must use so that the compiler keeps
// them.
func (t *table) warm(keys []uint64) uint64 {
	sink, _ := t.warmCount(keys)
	return sink
}

// warmCount is warm, also returning how many of the keys have no entry
// whose tag is theirs: keys not indexed, that storing would add.
func (t *table) warmCount(keys []uint64) (sink uint64, absent int) {
	var idx [warmBatch]uint32
	keys = keys[:min(len(keys), warmBatch)]
	for _, k := range keys {
		sink += t.slots[t.home(k)]
	}
	for j, k := range keys {
		if idx[j] = t.probe(k, warmRun); idx[j] == none {
			absent++
		}
	}
	return sink + t.warmEntries(idx[:len(keys)]), absent
}

// warmVictims loads the entries of the n least recently touched blocks,
// walking the LRU list from its tail, then their slots at once, so that
// evicting them does not wait for each slot's cache miss in turn.
func (t *table) warmVictims(n int) uint64 {
	var victims [warmBatch]uint32
	k := 0
	for i := t.tail; i != none && k < min(n, warmBatch); i = t.at(i).prev {
		victims[k] = i
		k++
	}
	var sink uint64
	for _, i := range victims[:k] {
		sink += t.slots[t.home(t.at(i).key)]
	}
	return sink
}

// warmAt is warm over the keys at positions pos (at most warmBatch).
func (t *table) warmAt(keys []uint64, pos []int) uint64 {
	var idx [warmBatch]uint32
	pos = pos[:min(len(pos), warmBatch)]
	var sink uint64
	for _, p := range pos {
		sink += t.slots[t.home(keys[p])]
	}
	for j, p := range pos {
		idx[j] = t.probe(keys[p], warmRun)
	}
	return sink + t.warmEntries(idx[:len(pos)])
}

// warmEntries is warm's loads of the entries idx (none: absent), then of
// the spilled ones' parts.
func (t *table) warmEntries(idx []uint32) uint64 {
	var sink uint64
	var spilled [warmBatch]*entry
	n := 0
	for _, i := range idx {
		if i != none {
			e := t.at(i)
			sink += e.key
			if e.flags&flagSpill != 0 {
				spilled[n] = e
				n++
			}
		}
	}
	for _, e := range spilled[:n] {
		sink += t.sp.parts(e.class(), e.ext)[0].m[0]
	}
	return sink
}

// warmLinks loads the LRU neighbours of the entries idx (none: absent),
// as warm does their entries.
func (t *table) warmLinks(idx []uint32) uint64 {
	var sink uint64
	for _, i := range idx {
		if i == none {
			continue
		}
		e := t.at(i)
		if e.prev != none {
			sink += uint64(t.at(e.prev).stamp)
		}
		if e.next != none {
			sink += uint64(t.at(e.next).stamp)
		}
	}
	return sink
}

// warmRun bounds the slots of a probe run warm searches for a key's tag:
// the slots of a cache line or two.
const warmRun = 16

// warmGallop is warm over the keys walk's gallop from lo reads first:
// those at lo+stride, lo+3×stride, lo+7×stride… and the last; and lo's
// own if self.
func (t *table) warmGallop(keys []uint64, lo, stride int, self bool) uint64 {
	var pos [warmBatch]int
	n := 0
	if self {
		pos[0], n = lo, 1
	}
	for step := stride; lo < len(keys)-1 && n < warmBatch; step *= 2 {
		lo = min(lo+step, len(keys)-1)
		pos[n] = lo
		n++
	}
	return t.warmAt(keys, pos[:n])
}

// bisectLevels is how many steps of walk's bisection one warmBisect
// covers: 1+2+4+8 = 15 keys, within warmBatch.
const bisectLevels = 4

// warmBisect is warm over every key the next bisectLevels steps of walk's
// bisection of (lo, hi) may read (bisectKeys): the bisection reads one of
// each level's, which depends on the last read, so warming them all at
// once pays one round of cache misses for bisectLevels steps.
func (t *table) warmBisect(keys []uint64, lo, hi, stride int) uint64 {
	var pos [warmBatch]int
	return t.warmAt(keys, pos[:bisectKeys(lo, hi, stride, &pos)])
}

// bisectKeys puts into pos the positions a bisection of (lo, hi) down to
// spans of stride may read in its next bisectLevels steps, level by
// level, and returns how many.
func bisectKeys(lo, hi, stride int, pos *[warmBatch]int) int {
	var spans, next [1 << (bisectLevels - 1)][2]int
	spans[0] = [2]int{lo, hi}
	ns, n := 1, 0
	for range bisectLevels {
		nn := 0
		for _, sp := range spans[:ns] {
			if sp[1]-sp[0] <= stride {
				continue
			}
			mid := sp[0] + (sp[1]-sp[0])/2
			pos[n] = mid
			n++
			if nn+2 <= len(next) {
				next[nn], next[nn+1] = [2]int{sp[0], mid}, [2]int{mid, sp[1]}
				nn += 2
			}
		}
		spans, ns = next, nn
	}
	return n
}

// insert adds an entry for key, which must be absent, at the head of the
// LRU list, and returns its index. The caller evicts first if full.
func (t *table) insert(key uint64) uint32 {
	if (t.n+1)*4 > len(t.slots)*3 {
		t.grow()
	}
	var i uint32
	if t.free != none {
		i = t.free
		t.free = t.at(i).next
	} else {
		i = t.hi
		if i&chunkMask == 0 {
			t.chunks = append(t.chunks, make([]entry, 1<<chunkBits))
		}
		t.hi++
	}
	e := t.at(i)
	*e = entry{key: key, flags: flagUsed, prev: none, next: none}
	t.place(key, i)
	t.pushFront(i)
	t.n++
	return i
}

// place puts entry i for key into the first empty slot of its probe chain.
func (t *table) place(key uint64, i uint32) { t.put(tagOf(hash(key)) | uint64(i+1)) }

// put puts the slot value v into the first empty slot of its probe chain.
func (t *table) put(v uint64) {
	mask := uint64(len(t.slots) - 1)
	s := t.slotHome(v)
	for t.slots[s] != 0 {
		s = (s + 1) & mask
	}
	t.slots[s] = v
}

// grow doubles the slot array and reinserts every slot value: its tag
// holds its new home.
func (t *table) grow() {
	old := t.slots
	t.slots = make([]uint64, 2*len(old))
	t.shift--
	for _, v := range old {
		if v != 0 {
			t.put(v)
		}
	}
}

// remove deletes entry i from the table, the LRU list and the slab.
func (t *table) remove(i uint32) {
	e := t.at(i)
	mask := uint64(len(t.slots) - 1)
	s := t.home(e.key)
	for uint32(t.slots[s]) != i+1 {
		s = (s + 1) & mask
	}
	// Backward-shift deletion: move later members of the probe chain
	// into the hole when their home allows it.
shift:
	for {
		t.slots[s] = 0
		j := s
		for {
			j = (j + 1) & mask
			v := t.slots[j]
			if v == 0 {
				break shift
			}
			h := t.slotHome(v)
			// v may move to s if its home is not cyclically in (s, j].
			if (j > s && (h <= s || h > j)) || (j < s && h <= s && h > j) {
				t.slots[s] = v
				s = j
				break
			}
		}
	}
	t.unlink(i)
	if e.flags&flagSpill != 0 {
		t.sp.release(e.class(), e.ext)
	}
	*e = entry{next: t.free}
	t.free = i
	t.n--
}

// touch moves entry i to the head of the LRU list.
func (t *table) touch(i uint32) {
	if t.head == i || t.tick-t.at(i).stamp < t.fresh {
		return
	}
	t.unlink(i)
	t.pushFront(i)
}

func (t *table) pushFront(i uint32) {
	e := t.at(i)
	e.prev, e.next, e.stamp = none, t.head, t.tick
	t.tick++
	if t.head != none {
		t.at(t.head).prev = i
	}
	t.head = i
	if t.tail == none {
		t.tail = i
	}
}

func (t *table) unlink(i uint32) {
	e := t.at(i)
	if e.prev != none {
		t.at(e.prev).next = e.next
	} else {
		t.head = e.next
	}
	if e.next != none {
		t.at(e.next).prev = e.prev
	} else {
		t.tail = e.prev
	}
	e.prev, e.next = none, none
}
