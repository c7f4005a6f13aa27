package bench

import (
	"container/list"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/transfer/blockkey"
)

// BlockTokens is the simulated engine's KV block: 64 characters, 16 tokens.
const BlockTokens = blockkey.DefaultBlockChars / blockkey.CharsPerToken

// Limits are the KV hit rates no router can exceed on a workload.
type Limits struct {
	// Infinite is the hit rate of one cache of unbounded size that sees
	// every request: only first occurrences miss.
	Infinite float64 `json:"infinite_hit_rate"`
	// Pooled is the hit rate of one LRU cache holding the fleet's total
	// block capacity: a perfect router over a fleet whose caches were one.
	Pooled float64 `json:"pooled_hit_rate"`
	// PooledBlocks is that capacity, in 16-token blocks.
	PooledBlocks int64 `json:"pooled_blocks"`
}

// cachedTokens is what the simulated engine reports as cached for a prompt
// of promptTokens whose first matched blocks are in cache: full blocks,
// and never the last prompt token, which is always recomputed.
func cachedTokens(matched, promptTokens int) int {
	return max(min(matched*BlockTokens, promptTokens-1), 0)
}

// ComputeLimits replays the workload's routing text through an infinite
// cache and a pooled LRU of capacity blocks (0: infinite only), keyed by
// blockkey at 16-token granularity, as the workers key their caches.
func ComputeLimits(w *workload.Workload, model string, capacity int64) Limits {
	seed := blockkey.Seed(model, "")
	inf := map[uint64]bool{}
	lru := newLRU(capacity)
	var prompt, infHit, poolHit int
	var keys []uint64
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
		}
	}
	l := Limits{PooledBlocks: capacity}
	if prompt > 0 {
		l.Infinite = float64(infHit) / float64(prompt)
		l.Pooled = float64(poolHit) / float64(prompt)
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
