package kvindex

import (
	"slices"
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
	a := New(Config{Now: clk.Now, PredictTTL: 2 * time.Second, OnPredict: func(p Prediction) {
		said = append(said, heard{p.Worker, p.Keys})
		b.Shared(p)
	}})
	bSaid := 0
	b = New(Config{Now: clk.Now, PredictTTL: 2 * time.Second, OnPredict: func(Prediction) { bSaid++ }})
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
	// Shared again as an older replica sends it (pending unknown), the
	// blocks e already holds add nothing.
	b.Shared(Prediction{Worker: "e", Keys: keys(0, 4), Pending: -1})
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

// A decision reaches another replica after the worker's cache events for
// the request itself (the engine announced the blocks as it admitted
// it): its prefill still counts, as on the deciding replica, until a load
// report that followed the decision.
func TestSharedPendingAfterTheRequestsOwnEvents(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	var sent []Prediction
	a := New(Config{Now: clk.Now, OnPredict: func(p Prediction) {
		p.Keys = slices.Clone(p.Keys)
		sent = append(sent, p)
	}})
	b := New(Config{Now: clk.Now})
	for _, x := range []*Index{a, b} {
		mustApply(t, x, "e", snapshot(nil, stored(gpu, keys(0, 2))))
	}
	pending := func(x *Index) int64 {
		out := make([]Match, 1)
		x.Lookup(nil, []string{"e"}, out)
		return out[0].PendingTokens / int64(out[0].BlockTokens)
	}
	a.Predict("e", keys(0, 6)) // e holds 2 of the 6 blocks
	if len(sent) != 1 || sent[0].Pending != 4 || !sent[0].At.Equal(clk.Now()) {
		t.Fatalf("shared %+v, want one decision of 4 pending blocks at %v", sent, clk.Now())
	}
	if got := pending(a); got != 4 {
		t.Fatalf("a counts %d pending blocks, want 4", got)
	}
	// e's events for the request reach b first, then a's decision.
	clk.Add(3 * time.Millisecond)
	mustApply(t, b, "e", event(2, stored(gpu, keys(2, 6))))
	b.Shared(sent[0])
	if got := pending(b); got != 4 {
		t.Errorf("b counts %d pending blocks of a's request, want 4 (as a does)", got)
	}
	if got := gpuHit(b, keys(0, 6), "e"); got != 6 {
		t.Errorf("b finds %d blocks on e, want 6", got)
	}

	// A load report after the decision counts the request: shared after
	// it, the decision adds nothing.
	c := New(Config{Now: clk.Now})
	mustApply(t, c, "e", snapshot(nil))
	mustApply(t, c, "e", loadEvent(2, Load{Waiting: 1, WaitingPrefillTokens: 64}))
	c.Shared(sent[0])
	if got := pending(c); got != 0 {
		t.Errorf("after a load report newer than the decision: %d pending blocks, want 0", got)
	}
	// Nor does a decision older than the prediction TTL.
	d := New(Config{Now: clk.Now})
	mustApply(t, d, "e", snapshot(nil))
	clk.Add(DefaultPredictTTL)
	d.Shared(sent[0])
	if got := pending(d); got != 0 {
		t.Errorf("a decision %v old: %d pending blocks, want 0", DefaultPredictTTL, got)
	}
	// Another, recent, counts on d, whose pending tokens had lapsed.
	d.Shared(Prediction{Worker: "e", Keys: keys(10, 13), Pending: 3, At: clk.Now().Add(-time.Millisecond)})
	if got := pending(d); got != 3 {
		t.Errorf("a fresh decision of 3 pending blocks: %d, want 3", got)
	}
	if d.Shared(Prediction{Worker: "gone", Keys: keys(0, 1), Pending: 1, At: clk.Now()}) {
		t.Error("Shared reported a worker d does not track as recorded")
	}
}

// Every replica corrects a worker's estimates from all the requests it
// served: an observation one replica makes, shared, moves the other's
// correction factor as it moves its own.
func TestSharedTTFT(t *testing.T) {
	clk := &clock{now: time.Unix(1000, 0)}
	var b *Index
	heard := 0
	a := New(Config{Now: clk.Now, OnObserve: func(o Observation) {
		heard++
		if !b.SharedTTFT(o) {
			t.Errorf("b does not track %q", o.Worker)
		}
	}})
	b = New(Config{Now: clk.Now})
	c := New(Config{Now: clk.Now}) // shares nothing
	for _, x := range []*Index{a, b, c} {
		mustApply(t, x, "e", snapshot(nil))
	}
	correction := func(x *Index) float64 {
		out := make([]Match, 1)
		x.Lookup(nil, []string{"e"}, out)
		return out[0].Correction
	}
	a.ObserveTTFT("e", time.Second, 2*time.Second)
	a.ObserveTTFT("e", 0, time.Second)                // invalid: not shared
	a.ObserveTTFT("gone", time.Second, 2*time.Second) // untracked: not shared
	if heard != 1 {
		t.Errorf("OnObserve heard %d observations, want 1", heard)
	}
	if got, want := correction(b), correction(a); got != want || want == 1 {
		t.Errorf("b's correction %v, a's %v: want equal, and not 1", got, want)
	}
	if got := correction(c); got != 1 {
		t.Errorf("c, which heard nothing: correction %v, want 1", got)
	}
	if b.SharedTTFT(Observation{Worker: "gone", Predicted: time.Second, Achieved: time.Second}) {
		t.Error("SharedTTFT reported an untracked worker as recorded")
	}
}
