// Package ring places members on a consistent-hash ring, so that a key keeps
// its owner while membership changes elsewhere: adding or removing one of N
// members moves about 1/N of the keys, and only to or from that member.
//
// A Ring is immutable once built and safe for concurrent use. Lookups and
// walks binary-search a sorted slice of points and do not allocate. Its
// points are placed at its first lookup or walk, not by New: a pool that
// adds a thousand workers one by one publishes a ring per addition, and
// only the last is ever read.
package ring

import (
	"cmp"
	"encoding/binary"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// DefaultVirtualNodes is the number of points each member gets when New is
// given 0. With 160 points a member's share of the key space deviates from
// 1/N by about 1/sqrt(160), 8%, while the ring of 256 members stays at 41k
// points (330 KiB), small enough that a lookup's binary search stays cheap.
const DefaultVirtualNodes = 160

// Ring maps 64-bit keys to members. Member i is members[i] as given to New.
type Ring struct {
	members []string
	vnodes  int
	once    sync.Once
	points  []uint64 // sorted hashes of the virtual nodes
	owners  []int32  // owners[j] is the member index of points[j]
}

// New builds a ring of members, each placed at vnodes points (at
// DefaultVirtualNodes when vnodes <= 0). Point i of member m is the xxHash64
// of m, a zero byte and i as 8 little-endian bytes, so a member lands on the
// same points in every ring that holds it. Members should be distinct.
func New(members []string, vnodes int) *Ring {
	if vnodes <= 0 {
		vnodes = DefaultVirtualNodes
	}
	return &Ring{members: slices.Clone(members), vnodes: vnodes}
}

// place computes the ring's points, once.
func (r *Ring) place() { r.once.Do(r.build) }

func (r *Ring) build() {
	members, vnodes := r.members, r.vnodes
	if vnodes == 0 {
		return // placed by hand (tests)
	}
	type point struct {
		hash  uint64
		owner int32
	}
	pts := make([]point, 0, len(members)*vnodes)
	var d xxhash.Digest
	var buf [8]byte
	for m, name := range members {
		for i := 0; i < vnodes; i++ {
			d.Reset()
			d.WriteString(name)
			d.Write([]byte{0})
			binary.LittleEndian.PutUint64(buf[:], uint64(i))
			d.Write(buf[:])
			pts = append(pts, point{d.Sum64(), int32(m)})
		}
	}
	// Equal hashes are ordered by member name, not index, so that which
	// member owns a contested point does not depend on the members' order
	// or on who else is in the ring.
	slices.SortFunc(pts, func(a, b point) int {
		if c := cmp.Compare(a.hash, b.hash); c != 0 {
			return c
		}
		return cmp.Compare(members[a.owner], members[b.owner])
	})
	r.points = make([]uint64, len(pts))
	r.owners = make([]int32, len(pts))
	for j, p := range pts {
		r.points[j] = p.hash
		r.owners[j] = p.owner
	}
}

// Len returns the number of members.
func (r *Ring) Len() int { return len(r.members) }

// Member returns the name of member i.
func (r *Ring) Member(i int) string { return r.members[i] }

// Lookup returns the index of the member owning key: the owner of the first
// point at or after key, wrapping around. It returns -1 if the ring is empty.
func (r *Ring) Lookup(key uint64) int {
	r.place()
	if len(r.points) == 0 {
		return -1
	}
	return int(r.owners[r.search(key)])
}

// Walk calls fn with each distinct member in ring order, starting with the
// owner of key, until fn returns false or every member has been visited.
// A caller skips members it cannot use by returning true; the first member
// it accepts is the one consistent hashing would choose if the skipped
// members were absent. Walk does not allocate for rings of up to 1,024
// members.
func (r *Ring) Walk(key uint64, fn func(member int) bool) {
	r.place()
	if len(r.points) == 0 {
		return
	}
	j := r.search(key)
	first := int(r.owners[j])
	if !fn(first) || len(r.members) == 1 {
		return
	}
	var small [16]uint64 // visited set of up to 1,024 members, on the stack
	seen := small[:]
	if n := (len(r.members) + 63) / 64; n > len(small) {
		seen = make([]uint64, n)
	}
	seen[first/64] |= 1 << (first % 64)
	left := len(r.members) - 1
	for range len(r.points) - 1 {
		j++
		if j == len(r.points) {
			j = 0
		}
		m := int(r.owners[j])
		if seen[m/64]&(1<<(m%64)) != 0 {
			continue
		}
		seen[m/64] |= 1 << (m % 64)
		if !fn(m) {
			return
		}
		if left--; left == 0 {
			return
		}
	}
}

// search returns the index of the first point at or after key, wrapping to
// 0 past the last point. The ring must not be empty.
func (r *Ring) search(key uint64) int {
	j, _ := slices.BinarySearch(r.points, key)
	if j == len(r.points) {
		j = 0
	}
	return j
}
