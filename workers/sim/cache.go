package sim

import (
	"sync"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/engine/cost"
)

// BlockTokens is the number of tokens in one KV block: a block of
// blockkey.DefaultBlockChars characters at blockkey.CharsPerToken, as the
// cost model counts it.
const BlockTokens = cost.BlockTokens

// Tier is where a block is held: the worker's GPU memory, its host (CPU)
// memory, or the fleet's shared tier (Redis, through a transfer.Store).
// The values match workerpb.Tier.
type Tier int

// Tiers.
const (
	TierGPU   Tier = 1
	TierCPU   Tier = 2
	TierRedis Tier = 3
)

func (t Tier) String() string {
	switch t {
	case TierGPU:
		return "gpu"
	case TierCPU:
		return "cpu"
	case TierRedis:
		return "redis"
	}
	return "none"
}

// CacheEventKind says what happened to the blocks of a CacheEvent.
type CacheEventKind int

const (
	// BlockStored: the blocks were computed, received or fetched, and are
	// now held in Tier (for TierRedis: this worker wrote them there).
	BlockStored CacheEventKind = iota + 1
	// BlockRemoved: the blocks left Tier and the worker no longer holds
	// them there (for TierRedis: the worker found them missing).
	BlockRemoved
	// BlockTierChanged: the blocks moved from FromTier to Tier (GPU to CPU
	// on demotion, CPU to GPU on promotion).
	BlockTierChanged
)

func (k CacheEventKind) String() string {
	switch k {
	case BlockStored:
		return "stored"
	case BlockRemoved:
		return "removed"
	case BlockTierChanged:
		return "tier_changed"
	}
	return "unknown"
}

// CacheEvent reports blocks stored in, removed from, or moved between the
// tiers, by their chained keys (transfer/blockkey). Keys is owned by the
// event and never modified after it is emitted.
type CacheEvent struct {
	Kind CacheEventKind
	// Tier is the tier the blocks are in after the event; for removed
	// blocks, the tier they left.
	Tier Tier
	// FromTier is the tier the blocks left, for tier changes.
	FromTier Tier
	Keys     []uint64
}

// CacheConfig configures a tiered Cache.
type CacheConfig struct {
	// GPUBlocks is the GPU tier's capacity in blocks.
	GPUBlocks int64
	// CPUBlocks is the CPU tier's capacity in blocks; 0: no CPU tier.
	CPUBlocks int64
	// Emit, if not nil, receives every cache event (see Cache).
	Emit func(CacheEvent)
	// Write, if not nil, is handed the blocks to write to the shared tier,
	// with the cache's lock held: it must not block nor call back into the
	// Cache (it queues them). With WriteThrough, every newly computed
	// block (Commit) is handed over; otherwise (write on demotion) a block
	// is handed over when it leaves the cache's last tier (the CPU tier,
	// or the GPU tier without one), unless it came from the shared tier
	// (Insert with fromStore) or its namespace is unknown.
	Write        func(ns transfer.Namespace, key uint64)
	WriteThrough bool
}

// Cache is a paged prefix cache of KV blocks, like vLLM's with prefix
// caching on, with a CPU tier under it. A GPU block is either keyed (full,
// computed, findable by its chained key) or reserved (allocated to a
// sequence but not yet computed, or holding its partial and generated
// tokens; reserved blocks have no key).
//
// Keyed GPU blocks are reference-counted: a block referenced by a running
// sequence is never evicted; unreferenced keyed blocks stay cached and are
// evicted least recently used first when space is needed. An evicted GPU
// block is demoted to the CPU tier (a host-memory copy, LRU too) when
// there is one; a block evicted from the CPU tier, or from the GPU tier
// without a CPU tier, is dropped (after being handed to
// CacheConfig.Write under the write-on-demotion policy). A sequence whose
// leading blocks are in the CPU tier has them promoted back to the GPU
// tier at admission (Acquire).
//
// Every keyed block remembers its namespace (model and tenant salt), so it
// can be written to the shared tier.
//
// Its methods are safe for concurrent use. The emit function is called
// with the cache's lock held, in mutation order, so a caller of Snapshot
// sees a state consistent with the events; emit must not block nor call
// back into the Cache.
type Cache struct {
	mu           sync.Mutex
	capacity     int64 // GPU
	cpuCap       int64
	reserved     int64 // reserved (unkeyed) GPU blocks
	refd         int64 // keyed GPU blocks with refs > 0
	blocks       map[uint64]*block
	cpu          map[uint64]*block
	lru          block // sentinel of the list of unreferenced GPU blocks, LRU first
	cpuLRU       block // sentinel of the list of CPU blocks, LRU first
	free         *block
	emit         func(CacheEvent)
	write        func(transfer.Namespace, uint64)
	writeThrough bool
	mv           moves // events of the current operation
}

