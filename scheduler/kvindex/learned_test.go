package kvindex

import (
	"fmt"
	"testing"
	"time"
)

// docBlocks is the blocks of a document in these tests; a question adds
// one.
const docBlocks = 8

// question returns the keys of question q about document d: the
// document's blocks, then the question's own.
func question(d, q int) []uint64 {
	ks := make([]uint64, 0, docBlocks+1)
	for i := range docBlocks {
		ks = append(ks, uint64(d*1000+i))
	}
	return append(ks, uint64(d*1000+500+q))
}

// served records a request on name and finishes it with a full hit of
// what was predicted, as an engine that kept everything would report.
func served(x *Index, name string, ks []uint64) {
	h := lookup(x, ks, name)[name]
	x.Predict(name, ks)
	x.Finished(name, ks, Usage{OK: true, PromptTokens: len(ks) * 16, CachedTokens: h.GPU * 16, PredictedTokens: h.GPU * 16})
}

func gpuHit(x *Index, ks []uint64, name string) int { return lookup(x, ks, name)[name].GPU }

func TestLearnedKeepsWhatWasRouted(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	x := New(Config{Now: clk.Now})
	if err := x.Learn("w", Capacity{}); err != nil {
		t.Fatal(err)
	}
	served(x, "w", question(1, 0))
	clk.Add(time.Hour) // far past PredictTTL
	if got, want := gpuHit(x, question(1, 1), "w"), docBlocks; got != want {
		t.Errorf("a document routed an hour ago: %d blocks found, want %d", got, want)
	}
	// A worker that is not learned forgets its predictions.
	x.AddWorker("p")
	x.Predict("p", question(2, 0))
	clk.Add(time.Hour)
	if got := gpuHit(x, question(2, 1), "p"); got != 0 {
		t.Errorf("a prediction an hour old on a worker with events: %d blocks found, want 0", got)
	}
}

// A worker with slots keeps one prompt per slot: a question takes the slot
// of its document, a new document the least recently used one.
func TestLearnedSlots(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{Prompts: 2})
	served(x, "w", question(1, 0))
	served(x, "w", question(2, 0))
	served(x, "w", question(1, 1)) // document 1's slot: both stay
	for _, d := range []int{1, 2} {
		if got := gpuHit(x, question(d, 9), "w"); got != docBlocks {
			t.Errorf("document %d with two slots for two documents: %d blocks found, want %d", d, got, docBlocks)
		}
	}
	served(x, "w", question(3, 0)) // evicts document 2, used least lately
	for d, want := range map[int]int{1: docBlocks, 2: 0, 3: docBlocks} {
		if got := gpuHit(x, question(d, 9), "w"); got != want {
			t.Errorf("after a third document, document %d: %d blocks found, want %d", d, got, want)
		}
	}
}

// A slot serving a request takes no other: a sibling that arrives meanwhile
// takes another slot, and both hold the document.
func TestLearnedBusySlot(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{Prompts: 2})
	served(x, "w", question(2, 0))
	a, b := question(1, 0), question(1, 1)
	x.Predict("w", a)
	x.Predict("w", b) // a's slot is busy: b takes document 2's
	if got := gpuHit(x, question(2, 9), "w"); got != 0 {
		t.Errorf("document 2 after two requests for document 1 in flight: %d blocks found, want 0", got)
	}
	x.Finished("w", b, Usage{OK: true, PromptTokens: 100, CachedTokens: 0, PredictedTokens: docBlocks * 16})
	x.Finished("w", a, Usage{OK: true, PromptTokens: 100, CachedTokens: 0, PredictedTokens: 0})
	// b found nothing, as it should not have expected: a was in flight,
	// so its chain stays.
	if got := gpuHit(x, question(1, 9), "w"); got != docBlocks {
		t.Errorf("document 1: %d blocks found, want %d", got, docBlocks)
	}
}

func TestLearnedBlockCapacity(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{Blocks: 2*docBlocks + 3})
	served(x, "w", question(1, 0))
	served(x, "w", question(1, 1)) // shares the document: 10 blocks
	served(x, "w", question(2, 0)) // 19: all fit
	for d, want := range map[int]int{1: docBlocks, 2: docBlocks} {
		if got := gpuHit(x, question(d, 9), "w"); got != want {
			t.Errorf("document %d: %d blocks found, want %d", d, got, want)
		}
	}
	served(x, "w", question(3, 0)) // 28: evicts (1, 0), then (1, 1)
	for d, want := range map[int]int{1: 0, 2: docBlocks, 3: docBlocks} {
		if got := gpuHit(x, question(d, 9), "w"); got != want {
			t.Errorf("after a third document, document %d: %d blocks found, want %d", d, got, want)
		}
	}
}

