package sim

import (
	"slices"
	"sync/atomic"

	"github.com/batonllm/baton/transfer"
)

// Seq is a sequence's part in a Batch: what its owner sets before queueing
// it, and what the step keeps of it. Types that embed Seq are Sequences.
type Seq struct {
	// Set before the sequence is queued.
	NS     transfer.Namespace // model and tenant salt of its blocks
	Keys   []uint64           // full prompt blocks' chained keys
	Prompt int                // prompt tokens
	// Blocks is what the sequence needs in all: prompt and completion, or
	// the prompt alone when PrefillOnly.
	Blocks int64
	// PrefillOnly sequences leave the batch once their prompt is
	// computed (Hooks.Prefilled); the others generate (Hooks.Token).
	PrefillOnly bool

	// Set on admission.
	Hits   int // leading keys found cached
	Cached int // prompt tokens reported cached: the prompt's last is always computed

	Held      int   // Keys[:Held] are referenced in the cache
	Reserved  int64 // reserved blocks not yet committed or freed
	Computed  int   // prompt tokens in the KV cache (cached or prefilled)
	Chunk     int   // prefill tokens scheduled this step
	Decode    bool  // decodes a token this step
	Generated int   // tokens generated

	pending int // tokens counted in Batch.WaitingPrefill
}

// Sequence is what a Batch schedules: a pointer to a type embedding Seq.
type Sequence interface{ core() *Seq }

func (s *Seq) core() *Seq { return s }

// Prefilled reports whether the whole prompt is in the KV cache.
func (s *Seq) Prefilled() bool { return s.Computed >= s.Prompt }

// Context is the number of tokens the sequence attends to when decoding.
func (s *Seq) Context() int { return s.Prompt + s.Generated }

// Hooks are a Batch owner's part of each step. The batch calls them from
// Schedule and Complete, on the goroutine that drives it.
type Hooks[S Sequence] struct {
	// Admitted, if set: s left the queue for the batch; h is what it
	// found cached (its Seq's admission fields are set).
	Admitted func(s S, h Hits)
	// Drop, if set, is asked first of each running sequence when a step
	// completes: true takes s out of the batch untouched by the step, its
	// blocks released by the hook (Batch.Release).
	Drop func(s S) bool
	// Prefilled: s, PrefillOnly, has its whole prompt computed and leaves
	// the batch, its partial block freed; Keys[:Held] stay referenced
	// for the owner to release (Cache.Release).
	Prefilled func(s S)
	// Token: s generated token number Generated. True ends s: it leaves
	// the batch, and the hook releases its blocks (Batch.Release).
	Token func(s S) (done bool)
}

// Step is one planned step.
type Step struct {
	// Seconds is its modelled time: the decode step, the prefill chunks
	// and the PCIe copies.
	Seconds float64
	// Batch counts the sequences that prefill or decode in it (0:
	// nothing can run), Decodes those that decode.
	Batch, Decodes int
	// Promoted counts the blocks copied from the CPU tier at admission,
	// in PCIeSeconds (part of Seconds).
	Promoted    int
	PCIeSeconds float64
}

// Batch is the simulated engine's continuous batching, as vLLM's scheduler
// does it: chunked prefill over the paged prefix Cache, each step charged
// by the cost model. It keeps no clock: Engine sleeps a step's modelled
// time between Schedule and Complete, and bench/vsim schedules Complete on
// its virtual clock. One goroutine drives it; WaitingPrefill may be read
// from any.
type Batch[S Sequence] struct {
	// Queue holds the waiting sequences in arrival order, Run the
	// admitted ones.
	Queue, Run []S

	batching Batching
	cost     CostModel
	cache    *Cache
	pcie     func(blocks int) float64
	hooks    Hooks[S]
	pending  atomic.Int64
}

// NewBatch returns an empty batch of cfg's bounds (defaults applied) over
// cache, charging steps with cm and promotions from the CPU tier with
// pcie.
func NewBatch[S Sequence](cfg Batching, cm CostModel, cache *Cache, pcie func(blocks int) float64, h Hooks[S]) *Batch[S] {
	return &Batch[S]{batching: cfg.WithDefaults(), cost: cm, cache: cache, pcie: pcie, hooks: h}
}

// Enqueue queues s, its whole prompt still to prefill.
func (b *Batch[S]) Enqueue(s S) {
	b.SetPending(s, s.core().Prompt)
	b.Queue = append(b.Queue, s)
}

