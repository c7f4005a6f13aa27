package sim

import (
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/engine"
)

// seq is one sequence. The step loop owns every field but cancelled and
// the stream's own state.
type seq struct {
	id      string
	ns      transfer.Namespace // model and tenant salt of its blocks
	keys    []uint64           // full prompt blocks' chained keys
	prompt  int                // prompt tokens
	limit   int                // max tokens
	hash    uint64             // prompt hash: seeds the completion
	nat     int                // natural completion length
	blocks  int64              // blocks the sequence needs in all
	adapter string             // the LoRA adapter it runs with, if any
	// transferred: Decode with a transfer; its cached blocks were pushed
	// by a prefill worker, not reused here.
	transferred bool

	// Set on admission.
	hits   int // leading keys found cached
	cached int // prompt tokens reported cached
	// cached by tier (they sum to cached).
	cachedGPU, cachedCPU, cachedRedis int
	// keys[fetchLo:fetchHi] were fetched from the shared tier before
	// queueing (fetch).
	fetchLo, fetchHi int
	pending          int   // tokens counted in Load.WaitingPrefillTokens
	held             int   // keys[:held] are referenced in the cache
	reserved         int64 // reserved blocks not yet committed or freed

	computed  int // prompt tokens in the KV cache (cached or prefilled)
	chunk     int // prefill tokens scheduled this step
	decode    bool
	generated int
	unsent    int // tokens generated but held back from the stream
	stopper   stopper

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
	over := h.N*BlockTokens - s.cached
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

// prefilled reports whether the whole prompt is in the KV cache.
func (s *seq) prefilled() bool { return s.computed >= s.prompt }

// context is the number of tokens the sequence attends to when decoding.
func (s *seq) context() int { return s.prompt + s.generated }

// emit generates the next token and reports whether the sequence ended.
func (s *seq) emit() (done bool) {
	s.generated++
	s.unsent++
	out, stopped := s.stopper.add(word(s.hash, s.generated-1))
	if out != "" {
		s.st.push(out, s.unsent)
		s.unsent = 0
	}
	reason := ""
	switch {
	case stopped || s.generated == s.nat:
		reason = "stop"
	case s.generated >= s.limit:
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
		PromptTokens:     s.prompt,
		CachedTokens:     s.cached,
		CompletionTokens: s.generated,
		CachedGPU:        s.cachedGPU,
		CachedCPU:        s.cachedCPU,
		CachedRedis:      s.cachedRedis,
	})
	return true
}
