package sim

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// next returns the subscription's next event, failing after a while.
func next(t *testing.T, sub *Subscription) WatchEvent {
	t.Helper()
	select {
	case ev, ok := <-sub.C:
		if !ok {
			t.Fatalf("subscription closed: %v", sub.Err())
		}
		return ev
	case <-time.After(5 * time.Second):
		t.Fatalf("no watch event")
	}
	return WatchEvent{}
}

func TestSubscribeSnapshotThenEvents(t *testing.T) {
	// TimeScale 10: the last request runs for tens of milliseconds, so a
	// load report (every 5 ms, when the load changed) sees it.
	// No CPU tier: evicted blocks are removed.
	e := newEngine(t, Config{LoadInterval: 5 * time.Millisecond, Tiers: Tiers{GPUBlocks: 30, CPUBlocks: -1}, TimeScale: 10})
	before := strings.Repeat("b", 64*2)
	generate(t, e, &engine.Request{Prompt: before})
	// The final event reaches the client before the engine frees the
	// sequence: the snapshot below must see it freed.
	waitIdle(t, e)

	sub, err := e.Subscribe()
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	first := next(t, sub)
	if first.Seq != 1 || first.Snapshot == nil {
		t.Fatalf("first event %+v, want a snapshot with seq 1", first)
	}
	beforeKeys := blockkey.Append(nil, blockkey.Seed(testModel, ""), before, 64)
	sorted := func(k []uint64) []uint64 { k = slices.Clone(k); slices.Sort(k); return k }
	if diff := cmp.Diff(sorted(beforeKeys), sorted(first.Snapshot.Keys)); diff != "" {
		t.Errorf("snapshot keys (-want +got):\n%s", diff)
	}
	if got := first.Snapshot.Load; got.BlocksTotal != 30 || got.BlocksUsed != 0 {
		t.Errorf("snapshot load %+v", got)
	}

	// Fill the cache so that blocks get evicted too.
	var stored, removed []uint64
	for i := range 3 {
		generate(t, e, &engine.Request{Prompt: strings.Repeat(string(rune('x'+i)), 64*10), MaxTokens: 1})
	}
	generate(t, e, &engine.Request{Prompt: "hold", MaxTokens: 100})
	seq := first.Seq
	sawLoad := false
	deadline := time.After(5 * time.Second)
	for len(stored) < 30 || !sawLoad {
		var ev WatchEvent
		select {
		case ev = <-sub.C:
		case <-deadline:
			t.Fatalf("stored %d keys, load seen %v", len(stored), sawLoad)
		}
		if ev.Seq != seq+1 {
			t.Fatalf("seq %d after %d", ev.Seq, seq)
		}
		seq = ev.Seq
		switch {
		case ev.Load != nil:
			sawLoad = true
		case ev.Cache != nil && ev.Cache.Kind == BlockStored:
			stored = append(stored, ev.Cache.Keys...)
		case ev.Cache != nil && ev.Cache.Kind == BlockRemoved:
			removed = append(removed, ev.Cache.Keys...)
		default:
			t.Fatalf("unexpected event %+v", ev)
		}
	}
	// Each request needs 11 blocks (160 prompt tokens and 1 generated):
	// the third finds 8 free and evicts the 3 least recently used blocks,
	// the snapshot's first, tail first. (The last request evicts more.)
	if want := []uint64{beforeKeys[1], beforeKeys[0]}; len(removed) < 3 || !slices.Equal(removed[:2], want) {
		t.Errorf("removed %d keys %v; want the snapshot's blocks among them", len(removed), removed)
	}
}

func TestSlowSubscriberDropped(t *testing.T) {
	e := newEngine(t, Config{WatchBuffer: 4})
	sub, err := e.Subscribe()
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	for i := range 10 {
		generate(t, e, &engine.Request{Prompt: strings.Repeat(string(rune('a'+i)), 64), MaxTokens: 1})
	}
	n := 0
	for range sub.C {
		n++
	}
	if n != 4 || !errors.Is(sub.Err(), ErrSlowSubscriber) {
		t.Errorf("read %d events, then err %v; want 4, ErrSlowSubscriber", n, sub.Err())
	}
	// The engine kept going, and a new subscription starts afresh.
	again, err := e.Subscribe()
	if err != nil {
		t.Fatal(err)
	}
	again.Close()
	again.Close()
	if _, ok := <-again.C; !ok {
		t.Errorf("snapshot lost on Close")
	}
}