// WaitingPrefill is the prompt tokens still to prefill: whole prompts of
// queued sequences, the rest of partly prefilled ones (and of those an
// owner counts with SetPending before queueing them).
func (b *Batch[S]) WaitingPrefill() int64 { return b.pending.Load() }

// SetPending sets the prompt tokens s still has to prefill, as
// WaitingPrefill counts them. The driving goroutine, or whoever owns s
// before it is queued.
func (b *Batch[S]) SetPending(s S, n int) {
	q := s.core()
	b.pending.Add(int64(n - q.pending))
	q.pending = n
}

// Release drops s's references to its blocks and its reservation, and
// its tokens from WaitingPrefill.
func (b *Batch[S]) Release(s S) {
	q := s.core()
	b.cache.Release(q.Keys[:q.Held], q.Reserved)
	q.Held, q.Reserved = 0, 0
	b.SetPending(s, 0)
}

// Schedule plans one step: running sequences first (one decode token
// each, or their next prefill chunk), then queued ones in arrival order
// while they fit in Batching.MaxRunning, the cache and the token budget.
func (b *Batch[S]) Schedule() Step {
	budget := b.batching.MaxBatchedTokens
	decodes, decodeCtx := 0, 0
	prefill := 0.0
	for _, s := range b.Run {
		q := s.core()
		q.Chunk, q.Decode = 0, false
		if budget == 0 {
			continue
		}
		if q.Prefilled() {
			q.Decode = true
			decodes++
			decodeCtx += q.Context()
			budget--
			continue
		}
		q.Chunk = min(q.Prompt-q.Computed, budget)
		budget -= q.Chunk
		prefill += b.cost.PrefillSeconds(q.Chunk, q.Computed)
	}
	admitted, promoted := 0, 0
	for _, s := range b.Queue {
		if budget == 0 || len(b.Run) >= b.batching.MaxRunning {
			break
		}
		q := s.core()
		h, ok := b.cache.Acquire(q.NS, q.Keys, q.Blocks-int64(len(q.Keys)))
		if !ok {
			break // first come, first served: no overtaking
		}
		q.Hits, q.Held = h.N, h.N
		q.Reserved = q.Blocks - int64(h.N)
		q.Cached = min(h.N*BlockTokens, q.Prompt-1)
		q.Computed = q.Cached
		b.SetPending(s, q.Prompt-q.Computed)
		if b.hooks.Admitted != nil {
			b.hooks.Admitted(s, h)
		}
		promoted += h.CPU
		q.Chunk, q.Decode = min(q.Prompt-q.Computed, budget), false
		budget -= q.Chunk
		prefill += b.cost.PrefillSeconds(q.Chunk, q.Computed)
		b.Run = append(b.Run, s)
		admitted++
	}
	if admitted > 0 {
		clear(b.Queue[:admitted])
		b.Queue = b.Queue[admitted:]
	}
	var st Step
	for _, s := range b.Run {
		if q := s.core(); q.Chunk > 0 || q.Decode {
			st.Batch++
		}
	}
	if st.Batch == 0 {
		return Step{}
	}
	// Blocks promoted from the CPU tier are copied over PCIe before the
	// step computes (synchronously, as vLLM's swap-in).
	st.Decodes, st.Promoted, st.PCIeSeconds = decodes, promoted, b.pcie(promoted)
	st.Seconds = b.cost.DecodeStepSeconds(decodes, decodeCtx) + prefill + st.PCIeSeconds
	return st
}

// Complete applies the step Schedule planned: prefill chunks enter the
// cache (full blocks committed), and every sequence that finished its
// prefill or decoded generates a token.
func (b *Batch[S]) Complete() {
	b.Run = slices.DeleteFunc(b.Run, func(s S) bool {
		if b.hooks.Drop != nil && b.hooks.Drop(s) {
			return true
		}
		q := s.core()
		if q.Chunk > 0 {
			q.Computed += q.Chunk
			b.SetPending(s, q.Prompt-q.Computed)
			if full := min(len(q.Keys), q.Computed/BlockTokens); full > q.Held {
				b.cache.Commit(q.NS, q.Keys[q.Held:full])
				q.Reserved -= int64(full - q.Held)
				q.Held = full
			}
			if !q.Prefilled() {
				return false
			}
			if q.PrefillOnly {
				b.cache.Release(nil, q.Reserved)
				q.Reserved = 0
				b.hooks.Prefilled(s)
				return true
			}
		} else if !q.Decode {
			return false
		}
		q.Generated++
		return b.hooks.Token(s)
	})
}
