package vllmtest

import (
	"container/list"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/transfer/blockkey"
)

// block is one cached block of the prefix cache.
type block struct {
	hash uint64
	refs int           // running requests that hold it: never evicted
	elem *list.Element // in cache.lru; nil once evicted or cleared
}

// cache is the engine's prefix cache: full blocks of blockSize tokens under
// the engine's own chained hash, at most capacity of them, the least
// recently used unheld one evicted to make room. It is not safe for
// concurrent use; the Server locks it.
type cache struct {
	blockSize, capacity int
	blocks              map[uint64]*block
	lru                 *list.List // of *block, most recent first
	held                int        // blocks with refs > 0
}

func newCache(blockSize, capacity int) *cache {
	return &cache{blockSize: blockSize, capacity: capacity, blocks: map[uint64]*block{}, lru: list.New()}
}

// seed is the engine's first parent hash for a cache salt: unlike baton's
// blockkey.TokenSeed, so that only the events' token ids can tie the engine's
// blocks to baton's keys.
func seed(salt string) uint64 {
	return xxhash.Sum64String("vllmtest\x00"+salt) ^ 0x5bd1e9955bd1e995
}

// hashes returns the engine's chained hashes of the full blocks of tokens.
func (c *cache) hashes(tokens []uint32, salt string) []uint64 {
	out := make([]uint64, 0, len(tokens)/c.blockSize)
	prev := seed(salt)
	for i := 0; i+c.blockSize <= len(tokens); i += c.blockSize {
		prev = blockkey.NextTokenKey(prev, tokens[i:i+c.blockSize])
		out = append(out, prev)
	}
	return out
}

// alloc is what allocating a prompt's blocks did.
type alloc struct {
	held    []*block // blocks the request holds until release
	hit     int      // leading blocks found cached
	stored  []int    // indexes of the blocks stored or stored again, from hit on
	evicted []uint64 // hashes evicted to make room
}

// allocate holds the cached leading blocks of hashes (at most maxHit of
// them) and stores the rest, evicting as it must; a block that finds no
// room (every block held) is not cached, nor are those after it.
func (c *cache) allocate(hashes []uint64, maxHit int) alloc {
	a := alloc{held: make([]*block, 0, len(hashes)), stored: make([]int, 0, len(hashes))}
	for a.hit < len(hashes) && a.hit < maxHit {
		b, ok := c.blocks[hashes[a.hit]]
		if !ok {
			break
		}
		c.hold(&a, b)
		a.hit++
	}
	for i := a.hit; i < len(hashes); i++ {
		b, ok := c.blocks[hashes[i]]
		if !ok {
			if len(c.blocks) >= c.capacity {
				victim := c.evict()
				if victim == nil {
					break
				}
				a.evicted = append(a.evicted, victim.hash)
			}
			b = &block{hash: hashes[i]}
			b.elem = c.lru.PushFront(b)
			c.blocks[b.hash] = b
		}
		c.hold(&a, b)
		a.stored = append(a.stored, i)
	}
	// A chain's last blocks are the least recently used of it, so they go
	// first, as in vLLM, which frees a request's blocks tail first.
	for i := len(a.held) - 1; i >= 0; i-- {
		c.lru.MoveToFront(a.held[i].elem)
	}
	return a
}

func (c *cache) hold(a *alloc, b *block) {
	if b.refs == 0 {
		c.held++
	}
	b.refs++
	a.held = append(a.held, b)
}

// evict drops the least recently used block no request holds; nil if
// every block is held.
func (c *cache) evict() *block {
	for e := c.lru.Back(); e != nil; e = e.Prev() {
		if b := e.Value.(*block); b.refs == 0 {
			c.drop(b)
			return b
		}
	}
	return nil
}

func (c *cache) drop(b *block) {
	c.lru.Remove(b.elem)
	b.elem = nil
	delete(c.blocks, b.hash)
}

// release lets go of a request's blocks; they stay cached until evicted.
func (c *cache) release(held []*block) {
	for _, b := range held {
		b.refs--
		if b.refs == 0 && b.elem != nil {
			c.held--
		}
	}
}

// clear drops every block; blocks still held stay held by their requests
// but are no longer cached.
func (c *cache) clear() {
	for _, b := range c.blocks {
		if b.refs > 0 {
			c.held--
		}
		b.elem = nil
	}
	c.blocks = map[uint64]*block{}
	c.lru.Init()
}