// The capacity a worker reports (slots, blocks) bounds it when none is
// configured.
func TestLearnedReportedCapacity(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{})
	mustApply(t, x, "w", snapshot(&Load{Slots: 1}))
	served(x, "w", question(1, 0))
	served(x, "w", question(2, 0))
	if got := gpuHit(x, question(1, 9), "w"); got != 0 {
		t.Errorf("one slot, second document routed: first document has %d blocks, want 0", got)
	}
	if got := gpuHit(x, question(2, 9), "w"); got != docBlocks {
		t.Errorf("one slot: second document has %d blocks, want %d", got, docBlocks)
	}
}

// Cached tokens correct the learned chains: a shorter hit than predicted
// cuts the other chains sharing the prompt where the hit stopped, none at
// all drops them; the prompt just served stays.
func TestLearnedFinishedCorrects(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cached int // blocks the worker found of question (1, 1)
		// wantQ0 is the blocks of question (1, 0) found: its document
		// through question (1, 1)'s chain, and its own block only if its
		// chain was kept whole.
		wantQ0 int
	}{
		{"as predicted", docBlocks, docBlocks + 1},
		{"half", docBlocks / 2, docBlocks},
		{"none", 0, docBlocks},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := New(Config{})
			x.Learn("w", Capacity{})
			x.Learn("v", Capacity{})
			served(x, "w", question(1, 0))
			served(x, "v", question(1, 0))
			ks := question(1, 1)
			x.Predict("w", ks)
			x.Finished("w", ks, Usage{OK: true, PromptTokens: len(ks) * 10, CachedTokens: tc.cached * 10, PredictedTokens: docBlocks * 16})
			// Question (1, 1)'s own chain is held: its document is.
			if got := gpuHit(x, question(1, 9), "w"); got != docBlocks {
				t.Errorf("the document just served: %d blocks found, want %d", got, docBlocks)
			}
			if got := gpuHit(x, question(1, 0), "w"); got != tc.wantQ0 {
				t.Errorf("question (1, 0): %d blocks found, want %d", got, tc.wantQ0)
			}
			if got := gpuHit(x, question(1, 0), "v"); got != docBlocks+1 {
				t.Errorf("another worker's chain: %d blocks found, want %d", got, docBlocks+1)
			}
		})
	}
}

func TestLearnedRemoveWorker(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{})
	served(x, "w", question(1, 0))
	x.RemoveWorker("w")
	if n := x.Len(); n != 0 {
		t.Errorf("blocks indexed after the worker left: %d, want 0", n)
	}
	x.Learn("w", Capacity{})
	if got := gpuHit(x, question(1, 9), "w"); got != 0 {
		t.Errorf("a worker back under the same name: %d blocks found, want 0", got)
	}
}

// BenchmarkPredictLearned records a request on a learned worker holding
// chains chains of 120 blocks, all sharing a 100-block system prompt: the
// scan for the chain it shares most with is the cost.
func BenchmarkPredictLearned(b *testing.B) {
	for _, chains := range []int{64, 256, 1024} {
		b.Run(fmt.Sprintf("chains=%d", chains), func(b *testing.B) {
			x := New(Config{})
			x.Learn("w", Capacity{Blocks: 1 << 30})
			shared := keys(0, 100)
			chain := func(i int) []uint64 {
				return append(append([]uint64(nil), shared...), keys(uint64(1000+i*20), uint64(1000+i*20+20))...)
			}
			for i := range chains {
				ks := chain(i)
				x.Predict("w", ks)
				x.Finished("w", ks, Usage{})
			}
			ks := chain(chains / 2)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				x.Predict("w", ks)
				x.Finished("w", ks, Usage{})
			}
		})
	}
}

// With every slot busy a request takes the least recently used one; the
// request that slot was serving ends without holding a slot forever.
func TestLearnedAllSlotsBusy(t *testing.T) {
	x := New(Config{})
	x.Learn("w", Capacity{Prompts: 2})
	a, b, c := question(1, 0), question(2, 0), question(3, 0)
	x.Predict("w", a)
	x.Predict("w", b)
	x.Predict("w", c) // both busy: takes a's
	for _, ks := range [][]uint64{a, b, c} {
		x.Finished("w", ks, Usage{})
	}
	served(x, "w", question(4, 0)) // takes b's, the least recently used
	served(x, "w", question(5, 0)) // takes c's: every slot is idle
	for d, want := range map[int]int{2: 0, 3: 0, 4: docBlocks, 5: docBlocks} {
		if got := gpuHit(x, question(d, 9), "w"); got != want {
			t.Errorf("document %d: %d blocks found, want %d", d, got, want)
		}
	}
}