type block struct {
	key        uint64
	ns         transfer.Namespace
	refs       int32
	fromStore  bool   // fetched from the shared tier: never written back
	prev, next *block // in an LRU list while refs == 0; next links the free list
}

// moves collects the events of one operation, emitted together at its end.
type moves struct {
	promoted, demoted, removedCPU, removedGPU, storedGPU, storedCPU []uint64
}

// NewCache returns an empty cache of capacity GPU blocks and no CPU tier.
// emit, if not nil, receives every cache event (see Cache).
func NewCache(capacity int64, emit func(CacheEvent)) *Cache {
	return NewTieredCache(CacheConfig{GPUBlocks: capacity, Emit: emit})
}

// NewTieredCache returns an empty cache configured by cfg.
func NewTieredCache(cfg CacheConfig) *Cache {
	c := &Cache{
		capacity: cfg.GPUBlocks, cpuCap: max(cfg.CPUBlocks, 0),
		blocks: make(map[uint64]*block), cpu: make(map[uint64]*block),
		emit: cfg.Emit, write: cfg.Write, writeThrough: cfg.WriteThrough,
	}
	c.lru.prev, c.lru.next = &c.lru, &c.lru
	c.cpuLRU.prev, c.cpuLRU.next = &c.cpuLRU, &c.cpuLRU
	return c
}

// Capacity is the number of GPU blocks the cache holds at most.
func (c *Cache) Capacity() int64 { return c.capacity }

// CPUCapacity is the number of CPU-tier blocks the cache holds at most (0:
// no CPU tier).
func (c *Cache) CPUCapacity() int64 { return c.cpuCap }

// Used is the number of GPU blocks in use by sequences: referenced keyed
// blocks plus reserved ones. Unreferenced cached blocks are free for reuse
// and not counted, as in vLLM's KV usage.
func (c *Cache) Used() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refd + c.reserved
}

// CPUUsed is the number of blocks in the CPU tier.
func (c *Cache) CPUUsed() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int64(len(c.cpu))
}

// Cached is the number of keyed GPU blocks, referenced or not.
func (c *Cache) Cached() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.blocks)
}

// Locate returns the tier holding key, or 0.
func (c *Cache) Locate(key uint64) Tier {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.blocks[key]; ok {
		return TierGPU
	}
	if _, ok := c.cpu[key]; ok {
		return TierCPU
	}
	return 0
}

// Lookup returns how many leading keys are cached, in either tier. It
// changes nothing.
func (c *Cache) Lookup(keys []uint64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, k := range keys {
		if !c.holds(k) {
			return i
		}
	}
	return len(keys)
}

func (c *Cache) holds(k uint64) bool {
	if _, ok := c.blocks[k]; ok {
		return true
	}
	_, ok := c.cpu[k]
	return ok
}

// Hits are the leading keys a sequence found cached at admission.
type Hits struct {
	// N leading keys were cached; CPU of them were in the CPU tier and
	// were promoted to the GPU tier (the others were GPU hits).
	N, CPU int
}

// Acquire admits a sequence of namespace ns whose prompt has the given
// full-block keys and which needs extra more blocks (its partial prompt
// block and generated tokens). The leading cached keys are referenced
// (those in the CPU tier are first promoted to the GPU tier); every other
// block is reserved, evicting unreferenced GPU blocks LRU first if needed
// (demoting them). It returns the hits, and ok false, changing nothing,
// if the blocks do not fit now.
func (c *Cache) Acquire(ns transfer.Namespace, keys []uint64, extra int64) (hits Hits, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	idleHits := int64(0)
	n, cpuHits := 0, 0
	for _, k := range keys {
		if b, ok := c.blocks[k]; ok {
			if b.refs == 0 {
				idleHits++
			}
		} else if _, ok := c.cpu[k]; ok {
			cpuHits++
		} else {
			break
		}
		n++
	}
	misses := int64(len(keys) - n)
	need := misses + extra + int64(cpuHits) // GPU slots to take
	if c.capacity-c.refd-c.reserved-idleHits < need {
		return Hits{}, false
	}
	var promoted []*block
	for _, k := range keys[:n] {
		if b, ok := c.blocks[k]; ok {
			c.ref(b)
			c.tag(b, ns)
			continue
		}
		b := c.cpu[k]
		c.unlink(b)
		delete(c.cpu, k)
		promoted = append(promoted, b)
	}
	c.makeRoom(need)
	for _, b := range promoted {
		c.blocks[b.key] = b
		b.refs = 1
		c.refd++
		c.tag(b, ns)
		c.mv.promoted = append(c.mv.promoted, b.key)
	}
	c.reserved += misses + extra
	c.flush()
	return Hits{N: n, CPU: cpuHits}, true
}

