package kvindex

import "slices"

// The learned index of workers that publish no cache events (llama.cpp's
// server, OpenAI-compatible HTTP engines, vLLM or SGLang run without KV
// events): what the routed requests left there, as the engine keeps it.
// Each request Predict records on such a worker is a chain of blocks the
// worker holds once it is prefilled; chains age out least recently used
// within the worker's capacity, and the cached tokens each response
// reports correct them. A worker with a prompt limit (llama.cpp's slots)
// keeps that many chains, a new prompt taking the idle chain most like it,
// as llama-server gives a request the slot whose prompt it shares most
// of; others keep chains until their blocks exceed the capacity.
//
// The chains of every learned worker change under the block table's
// write lock, whose GPU bits they set: Lookup reads them as any other
// block held.

// DefaultLearnedBlocks is the capacity of a learned worker whose capacity
// is neither configured nor reported: 32,768 blocks, half a million
// tokens, about what one 80 GB GPU keeps of an 8B model's KV cache.
const DefaultLearnedBlocks = 32 << 10

// maxLearnedChains bounds the chains a learned worker keeps, whatever its
// capacity, so that recording a request (a scan of the chains, under the
// block table's lock) stays cheap: about 10 µs at 1,024 chains sharing a
// system prompt, 100 µs at 4,096, where cache misses dominate. A worker's
// default capacity holds about 300 prompts of 1,600 tokens.
const maxLearnedChains = 1024

// Capacity is what a worker without cache events can hold, for its
// learned index. The zero value means what the worker reports.
type Capacity struct {
	// Prompts is the prompts it keeps at once (llama-server's slots, or
	// more with its host-memory prompt cache); 0 means its load reports'
	// Load.Slots, and no limit without them.
	Prompts int
	// Blocks is the blocks it holds; 0 means its load reports'
	// GPUBlocksTotal, else DefaultLearnedBlocks.
	Blocks int64
}

// Usage is what a worker reported of a request Predict recorded on it,
// once the request ended.
type Usage struct {
	// OK: the response reported its usage; the counts below are its.
	OK bool
	// PromptTokens and CachedTokens are the prompt's tokens and those the
	// engine found cached, in the engine's tokens.
	PromptTokens, CachedTokens int
	// PredictedTokens is the tokens the router expected cached.
	PredictedTokens int
}

// learned is a learned worker's chains. The block table's lock guards it.
type learned struct {
	cap    Capacity
	chains []*chain         // least recently used first
	refs   map[uint64]int32 // block key → chains holding it
}

// chain is one prompt the worker is believed to hold.
type chain struct {
	keys []uint64
	busy int32 // requests recorded on it that have not finished
}

// commonPrefix returns the number of leading keys a and b share.
func commonPrefix(a, b []uint64) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// record records keys on the worker h, which keeps at most prompts
// chains (0: no limit) and maxBlocks blocks, and, when busy, marks the
// chain busy until finish. It returns how many of keys the worker held in
// no chain. b.mu is held for writing.
func (l *learned) record(b *blocks, h holder, keys []uint64, prompts int, maxBlocks int64, busy bool) (added int64) {
	for _, k := range keys {
		if l.refs[k] == 0 {
			added++
		}
	}
	best, bestLen := -1, 0
	for i, c := range l.chains {
		if prompts > 0 && c.busy > 0 {
			continue // a slot serving a request takes no other
		}
		// Only a chain that matches one key past the best so far can
		// beat it: most chains are rejected on one key, not a walk of
		// the prefix they share (a system prompt).
		if bestLen == len(keys) {
			break
		}
		if len(c.keys) <= bestLen || c.keys[bestLen] != keys[bestLen] {
			continue
		}
		if n := commonPrefix(c.keys, keys); n > bestLen {
			best, bestLen = i, n
		}
	}
	var c *chain
	switch {
	case prompts == 0 && best >= 0 && bestLen == len(keys):
		// A prefix of a chain held: the engine reuses it as it is.
		c = l.chains[best]
	case best >= 0 && (bestLen == len(l.chains[best].keys) || prompts > 0 && 2*bestLen >= len(keys)):
		// The chain grows into this prompt, or the slot whose prompt is
		// most like it takes it.
		c = l.chains[best]
		l.setKeys(b, h, c, keys)
	case prompts > 0 && len(l.chains) >= prompts:
		// The least recently used idle slot takes it. With every slot
		// busy the engine defers the request to the first that frees;
		// the least recently used stands for it, and what it was
		// serving is forgotten, so that no count of requests in flight
		// outlives its chain.
		i := slices.IndexFunc(l.chains, func(o *chain) bool { return o.busy == 0 })
		if i < 0 {
			i = 0
			l.chains[i].busy = 0
		}
		c = l.chains[i]
		l.setKeys(b, h, c, keys)
	default:
		c = &chain{}
		l.setKeys(b, h, c, keys)
		l.chains = append(l.chains, c)
	}
	if busy {
		c.busy++
	}
	l.touch(c)
	for len(l.chains) > 1 && (int64(len(l.refs)) > maxBlocks || len(l.chains) > maxLearnedChains ||
		prompts > 0 && len(l.chains) > prompts) {
		l.drop(b, h, 0)
	}
	return added
}

