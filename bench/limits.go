package bench

import (
	"cmp"
	"container/list"
	"fmt"

	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/transfer/blockkey"
)

// BlockTokens is the simulated engine's KV block: 64 characters, 16 tokens.
const BlockTokens = blockkey.DefaultBlockChars / blockkey.CharsPerToken

// Limits are the KV hit rates of a workload's request sequence that do not
// depend on routing: two bounds no router exceeds, and a reference.
type Limits struct {
	// Infinite is the hit rate of one cache of unbounded size that sees
	// every request: only first occurrences miss. A bound.
	Infinite float64 `json:"infinite_hit_rate"`
	// Belady is the hit rate of Belady's offline optimum (MIN) over the
	// request sequence's blocks with the fleet's total capacity
	// (PooledBlocks): a bound for that fleet (see belady.go).
	Belady float64 `json:"belady_hit_rate"`
	// Pooled is the hit rate of one LRU cache holding the fleet's total
	// block capacity. A reference, not a bound: a router can beat it, as
	// routers that partition the prefixes among workers keep each one
	// longer than one LRU of all of them would.
	Pooled float64 `json:"pooled_hit_rate"`
	// PooledBlocks is that capacity, in 16-token blocks.
	PooledBlocks int64 `json:"pooled_blocks"`
}

// Sentence states l in the report's words.
func (l Limits) Sentence() string {
	return fmt.Sprintf("Hit-rate bounds of this request sequence (no router exceeds them): infinite cache %.1f%%; "+
		"Belady's MIN over the fleet's %d blocks %.1f%%. Reference, not a bound: one pooled LRU of those blocks %.1f%%.",
		l.Infinite*100, l.PooledBlocks, l.Belady*100, l.Pooled*100)
}

// FleetBlocks is the total KV capacity, in blocks, of the largest of
// fleets built from o: every worker's GPU and CPU tiers and the shared
// tier, counted generously (the shared tier's bytes over a block's payload
// alone), so that the MIN bound computed over it stays a bound for every
// column of the run.
func FleetBlocks(o Options, fleets []Fleet) (int64, error) {
	cm, err := cost.NewEngine(cmp.Or(o.Model, "llama-3.1-8b"), cmp.Or(o.GPU, "h100"), 1)
	if err != nil {
		return 0, err
	}
	perWorker := o.KVBlocks
	if perWorker == 0 {
		perWorker = cm.BlockCapacity(BlockTokens)
	}
	switch {
	case o.CPUBlocks > 0:
		perWorker += o.CPUBlocks
	case o.CPUBlocks < 0:
		perWorker += int64(sim.DefaultCPUMemoryBytes / cm.KVBytesPerBlock())
	}
	workers := o.Workers
	for _, f := range fleets {
		workers = max(workers, f.Workers, f.Prefill+f.Decode)
	}
	total := perWorker * int64(workers)
	if o.SharedTier {
		bytes := o.SharedTierBytes
		if bytes == 0 {
			bytes = kvstore.DefaultMemoryCapacity
		}
		total += bytes / int64(kvblock.Size(cm.KVBytesPerToken(), BlockTokens, kvblock.DefaultScale))
	}
	return total, nil
}

// cachedTokens is what the simulated engine reports as cached for a prompt
// of promptTokens whose first matched blocks are in cache: full blocks,
// and never the last prompt token, which is always recomputed.
func cachedTokens(matched, promptTokens int) int {
	return max(min(matched*BlockTokens, promptTokens-1), 0)
}

// ComputeLimits replays the workload's routing text through an infinite
// cache, Belady's MIN and a pooled LRU of capacity blocks (0: infinite
// only), keyed by blockkey at 16-token granularity, as the workers key
// their caches.
func ComputeLimits(w *workload.Workload, model string, capacity int64) Limits {
	seed := blockkey.Seed(model, "")
	inf := map[uint64]bool{}
	lru := newLRU(capacity)
	var prompt, infHit, poolHit int
	var keys, refs []uint64
	for i := range w.Requests {
		text := w.Requests[i].RoutingText()
		p := blockkey.Tokens(blockkey.Chars(text))
		keys = blockkey.Append(keys[:0], seed, text, blockkey.DefaultBlockChars)
		prompt += p
		m := 0
		for m < len(keys) && inf[keys[m]] {
			m++
		}
		infHit += cachedTokens(m, p)
		for _, k := range keys {
			inf[k] = true
		}
		if capacity > 0 {
			poolHit += cachedTokens(lru.access(keys), p)
			refs = append(refs, keys...)
		}
	}
	l := Limits{PooledBlocks: capacity}
	if prompt > 0 {
		l.Infinite = float64(infHit) / float64(prompt)
		l.Pooled = float64(poolHit) / float64(prompt)
		hits := 0
		for _, h := range beladyHits(refs, capacity, true) {
			if h {
				hits++
			}
		}
		l.Belady = float64(hits*BlockTokens) / float64(prompt)
	}
	return l
}

// lru is a block LRU: access returns the leading run of keys present, then
// makes every key of the request most recently used, evicting the least
// recently used blocks beyond capacity.
type lru struct {
	capacity int64
	order    *list.List // front: most recent
	at       map[uint64]*list.Element
}

func newLRU(capacity int64) *lru {
	return &lru{capacity: capacity, order: list.New(), at: map[uint64]*list.Element{}}
}

func (c *lru) access(keys []uint64) int {
	m := 0
	for m < len(keys) && c.at[keys[m]] != nil {
		m++
	}
	// Touch in reverse so the first block ends most recent: a prefix's
	// head outlives its tail, as in vLLM's evictor.
	for i := len(keys) - 1; i >= 0; i-- {
		k := keys[i]
		if e := c.at[k]; e != nil {
			c.order.MoveToFront(e)
			continue
		}
		c.at[k] = c.order.PushFront(k)
	}
	for int64(c.order.Len()) > c.capacity {
		e := c.order.Back()
		delete(c.at, e.Value.(uint64))
		c.order.Remove(e)
	}
	return m
}
