package kvindex

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// Two replicas' indexes, one sharing its predictions with the other as a
// scheduler does: what one routes, the other finds, on an event-fed and
// on a learned worker, and nothing comes back to the first.
func TestShared(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	type heard struct {
		worker string
		keys   []uint64
	}
	var said []heard
	var b *Index
	a := New(Config{Now: clk.Now, PredictTTL: 2 * time.Second, OnPredict: func(w string, ks []uint64) {
		said = append(said, heard{w, ks})
		b.Shared(w, ks)
	}})
	bSaid := 0
	b = New(Config{Now: clk.Now, PredictTTL: 2 * time.Second, OnPredict: func(string, []uint64) { bSaid++ }})
	for _, x := range []*Index{a, b} {
		mustApply(t, x, "e", snapshot(nil))
		x.Learn("l", Capacity{Prompts: 1})
	}
	a.Predict("e", keys(0, 4))
	a.Predict("l", question(1, 0))
	a.Predict("gone", keys(0, 4)) // not tracked: not heard
	if diff := cmp.Diff([]heard{{"e", keys(0, 4)}, {"l", question(1, 0)}}, said, cmp.AllowUnexported(heard{})); diff != "" {
		t.Errorf("heard (-want +got):\n%s", diff)
	}
	if got := gpuHit(b, keys(0, 6), "e"); got != 4 {
		t.Errorf("b finds %d of the blocks a predicted on e, want 4", got)
	}
	if got := gpuHit(b, question(1, 5), "l"); got != docBlocks {
		t.Errorf("b finds %d of document 1's blocks on l, want %d", got, docBlocks)
	}
	if bSaid != 0 {
		t.Errorf("b heard %d predictions of its own; it made none", bSaid)
	}
	// a's request is prefilling e's 4 blocks, which b counts until e's
	// next load report; it is no request b routed.
	out := make([]Match, 1)
	b.Lookup(keys(0, 4), []string{"e"}, out)
	if want := int64(4 * out[0].BlockTokens); out[0].PendingTokens != want || out[0].Routed != 0 {
		t.Errorf("b's view of e: pending %d tokens, routed %g; want %d (a's prefill), 0", out[0].PendingTokens, out[0].Routed, want)
	}
	// Shared again, the blocks e already holds add nothing.
	b.Shared("e", keys(0, 4))
	b.Lookup(keys(0, 4), []string{"e"}, out)
	if want := int64(4 * out[0].BlockTokens); out[0].PendingTokens != want {
		t.Errorf("b's view of e after the same blocks shared again: pending %d tokens, want %d", out[0].PendingTokens, want)
	}
	// A shared chain is no request of b's: a request b routes to l for
	// another document takes l's one slot.
	b.Predict("l", question(2, 0))
	if got := gpuHit(b, question(1, 5), "l"); got != 0 {
		t.Errorf("document 1 on l after b routed document 2 there: %d blocks, want 0 (one slot)", got)
	}
	// An event-fed worker's shared prediction lapses as b's own would.
	clk.Add(2 * time.Second)
	if got := gpuHit(b, keys(0, 6), "e"); got != 0 {
		t.Errorf("after the TTL b finds %d blocks on e, want 0", got)
	}
}