// touch moves c to the most recently used end.
func (l *learned) touch(c *chain) {
	i := l.index(c)
	copy(l.chains[i:], l.chains[i+1:])
	l.chains[len(l.chains)-1] = c
}

// index returns c's position in l.chains.
func (l *learned) index(c *chain) int {
	for i, o := range l.chains {
		if o == c {
			return i
		}
	}
	panic("kvindex: chain not held")
}

// setKeys makes c hold keys, setting the GPU bits of the blocks the worker
// now holds and clearing those it no longer does. The new keys are counted
// first, so that blocks c keeps are never cleared in between.
func (l *learned) setKeys(b *blocks, h holder, c *chain, keys []uint64) {
	for _, k := range keys {
		l.refs[k]++
		b.set(k, h, TierGPU) // also touches the block's entry
	}
	l.unref(b, h, c.keys)
	c.keys = append(c.keys[:0], keys...)
}

// unref takes one holder off each of keys.
func (l *learned) unref(b *blocks, h holder, keys []uint64) {
	for _, k := range keys {
		switch n := l.refs[k]; {
		case n > 1:
			l.refs[k] = n - 1
		case n == 1:
			delete(l.refs, k)
			b.clear(k, h, TierGPU)
		}
	}
}

// drop forgets chain i.
func (l *learned) drop(b *blocks, h holder, i int) {
	c := l.chains[i]
	l.unref(b, h, c.keys)
	l.chains = append(l.chains[:i], l.chains[i+1:]...)
}

// clear forgets every chain.
func (l *learned) clear(b *blocks, h holder) {
	for len(l.chains) > 0 {
		l.drop(b, h, len(l.chains)-1)
	}
}

// finish records the end of a request recorded with keys, and corrects the
// chains with what the worker reported of it: blockTokens is the tokens of
// one of keys' blocks, as predictions count them.
//
// A hit shorter than predicted means the worker held less of the prompt
// than its chains said: it restarted, or evicted. The prompt itself is
// held now (the engine just computed it), but every other idle chain that
// shares more of it than was found is cut where the hit stopped, and
// dropped when nothing was found. Chains with requests in flight are left
// alone: a sibling that arrived while they were prefilling finds less
// than they will hold.
func (l *learned) finish(b *blocks, h holder, keys []uint64, u Usage, blockTokens int) {
	// The request's chain holds its keys, or grew from them since.
	var own *chain
	for _, c := range l.chains {
		if c.busy > 0 && len(c.keys) >= len(keys) && commonPrefix(c.keys, keys) == len(keys) {
			own = c
			c.busy--
			break
		}
	}
	if !u.OK || u.PromptTokens <= 0 || len(keys) == 0 || blockTokens <= 0 {
		return
	}
	found := len(keys) * min(u.CachedTokens, u.PromptTokens) / u.PromptTokens
	// One block of slack: the engine's tokens (its chat template's among
	// them) do not split into blocks exactly as the router's do.
	if found+1 >= u.PredictedTokens/blockTokens {
		return
	}
	for i := len(l.chains) - 1; i >= 0; i-- {
		c := l.chains[i]
		if c == own || c.busy > 0 || commonPrefix(c.keys, keys) <= found {
			continue
		}
		if found == 0 {
			l.drop(b, h, i)
			continue
		}
		l.unref(b, h, c.keys[found:])
		c.keys = c.keys[:found]
	}
}
