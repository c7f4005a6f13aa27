package sim

import (
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// seq is one sequence: its Seq in the engine's Batch, and what the
// engine adds (the completion's text, its stream, tiers, cancellation).
// The step loop owns every field but cancelled and the stream's own state.
type seq struct {
	Seq
	id      string
	limit   int    // max tokens
	hash    uint64 // prompt hash: seeds the completion
	nat     int    // natural completion length
	adapter string // the LoRA adapter it runs with, if any
	// transferred: Decode with a transfer; its cached blocks were pushed
	// by a prefill worker, not reused here.
	transferred bool

	// cached by tier, set on admission (they sum to Cached).
	cachedGPU, cachedCPU, cachedRedis int
	// Keys[fetchLo:fetchHi] were fetched from the shared tier before
	// queueing (fetch).
	fetchLo, fetchHi int

	unsent  int // tokens generated but held back from the stream
	stopper stopper

	st        *stream     // generating sequences
	pre       *prefillJob // prefill-only sequences (Prefill)
	queued    time.Time   // when it was handed to the step loop
	wake      func()
	cancelled atomic.Bool
}

// prefillJob is the hand-over between a prefill-only sequence and its
// Prefill call. The step loop writes every field, then closes done exactly
// once: with handed set when the prompt is computed (the caller then owns
// the references to keys[:held] and must release them), or without, when
// the sequence was cancelled or the engine closed (its blocks released).
type prefillJob struct {
	done      chan struct{}
	handed    bool
	err       error
	admitted  time.Time
	prefilled time.Time
}

// tierTokens splits the cached tokens by the tier they came from: blocks
// fetched from the shared tier before queueing count as Redis hits, CPU
// hits as CPU, the others as GPU. The prompt's last token, always
// recomputed, comes off the GPU count first.
func (s *seq) tierTokens(h Hits) {
	redis := max(0, min(s.fetchHi, h.N)-s.fetchLo)
	cpu := min(h.CPU, h.N-redis)
	gpu := h.N - redis - cpu
	s.cachedRedis, s.cachedCPU, s.cachedGPU = redis*BlockTokens, cpu*BlockTokens, gpu*BlockTokens
	over := h.N*BlockTokens - s.Cached
	for _, t := range []*int{&s.cachedGPU, &s.cachedCPU, &s.cachedRedis} {
		d := min(over, *t)
		*t -= d
		over -= d
	}
}

// end tells the sequence's consumer that the step loop dropped it with
// err, its blocks released. Step loop only.
func (s *seq) end(err error) {
	if s.pre != nil {
		s.pre.err = err
		close(s.pre.done)
		return
	}
	s.st.fail(err)
}

// cancel marks the sequence for removal by the step loop and wakes it.
// Safe from any goroutine, idempotent.
func (s *seq) cancel() {
	if s.cancelled.CompareAndSwap(false, true) {
		s.wake()
	}
}

// emit generates the next token and reports whether the sequence ended.
func (s *seq) emit() (done bool) {
	s.unsent++
	out, stopped := s.stopper.add(word(s.hash, s.Generated-1))
	if out != "" {
		s.st.push(out, s.unsent)
		s.unsent = 0
	}
	reason := ""
	switch {
	case stopped || s.Generated == s.nat:
		reason = "stop"
	case s.Generated >= s.limit:
		reason = "length"
	default:
		return false
	}
	if !stopped {
		if out := s.stopper.flush(); out != "" || s.unsent > 0 {
			s.st.push(out, s.unsent)
		}
	}
	s.st.finish(engine.Final{
		FinishReason:     reason,
		PromptTokens:     s.Prompt,
		CachedTokens:     s.Cached,
		CompletionTokens: s.Generated,
		CachedGPU:        s.cachedGPU,
		CachedCPU:        s.cachedCPU,
		CachedRedis:      s.cachedRedis,
	})
	return true
}
