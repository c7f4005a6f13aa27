package watch_test

import (
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

func batch(evs ...kvevents.Event) kvevents.Batch { return kvevents.Batch{Events: evs} }

// requestKeys are the keys the scheduler computes for a request's tokens.
func requestKeys(model, lora, tenant string, tokens []uint32, bs int) []uint64 {
	return blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt(model, lora, tenant)), tokens, bs)
}

func cacheEvent(seq uint64, kind kvindex.CacheKind, tier kvindex.Tier, keys ...uint64) kvindex.Event {
	return kvindex.Event{Seq: seq, Cache: &kvindex.CacheEvent{Kind: kind, Tier: tier, Keys: keys}}
}

// translated is tr.Translate(b), copied out of the translator's memory,
// which its next Translate reuses.
func translated(tr *watch.Translator, b kvevents.Batch) []kvindex.Event {
	var out []kvindex.Event
	for _, ev := range tr.Translate(b) {
		if ev.Cache != nil {
			c := *ev.Cache
			c.Keys = slices.Clone(c.Keys)
			ev.Cache = &c
		}
		out = append(out, ev)
	}
	return out
}

func snapshot(seq uint64) kvindex.Event {
	return kvindex.Event{Seq: seq, Snapshot: &kvindex.Snapshot{}}
}

// TestTranslatorKeysMatchRequests is the point of the translator: the keys
// of the blocks an engine reports are the keys of the request's tokens.
func TestTranslatorKeysMatchRequests(t *testing.T) {
	for name, hashes := range map[string][]kvevents.Hash{
		"int hashes":   kveventstest.IntHashes(101, 102, 103),
		"bytes hashes": kveventstest.BytesHashes("a", "b", "c"),
	} {
		t.Run(name, func(t *testing.T) {
			tokens := kveventstest.TokenRun(500, 12)
			want := requestKeys("m", "", "", tokens, 4)
			tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
			got := translated(tr, batch(
				&kvevents.BlockStored{BlockHashes: hashes[:2], TokenIDs: tokens[:8], BlockSize: 4},
				&kvevents.BlockStored{BlockHashes: hashes[2:], Parent: hashes[1], TokenIDs: tokens[8:], BlockSize: 4, Medium: "GPU"},
			))
			got = append(got, translated(tr, batch(&kvevents.BlockRemoved{BlockHashes: hashes[1:2]}))...)
			wantEvs := []kvindex.Event{
				snapshot(1),
				cacheEvent(2, kvindex.Stored, kvindex.TierGPU, want[0], want[1]),
				cacheEvent(3, kvindex.Stored, kvindex.TierGPU, want[2]),
				cacheEvent(4, kvindex.Removed, kvindex.TierGPU, want[1]),
			}
			if diff := cmp.Diff(wantEvs, got); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if tr.BlockSize() != 4 || tr.Len() != 2 {
				t.Errorf("BlockSize, Len = %d, %d; want 4, 2", tr.BlockSize(), tr.Len())
			}
		})
	}
}

// TestTranslatorFeedsTheIndex applies the translator's events to a real
// index and looks a request up.
func TestTranslatorFeedsTheIndex(t *testing.T) {
	ix := kvindex.New(kvindex.Config{})
	if err := ix.AddWorker("w"); err != nil {
		t.Fatal(err)
	}
	tokens := kveventstest.TokenRun(0, 16)
	tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
	apply := func(b kvevents.Batch) {
		t.Helper()
		for _, ev := range tr.Translate(b) {
			if err := ix.Apply("w", ev); err != nil {
				t.Fatalf("Apply(%+v): %v", ev, err)
			}
		}
	}
	lookup := func() kvindex.Match {
		out := make([]kvindex.Match, 1)
		ix.Lookup(requestKeys("m", "", "", tokens, 4), []string{"w"}, out)
		return out[0]
	}
	apply(batch(&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1, 2, 3, 4), TokenIDs: tokens, BlockSize: 4}))
	if m := lookup(); m.GPU != 4 {
		t.Fatalf("after store: %d GPU blocks found, want 4", m.GPU)
	}
	apply(batch(
		&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(3, 4), Parent: kvevents.IntHash(2), TokenIDs: tokens[8:], BlockSize: 4, Medium: "CPU"},
		&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(3, 4), Medium: "GPU"},
	))
	if m := lookup(); m.GPU != 2 || m.CPU != 2 {
		t.Fatalf("after offload: GPU %d, CPU %d; want 2, 2", m.GPU, m.CPU)
	}
	apply(batch(&kvevents.AllBlocksCleared{}))
	if m := lookup(); m.GPU+m.CPU != 0 {
		t.Fatalf("after clear: GPU %d, CPU %d; want none", m.GPU, m.CPU)
	}
	if tr.Len() != 0 {
		t.Errorf("after clear the translator maps %d hashes", tr.Len())
	}
}