// tag gives a block whose namespace is unknown (received from another
// worker) the namespace of the sequence that uses it.
func (c *Cache) tag(b *block, ns transfer.Namespace) {
	if b.ns.Model == "" {
		b.ns = ns
	}
}

// makeRoom evicts unreferenced GPU blocks, LRU first, until need GPU
// slots are free, or none is left to evict. It reports whether need slots
// are free.
func (c *Cache) makeRoom(need int64) bool {
	for c.capacity-int64(len(c.blocks))-c.reserved < need {
		b := c.lru.next
		if b == &c.lru {
			return false
		}
		c.demote(b)
	}
	return true
}

// demote moves an unreferenced GPU block to the CPU tier, or drops it if
// there is none.
func (c *Cache) demote(b *block) {
	c.unlink(b)
	delete(c.blocks, b.key)
	if c.cpuCap == 0 {
		c.mv.removedGPU = append(c.mv.removedGPU, b.key)
		c.drop(b)
		return
	}
	c.pushCPU(b)
	c.mv.demoted = append(c.mv.demoted, b.key)
}

// pushCPU puts b at the most recently used end of the CPU tier, evicting
// its least recently used blocks while it is full.
func (c *Cache) pushCPU(b *block) {
	for int64(len(c.cpu)) >= c.cpuCap {
		v := c.cpuLRU.next
		c.unlink(v)
		delete(c.cpu, v.key)
		c.mv.removedCPU = append(c.mv.removedCPU, v.key)
		c.drop(v)
	}
	c.cpu[b.key] = b
	b.prev, b.next = c.cpuLRU.prev, &c.cpuLRU
	c.cpuLRU.prev.next = b
	c.cpuLRU.prev = b
}

// drop frees a block leaving the cache, handing it to the shared tier
// first under the write-on-demotion policy.
func (c *Cache) drop(b *block) {
	if c.write != nil && !c.writeThrough && !b.fromStore && b.ns.Model != "" {
		c.write(b.ns, b.key)
	}
	b.next, c.free = c.free, b
}

func (c *Cache) alloc(key uint64, ns transfer.Namespace) *block {
	b := c.free
	if b != nil {
		c.free = b.next
		*b = block{}
	} else {
		b = new(block)
	}
	b.key, b.ns = key, ns
	return b
}

// flush emits the events of the operation, in an order that applies
// correctly: promotions, demotions, removals, then stored blocks.
func (c *Cache) flush() {
	m := &c.mv
	if c.emit != nil {
		if len(m.promoted) > 0 {
			c.emit(CacheEvent{Kind: BlockTierChanged, Tier: TierGPU, FromTier: TierCPU, Keys: m.promoted})
		}
		if len(m.demoted) > 0 {
			c.emit(CacheEvent{Kind: BlockTierChanged, Tier: TierCPU, FromTier: TierGPU, Keys: m.demoted})
		}
		if len(m.removedCPU) > 0 {
			c.emit(CacheEvent{Kind: BlockRemoved, Tier: TierCPU, Keys: m.removedCPU})
		}
		if len(m.removedGPU) > 0 {
			c.emit(CacheEvent{Kind: BlockRemoved, Tier: TierGPU, Keys: m.removedGPU})
		}
		if len(m.storedGPU) > 0 {
			c.emit(CacheEvent{Kind: BlockStored, Tier: TierGPU, Keys: m.storedGPU})
		}
		if len(m.storedCPU) > 0 {
			c.emit(CacheEvent{Kind: BlockStored, Tier: TierCPU, Keys: m.storedCPU})
		}
	}
	*m = moves{} // the events own the slices
}

