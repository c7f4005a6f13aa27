package sim

import "sync"

// BlockTokens is the number of tokens in one KV block: a block of
// blockkey.DefaultBlockChars characters at blockkey.CharsPerToken.
const BlockTokens = 16

// CacheEventKind says what happened to the blocks of a CacheEvent.
type CacheEventKind int

const (
	// BlockStored: the blocks were computed and are now cached.
	BlockStored CacheEventKind = iota + 1
	// BlockRemoved: the blocks were evicted.
	BlockRemoved
)

func (k CacheEventKind) String() string {
	switch k {
	case BlockStored:
		return "stored"
	case BlockRemoved:
		return "removed"
	}
	return "unknown"
}

// CacheEvent reports blocks stored in or removed from the GPU cache, by
// their chained keys (transfer/blockkey). Keys is owned by the event and
// never modified after it is emitted.
type CacheEvent struct {
	Kind CacheEventKind
	Keys []uint64
}

// Cache is a paged prefix cache of KV blocks, like vLLM's with prefix
// caching on. A block is either keyed (full, computed, findable by its
// chained key) or reserved (allocated to a sequence but not yet computed,
// or holding its partial and generated tokens; reserved blocks have no key).
//
// Keyed blocks are reference-counted: a block referenced by a running
// sequence is never evicted; unreferenced keyed blocks stay cached and are
// evicted least recently used first when space is needed.
//
// Its methods are safe for concurrent use. The emit function passed to
// NewCache is called with the cache's lock held, in mutation order, so a
// caller of Snapshot sees a state consistent with the events; emit must not
// block nor call back into the Cache.
type Cache struct {
	mu       sync.Mutex
	capacity int64
	reserved int64 // reserved (unkeyed) blocks
	refd     int64 // keyed blocks with refs > 0
	blocks   map[uint64]*block
	lru      block // sentinel of the list of unreferenced blocks, LRU first
	free     *block
	emit     func(CacheEvent)
}

type block struct {
	key        uint64
	refs       int32
	prev, next *block // in the LRU list while refs == 0; next links the free list
}

// NewCache returns an empty cache of capacity blocks. emit, if not nil,
// receives every cache event (see Cache).
func NewCache(capacity int64, emit func(CacheEvent)) *Cache {
	c := &Cache{capacity: capacity, blocks: make(map[uint64]*block), emit: emit}
	c.lru.prev, c.lru.next = &c.lru, &c.lru
	return c
}

// Capacity is the number of blocks the cache holds at most.
func (c *Cache) Capacity() int64 { return c.capacity }

// Used is the number of blocks in use by sequences: referenced keyed blocks
// plus reserved ones. Unreferenced cached blocks are free for reuse and not
// counted, as in vLLM's KV usage.
func (c *Cache) Used() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refd + c.reserved
}

// Cached is the number of keyed blocks, referenced or not.
func (c *Cache) Cached() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.blocks)
}

// Lookup returns how many leading keys are cached. It changes nothing.
func (c *Cache) Lookup(keys []uint64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lookup(keys)
}