func TestTranslatorSalts(t *testing.T) {
	tokens := kveventstest.TokenRun(0, 4)
	tests := []struct {
		name            string
		ev              *kvevents.BlockStored
		lora, tenant    string
		tenantFromEvent func(*kvevents.BlockStored) string
	}{
		{name: "no salt", ev: &kvevents.BlockStored{}},
		{name: "lora name", ev: &kvevents.BlockStored{LoRAName: "sql", HasLoRAID: true, LoRAID: 3}, lora: "sql"},
		{name: "lora id only", ev: &kvevents.BlockStored{HasLoRAID: true, LoRAID: 3}, lora: "lora-id:3"},
		{name: "sglang cache salt", ev: &kvevents.BlockStored{CacheSalt: "t1"}, tenant: "t1"},
		{name: "vllm cache salt in extra keys", ev: &kvevents.BlockStored{ExtraKeys: [][]string{{"t2"}}}, tenant: "t2"},
		{name: "vllm lora and cache salt", ev: &kvevents.BlockStored{LoRAName: "sql", ExtraKeys: [][]string{{"sql", "t3"}}},
			lora: "sql", tenant: "t3"},
		{name: "vllm lora without salt", ev: &kvevents.BlockStored{LoRAName: "sql", ExtraKeys: [][]string{{"sql"}}}, lora: "sql"},
		{name: "tenant hook", ev: &kvevents.BlockStored{CacheSalt: "ignored"}, tenant: "hooked",
			tenantFromEvent: func(*kvevents.BlockStored) string { return "hooked" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.ev.BlockHashes, tt.ev.TokenIDs, tt.ev.BlockSize = kveventstest.IntHashes(1), tokens, 4
			tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m", Tenant: tt.tenantFromEvent})
			evs := tr.Translate(batch(tt.ev))
			want := requestKeys("m", tt.lora, tt.tenant, tokens, 4)
			if diff := cmp.Diff(want, evs[1].Cache.Keys); diff != "" {
				t.Errorf("keys (-want +got):\n%s", diff)
			}
		})
	}
}

func TestTranslatorEdges(t *testing.T) {
	tokens := kveventstest.TokenRun(0, 8)
	keys := requestKeys("", "", "", tokens, 4)
	tests := []struct {
		name  string
		cfg   watch.TranslatorConfig
		in    []kvevents.Event
		want  []kvindex.Event // after the initial snapshot
		stats watch.TranslatorStats
	}{{
		name:  "unknown parent: dropped and counted",
		in:    []kvevents.Event{&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(2), Parent: kvevents.IntHash(1), TokenIDs: tokens[4:], BlockSize: 4}},
		stats: watch.TranslatorStats{UnknownParent: 1},
	}, {
		name:  "unknown removal: counted",
		in:    []kvevents.Event{&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(9)}},
		stats: watch.TranslatorStats{UnknownRemoved: 1},
	}, {
		name:  "token count not blocks times size",
		in:    []kvevents.Event{&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1, 2), TokenIDs: tokens[:7], BlockSize: 4}},
		stats: watch.TranslatorStats{BadStored: 1},
	}, {
		name: "disk medium: mapped for chaining, not indexed",
		in: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4, Medium: "DISK"},
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(2), Parent: kvevents.IntHash(1), TokenIDs: tokens[4:], BlockSize: 4},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1), Medium: "DISK"},
		},
		want:  []kvindex.Event{cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[1])},
		stats: watch.TranslatorStats{Stored: 1, OtherMedium: 2},
	}, {
		name: "another cache group: skipped",
		cfg:  watch.TranslatorConfig{Group: 1},
		in: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4, HasGroup: true},
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4, HasGroup: true, Group: 1},
		},
		want:  []kvindex.Event{cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[0])},
		stats: watch.TranslatorStats{Stored: 1, OtherGroup: 1},
	}, {
		name: "a CPU removal leaves the GPU copy",
		in: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4},
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4, Medium: "cpu"},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1), Medium: "CPU"},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1), Medium: "CPU"},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1)},
		},
		want: []kvindex.Event{
			cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[0]),
			cacheEvent(3, kvindex.Stored, kvindex.TierCPU, keys[0]),
			cacheEvent(4, kvindex.Removed, kvindex.TierCPU, keys[0]),
			cacheEvent(5, kvindex.Removed, kvindex.TierGPU, keys[0]),
		},
		stats: watch.TranslatorStats{Stored: 2, Removed: 2, UnknownRemoved: 1},
	}, {
		name: "a full map evicts its least recent entry and reports it removed",
		cfg:  watch.TranslatorConfig{MaxEntries: 1},
		in: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1, 2), TokenIDs: tokens, BlockSize: 4},
		},
		want: []kvindex.Event{
			cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[0], keys[1]),
			cacheEvent(3, kvindex.Removed, kvindex.TierGPU, keys[0]),
		},
		stats: watch.TranslatorStats{Stored: 2, Removed: 1, Evicted: 1},
	}, {
		name: "AllBlocksCleared: a snapshot of nothing",
		in: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: tokens[:4], BlockSize: 4},
			&kvevents.AllBlocksCleared{},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1)},
		},
		want: []kvindex.Event{
			cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[0]),
			snapshot(3),
		},
		stats: watch.TranslatorStats{Stored: 1, Cleared: 1, UnknownRemoved: 1},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := watch.NewTranslator(tt.cfg)
			got := tr.Translate(batch(tt.in...))
			if diff := cmp.Diff(append([]kvindex.Event{snapshot(1)}, tt.want...), got); diff != "" {
				t.Errorf("events (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.stats, tr.Stats()); diff != "" {
				t.Errorf("stats (-want +got):\n%s", diff)
			}
		})
	}
}

