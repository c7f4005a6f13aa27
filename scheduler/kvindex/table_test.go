package kvindex

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// The keys warmBisect loads are every key the next bisectLevels steps of
// walk's bisection can read, whichever way each step goes.
func TestBisectKeysCoverEveryPath(t *testing.T) {
	for _, span := range [][2]int{{0, 9}, {0, 17}, {3, 40}, {8, 264}, {100, 1100}, {0, 4096}} {
		var pos [warmBatch]int
		got := pos[:bisectKeys(span[0], span[1], walkStride, &pos)]
		for path := range 1 << bisectLevels {
			lo, hi := span[0], span[1]
			for step := range bisectLevels {
				if hi-lo <= walkStride {
					break
				}
				mid := lo + (hi-lo)/2
				if !slices.Contains(got, mid) {
					t.Fatalf("span %v, path %04b: step %d reads %d, not among the warmed %v", span, path, step, mid, got)
				}
				if path>>step&1 == 0 {
					lo = mid
				} else {
					hi = mid
				}
			}
		}
	}
}

// A block's holders in several groups spill to parts and come back into
// the entry as groups leave it: checked against a model under random
// stores, removals and workers' removals, with the cap's count of parts.
func TestSpilledHolders(t *testing.T) {
	var b blocks
	b.init(1 << 20)
	type tiers struct{ gpu, cpu uint64 }
	model := map[uint64]map[uint8]tiers{}
	rng := rand.New(rand.NewPCG(3, 4))
	const groups = 9
	for i := range 100000 {
		k := rng.Uint64N(64)
		h := holder{grp: uint8(rng.IntN(groups)), bit: 1 << rng.IntN(3)}
		tier := Tier(rng.IntN(2))
		m := model[k]
		if m == nil {
			m = map[uint8]tiers{}
			model[k] = m
		}
		ts := m[h.grp]
		switch op := rng.IntN(100); {
		case op < 50:
			b.set(k, h, tier)
			if tier == TierCPU {
				ts.cpu |= h.bit
			} else {
				ts.gpu |= h.bit
			}
		case op < 99:
			b.clear(k, h, tier)
			if tier == TierCPU {
				ts.cpu &^= h.bit
			} else {
				ts.gpu &^= h.bit
			}
		default:
			b.clearSlot(h, true)
			for _, m := range model {
				if ts, ok := m[h.grp]; ok {
					m[h.grp] = tiers{ts.gpu &^ h.bit, ts.cpu &^ h.bit}
				}
			}
			ts = m[h.grp]
			ts.gpu &^= h.bit
			ts.cpu &^= h.bit
		}
		m[h.grp] = ts
		if i%1000 != 0 {
			continue
		}
		n, parts := 0, 0
		for k, m := range model {
			held := 0
			for _, ts := range m {
				if ts.gpu|ts.cpu != 0 {
					held++
				}
			}
			j := b.t.find(k)
			if (j != none) != (held > 0) {
				t.Fatalf("op %d: block %d indexed %t, held in %d groups", i, k, j != none, held)
			}
			if j == none {
				continue
			}
			n++
			e := b.t.at(j)
			if spilled := e.flags&flagSpill != 0; spilled != (held > 1) {
				t.Fatalf("op %d: block %d held in %d groups, spilled %t", i, k, held, spilled)
			} else if spilled {
				parts += len(b.t.sp.parts(e.class(), e.ext))
			}
			for g := range uint8(groups) {
				var got tiers
				if ms := b.masks(e, g, false); ms != nil {
					got = tiers{ms[maskGPU], ms[maskCPU]}
				}
				if want := m[g]; got != want {
					t.Fatalf("op %d: block %d, group %d: %+v, want %+v", i, k, g, got, want)
				}
			}
		}
		if b.t.n != n || b.t.sp.used != parts {
			t.Fatalf("op %d: %d entries and %d parts, want %d and %d", i, b.t.n, b.t.sp.used, n, parts)
		}
	}
}

// keyWithHash returns the key whose hash is h: hash multiplies by an odd
// constant, which has an inverse modulo 2⁶⁴.
func keyWithHash(h uint64) uint64 {
	inv := uint64(0x9e3779b97f4a7c15) // Newton's iteration: each step doubles the correct bits
	for range 5 {
		inv *= 2 - 0x9e3779b97f4a7c15*inv
	}
	return h * inv
}

// Keys whose hashes share their top 32 bits share a tag and a home: the
// table tells them apart by the entry's key, finds each, and removing
// some (the backward shift moving the others by their tags) loses none.
func TestTableSameTag(t *testing.T) {
	var tb table
	tb.init(1 << 20)
	const tag = uint64(0xabcd1234) << 32
	var same, other []uint64
	for i := range uint64(40) {
		same = append(same, keyWithHash(tag|i))
		other = append(other, keyWithHash(tag+(i%3)<<(64-10)|i)) // homes near: the same runs
	}
	if hash(same[0])>>32 != hash(same[1])>>32 || same[0] == same[1] {
		t.Fatalf("keyWithHash: %x %x", hash(same[0]), hash(same[1]))
	}
	idx := map[uint64]uint32{}
	for i := range same {
		for _, k := range []uint64{same[i], other[i]} {
			if _, ok := idx[k]; ok {
				continue
			}
			if tb.find(k) != none {
				t.Fatalf("key %x found before it is inserted", k)
			}
			idx[k] = tb.insert(k)
		}
	}
	check := func() {
		t.Helper()
		for k, i := range idx {
			if got := tb.find(k); got != i {
				t.Fatalf("find(%x) = %d, want %d", k, got, i)
			}
		}
	}
	check()
	for i, k := range same {
		if i%2 == 0 {
			tb.remove(idx[k])
			delete(idx, k)
			if tb.find(k) != none {
				t.Fatalf("removed key %x still found", k)
			}
		}
	}
	check()
	// Growing moves every slot by its tag.
	for i := range uint64(5000) {
		k := keyWithHash(i * 0x9e3779b97f4a7c15)
		if _, ok := idx[k]; !ok && tb.find(k) == none {
			idx[k] = tb.insert(k)
		}
	}
	check()
	if tb.n != len(idx) {
		t.Errorf("table holds %d entries, want %d", tb.n, len(idx))
	}
}