func (c *Cache) lookup(keys []uint64) int {
	for i, k := range keys {
		if _, ok := c.blocks[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// Acquire admits a sequence whose prompt has the given full-block keys and
// which needs extra more blocks (its partial prompt block and generated
// tokens). The leading cached keys are referenced; every other block is
// reserved, evicting unreferenced blocks LRU first if needed. It returns
// the number of hit keys, and ok false, changing nothing, if the blocks do
// not fit now.
func (c *Cache) Acquire(keys []uint64, extra int64) (hits int, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	hits = c.lookup(keys)
	idleHits := int64(0)
	for _, k := range keys[:hits] {
		if c.blocks[k].refs == 0 {
			idleHits++
		}
	}
	need := int64(len(keys)-hits) + extra
	if c.capacity-c.refd-c.reserved-idleHits < need {
		return 0, false
	}
	for _, k := range keys[:hits] {
		c.ref(c.blocks[k])
	}
	var evicted []uint64
	for c.capacity-int64(len(c.blocks))-c.reserved < need {
		b := c.lru.next // never the sentinel: the check above guarantees room
		evicted = append(evicted, b.key)
		c.unlink(b)
		delete(c.blocks, b.key)
		b.next, c.free = c.free, b
	}
	c.reserved += need
	if len(evicted) > 0 && c.emit != nil {
		c.emit(CacheEvent{Kind: BlockRemoved, Keys: evicted})
	}
	return hits, true
}

// Commit turns one reserved block per key into the keyed, referenced block
// of that key, once its tokens are computed. If another sequence committed
// the same key first, that block is referenced instead and the reservation
// is freed. Stored blocks are emitted as one event.
func (c *Cache) Commit(keys []uint64) {
	if len(keys) == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var stored []uint64
	for _, k := range keys {
		c.reserved--
		if b, ok := c.blocks[k]; ok {
			c.ref(b)
			continue
		}
		b := c.free
		if b != nil {
			c.free = b.next
			*b = block{}
		} else {
			b = new(block)
		}
		b.key, b.refs = k, 1
		c.blocks[k] = b
		c.refd++
		stored = append(stored, k)
	}
	if len(stored) > 0 && c.emit != nil {
		c.emit(CacheEvent{Kind: BlockStored, Keys: stored})
	}
}

// Release drops a sequence's references to keys (hit or committed) and
// frees its reserved blocks. Keys are released last to first, so the tail
// of a prompt, the least likely to be shared, is evicted first.
func (c *Cache) Release(keys []uint64, reserved int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reserved -= reserved
	for i := len(keys) - 1; i >= 0; i-- {
		b := c.blocks[keys[i]]
		if b == nil || b.refs == 0 {
			continue // not held: a caller bug, but never corrupt the list
		}
		b.refs--
		if b.refs == 0 {
			c.refd--
			// Append at the most recently used end.
			b.prev, b.next = c.lru.prev, &c.lru
			c.lru.prev.next = b
			c.lru.prev = b
		}
	}
}

// Snapshot calls fn, with the cache's lock held, with every keyed block
// (most recently used last among unreferenced ones) and the number of used
// blocks. No event is emitted while fn runs, so fn may register a
// subscriber that then misses nothing. keys is only valid during fn.
func (c *Cache) Snapshot(fn func(keys []uint64, used int64)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]uint64, 0, len(c.blocks))
	for k, b := range c.blocks {
		if b.refs > 0 {
			keys = append(keys, k)
		}
	}
	for b := c.lru.next; b != &c.lru; b = b.next {
		keys = append(keys, b.key)
	}
	fn(keys, c.refd+c.reserved)
}

func (c *Cache) ref(b *block) {
	if b.refs == 0 {
		c.unlink(b)
		c.refd++
	}
	b.refs++
}

func (c *Cache) unlink(b *block) {
	b.prev.next = b.next
	b.next.prev = b.prev
	b.prev, b.next = nil, nil
}

// Holds reports, for each key, whether its block is cached (referenced or
// not). It changes nothing.
func (c *Cache) Holds(keys []uint64) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	held := make([]bool, len(keys))
	for i, k := range keys {
		_, held[i] = c.blocks[k]
	}
	return held
}

// Insert adds the block of key as computed and unreferenced (at the most
// recently used end), as when it arrives from another worker, evicting the
// least recently used unreferenced block if the cache is full. A block
// already cached is only touched. It reports whether the block is cached
// afterwards: false when every block is referenced or reserved. A stored
// block is emitted (after the removed one, if any).
func (c *Cache) Insert(key uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if b, ok := c.blocks[key]; ok {
		if b.refs == 0 { // touch: move to the most recently used end
			c.unlink(b)
			c.pushMRU(b)
		}
		return true
	}
	if c.capacity-int64(len(c.blocks))-c.reserved < 1 {
		b := c.lru.next
		if b == &c.lru {
			return false // every block is in use
		}
		c.unlink(b)
		delete(c.blocks, b.key)
		b.next, c.free = c.free, b
		if c.emit != nil {
			c.emit(CacheEvent{Kind: BlockRemoved, Keys: []uint64{b.key}})
		}
	}
	b := c.free
	if b != nil {
		c.free = b.next
		*b = block{}
	} else {
		b = new(block)
	}
	b.key = key
	c.blocks[key] = b
	c.pushMRU(b)
	if c.emit != nil {
		c.emit(CacheEvent{Kind: BlockStored, Keys: []uint64{key}})
	}
	return true
}

// pushMRU appends an unreferenced block at the most recently used end.
func (c *Cache) pushMRU(b *block) {
	b.prev, b.next = c.lru.prev, &c.lru
	c.lru.prev.next = b
	c.lru.prev = b
}