func TestTranslatorReset(t *testing.T) {
	tr := watch.NewTranslator(watch.TranslatorConfig{})
	tr.Translate(batch(&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1), TokenIDs: kveventstest.TokenRun(0, 4), BlockSize: 4}))
	if diff := cmp.Diff(snapshot(3), tr.Reset()); diff != "" {
		t.Errorf("Reset (-want +got):\n%s", diff)
	}
	if tr.Len() != 0 {
		t.Errorf("after Reset the translator maps %d hashes", tr.Len())
	}
	// The next batch follows the reset's snapshot, without another.
	got := tr.Translate(batch(&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1)}))
	if len(got) != 0 {
		t.Errorf("a removal of a forgotten hash gave %v", got)
	}
}

func BenchmarkTranslateStored(b *testing.B) {
	tokens := kveventstest.TokenRun(0, 16*32)
	hashes := make([]kvevents.Hash, 32)
	for i := range hashes {
		hashes[i] = kvevents.IntHash(uint64(i))
	}
	ev := batch(&kvevents.BlockStored{BlockHashes: hashes, TokenIDs: tokens, BlockSize: 16})
	tr := watch.NewTranslator(watch.TranslatorConfig{})
	b.ReportAllocs()
	for b.Loop() {
		tr.Translate(ev)
	}
}

// TestTranslatorUnknownParentDrops: a stored event whose parent is not
// "none" and was never seen is not indexed, though it carries its tokens
// (keyed as a first block they would claim a prefix the engine does not
// hold), and neither are its children; a first block with parent 0 is.
func TestTranslatorUnknownParentDrops(t *testing.T) {
	for name, hashes := range map[string][]kvevents.Hash{
		"int hashes":   kveventstest.IntHashes(21, 22, 23),
		"bytes hashes": kveventstest.BytesHashes("u", "v", "w"),
	} {
		t.Run(name, func(t *testing.T) {
			tokens := kveventstest.TokenRun(40, 12)
			tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
			got := tr.Translate(batch(
				&kvevents.BlockStored{BlockHashes: hashes[:1], Parent: kvevents.IntHash(99), TokenIDs: tokens[:4], BlockSize: 4},
				&kvevents.BlockStored{BlockHashes: hashes[1:2], Parent: hashes[0], TokenIDs: tokens[4:8], BlockSize: 4},
				&kvevents.BlockStored{BlockHashes: hashes[2:], Parent: kvevents.IntHash(0), TokenIDs: tokens[8:], BlockSize: 4},
			))
			want := []kvindex.Event{snapshot(1),
				cacheEvent(2, kvindex.Stored, kvindex.TierGPU, requestKeys("m", "", "", tokens[8:], 4)...)}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("index events (-want +got):\n%s", diff)
			}
			if st := tr.Stats(); st.UnknownParent != 2 || st.Stored != 1 {
				t.Errorf("stats %+v, want 2 unknown parents and 1 stored", st)
			}
		})
	}
}

// TestTranslatorDigestCollision: two engine hashes of one digest (an
// integer hash equal to a bytes hash's digest) never stand for each other:
// the later replaces the earlier, whose block leaves the index.
func TestTranslatorDigestCollision(t *testing.T) {
	b := kvevents.BytesHash([]byte("block"))
	i := kvevents.IntHash(b.Digest())
	tokens := kveventstest.TokenRun(7, 8)
	tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
	keys := requestKeys("m", "", "", tokens, 4)
	got := translated(tr, batch(&kvevents.BlockStored{BlockHashes: []kvevents.Hash{i}, TokenIDs: tokens[:4], BlockSize: 4}))
	got = append(got, translated(tr, batch(&kvevents.BlockStored{BlockHashes: []kvevents.Hash{b}, Parent: i, TokenIDs: tokens[4:], BlockSize: 4}))...)
	got = append(got, translated(tr, batch(&kvevents.BlockRemoved{BlockHashes: []kvevents.Hash{i}}))...)
	got = append(got, translated(tr, batch(&kvevents.BlockRemoved{BlockHashes: []kvevents.Hash{b}}))...)
	want := []kvindex.Event{snapshot(1),
		cacheEvent(2, kvindex.Stored, kvindex.TierGPU, keys[0]),
		cacheEvent(3, kvindex.Stored, kvindex.TierGPU, keys[1]),
		cacheEvent(4, kvindex.Removed, kvindex.TierGPU, keys[0]),
		cacheEvent(5, kvindex.Removed, kvindex.TierGPU, keys[1]),
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("index events (-want +got):\n%s", diff)
	}
	if st := tr.Stats(); st.UnknownRemoved != 1 {
		t.Errorf("stats %+v, want the integer hash's removal unknown once replaced", st)
	}
}
