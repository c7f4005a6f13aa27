package main

import (
	"math/rand/v2"

	"github.com/batonllm/baton/bench/workload"
)

// A source yields the block keys of one request after another, without
// end: the trace's records are replayed pass after pass, each pass under
// fresh keys.
type source interface {
	// next appends the next request's keys to buf and returns it.
	next(buf []uint64) []uint64
	// distinct is the distinct keys one pass holds.
	distinct() int
}

// mix is splitmix64's finaliser: the key of hash id h in copy c.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// mooncake replays a Mooncake trace as copies tenants at once: record by
// record in the trace's order, each record once per copy, copy c's hash
// id h becoming key mix(c<<32|h). Copies share no block, as tenants with
// system prompts of their own would not; the copies of one pass are
// interleaved, so the trace's arrival order and prefix sharing hold
// within each. Once the trace ends the next pass takes fresh copies.
type mooncake struct {
	recs   []workload.MooncakeRecord
	copies int
	uniq   int
	rec    int // next record
	copy   int // next copy of it
	base   int // first copy of this pass
}

func newMooncake(recs []workload.MooncakeRecord, copies int) *mooncake {
	seen := make(map[uint64]struct{})
	for _, r := range recs {
		for _, h := range r.HashIDs {
			seen[h] = struct{}{}
		}
	}
	return &mooncake{recs: recs, copies: copies, uniq: len(seen)}
}

func (m *mooncake) distinct() int { return m.uniq * m.copies }

func (m *mooncake) next(buf []uint64) []uint64 {
	c := uint64(m.base + m.copy)
	for _, h := range m.recs[m.rec].HashIDs {
		buf = append(buf, mix(c<<32|h))
	}
	if m.copy++; m.copy == m.copies {
		m.copy = 0
		if m.rec++; m.rec == len(m.recs) {
			m.rec, m.base = 0, m.base+m.copies
		}
	}
	return buf
}

// synthetic is a fleet's traffic made up: conversations under shared
// system prompts. Each request is one of systems system prompts of
// sysBlocks blocks (the first ones the most popular) followed by a turn of
// a conversation: a new conversation (probability newConv) or the next
// turn of one of the last convs, whose prompt is its previous prompt plus
// 1–turnBlocks blocks, until maxBlocks, when it starts over. Blocks are of
// the router's size (16 tokens), so prompts run to hundreds of keys where
// the trace's 512-token blocks give tens.
type synthetic struct {
	rng                                    *rand.Rand
	systems, sysBlocks, turnBlocks, maxLen int
	newConv                                float64
	convs                                  [][]uint64 // ring of recent conversations' prompts
	at                                     int
	nextKey                                uint64
	sys                                    *rand.Zipf
}

func newSynthetic(seed uint64) *synthetic {
	s := &synthetic{
		rng:     rand.New(rand.NewPCG(seed, 7)),
		systems: 64, sysBlocks: 64, turnBlocks: 48, maxLen: 500, newConv: 0.3,
		convs:   make([][]uint64, 4096),
		nextKey: 1 << 40,
	}
	s.sys = rand.NewZipf(s.rng, 1.1, 1, uint64(s.systems-1))
	return s
}

// distinct is a nominal pass: the synthetic source never repeats, so a
// pass is as long as the caller wants.
func (s *synthetic) distinct() int { return 1 << 20 }

func (s *synthetic) fresh() uint64 {
	s.nextKey++
	return mix(s.nextKey)
}

func (s *synthetic) next(buf []uint64) []uint64 {
	i := s.rng.IntN(len(s.convs))
	c := s.convs[i]
	if c == nil || len(c) >= s.maxLen || s.rng.Float64() < s.newConv {
		sys := s.sys.Uint64()
		c = c[:0]
		for b := range s.sysBlocks {
			c = append(c, mix(sys<<20|uint64(b)))
		}
		i = s.at
		s.at = (s.at + 1) % len(s.convs)
	}
	for range 1 + s.rng.IntN(s.turnBlocks) {
		c = append(c, s.fresh())
	}
	s.convs[i] = c
	return append(buf, c...)
}

// engine stands for one engine's KV cache as its events tell it: the
// prompts it computed, oldest first, holding at most cap blocks. A
// request's blocks it lacks are stored; when it holds more than cap, the
// oldest prompts' blocks that no later prompt shares are removed.
type engine struct {
	refs   map[uint64]int32
	chains [][]uint64 // FIFO from head
	head   int
	cap    int
	seq    uint64
	full   bool // it has held cap blocks
}

func newEngine(capacity int) *engine {
	return &engine{refs: make(map[uint64]int32), cap: capacity}
}

// serve records that the engine computed keys: it returns the keys it
// stores (those it lacked) and the keys it evicts, appended to st and rm.
func (e *engine) serve(keys []uint64, st, rm []uint64) ([]uint64, []uint64) {
	for _, k := range keys {
		n := e.refs[k]
		if n == 0 {
			st = append(st, k)
		}
		e.refs[k] = n + 1
	}
	e.chains = append(e.chains, append([]uint64(nil), keys...))
	e.full = e.full || len(e.refs) >= e.cap
	for len(e.refs) > e.cap && len(e.chains)-e.head > 1 {
		old := e.chains[e.head]
		e.chains[e.head] = nil
		e.head++
		for _, k := range old {
			if n := e.refs[k]; n > 1 {
				e.refs[k] = n - 1
			} else {
				delete(e.refs, k)
				rm = append(rm, k)
			}
		}
	}
	if e.head > 1024 && e.head*2 > len(e.chains) {
		e.chains = append(e.chains[:0], e.chains[e.head:]...)
		e.head = 0
	}
	return st, rm
}