// Commit turns one reserved block per key into the keyed, referenced block
// of that key, in namespace ns, once its tokens are computed. If another
// sequence committed the same key first, that block is referenced instead
// and the reservation is freed; a copy in the CPU tier is promoted. Stored
// blocks are emitted as one event (and, with write-through, handed to
// CacheConfig.Write).
func (c *Cache) Commit(ns transfer.Namespace, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range keys {
		c.reserved--
		if b, ok := c.blocks[k]; ok {
			c.ref(b)
			c.tag(b, ns)
			continue
		}
		var b *block
		if v, ok := c.cpu[k]; ok {
			c.unlink(v)
			delete(c.cpu, k)
			b = v
			c.tag(b, ns)
			c.mv.promoted = append(c.mv.promoted, k)
		} else {
			b = c.alloc(k, ns)
			c.mv.storedGPU = append(c.mv.storedGPU, k)
			if c.write != nil && c.writeThrough && ns.Model != "" {
				c.write(ns, k)
			}
		}
		b.refs = 1
		c.blocks[k] = b
		c.refd++
	}
	c.flush()
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
			c.pushMRU(b)
		}
	}
}

// Snapshot calls fn, with the cache's lock held, with every keyed GPU
// block (most recently used last among unreferenced ones), every CPU-tier
// block (least recently used first) and the number of used GPU blocks. No
// event is emitted while fn runs, so fn may register a subscriber that
// then misses nothing. The slices are only valid during fn.
func (c *Cache) Snapshot(fn func(gpu, cpu []uint64, used int64)) {
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
	cpu := make([]uint64, 0, len(c.cpu))
	for b := c.cpuLRU.next; b != &c.cpuLRU; b = b.next {
		cpu = append(cpu, b.key)
	}
	fn(keys, cpu, c.refd+c.reserved)
}

// hottest returns up to n unreferenced blocks that the shared tier may
// lack, most recently used first: the GPU tier's, then the CPU tier's.
// Blocks fetched from the shared tier are left out.
func (c *Cache) hottest(n int) []storeWrite {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []storeWrite
	for _, l := range []*block{&c.lru, &c.cpuLRU} {
		for b := l.prev; b != l && len(out) < n; b = b.prev {
			if !b.fromStore && b.ns.Model != "" {
				out = append(out, storeWrite{b.ns, b.key})
			}
		}
	}
	return out
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

// Holds reports, for each key, whether its block is cached in either tier.
// It changes nothing.
func (c *Cache) Holds(keys []uint64) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	held := make([]bool, len(keys))
	for i, k := range keys {
		held[i] = c.holds(k)
	}
	return held
}

// Insert adds the block of key, in namespace ns, as computed and
// unreferenced, at the most recently used end of the GPU tier (as when it
// arrives from another worker or from the shared tier, fromStore), demoting
// the least recently used unreferenced block if the GPU tier is full. When
// every GPU block is in use, the block goes to the CPU tier instead, if
// there is one. A block already cached is only touched. It returns the
// tier holding the block afterwards, 0 if none. A stored block is emitted
// (after the moves it caused).
func (c *Cache) Insert(ns transfer.Namespace, key uint64, fromStore bool) Tier {
	c.mu.Lock()
	defer c.mu.Unlock()
	if b, ok := c.blocks[key]; ok {
		if b.refs == 0 { // touch: move to the most recently used end
			c.unlink(b)
			c.pushMRU(b)
		}
		c.tag(b, ns)
		return TierGPU
	}
	if b, ok := c.cpu[key]; ok {
		c.unlink(b)
		delete(c.cpu, key)
		c.pushCPU(b)
		c.tag(b, ns)
		c.flush()
		return TierCPU
	}
	b := c.alloc(key, ns)
	b.fromStore = fromStore
	tier := TierGPU
	switch {
	case c.capacity-c.refd-c.reserved >= 1 && c.makeRoom(1):
		c.blocks[key] = b
		c.pushMRU(b)
		c.mv.storedGPU = append(c.mv.storedGPU, key)
	case c.cpuCap > 0:
		tier = TierCPU
		c.pushCPU(b)
		c.mv.storedCPU = append(c.mv.storedCPU, key)
	default:
		tier = 0
		b.next, c.free = c.free, b
	}
	c.flush()
	return tier
}

// pushMRU appends an unreferenced GPU block at the most recently used end.
func (c *Cache) pushMRU(b *block) {
	b.prev, b.next = c.lru.prev, &c.lru
	c.lru.prev.next = b
	c.lru.prev = b
}
