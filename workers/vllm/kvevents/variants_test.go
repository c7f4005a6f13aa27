package kvevents_test

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// publisherVariants are the ways real publishers write what an encoding
// leaves open.
var publisherVariants = map[string]kveventstest.Variant{
	"vLLM":                     {},
	"vLLM bytes hashes":        {BytesHashes: true},
	"vLLM 0.9 fields":          {StoredFields: kveventstest.FieldsLoRAID},
	"vLLM with medium":         {StoredFields: kveventstest.FieldsMedium},
	"vLLM with lora_name":      {StoredFields: kveventstest.FieldsLoRAName},
	"parent 0":                 {NoParent: kveventstest.ParentZero},
	"parent 0, bytes hashes":   {NoParent: kveventstest.ParentZero, BytesHashes: true},
	"llm-d Go publisher":       {NoParent: kveventstest.ParentZero, ZeroBlockSize: true, FixedInts: true},
	"llm-d inference sim":      {ZeroBlockSize: true, FixedInts: true},
	"parent absent, nils left": {NoParent: kveventstest.ParentAbsent, OmitNil: true},
}

// TestPublisherVariantsIndex: whatever the encoding and however the
// publisher writes a first block's parent (nil, 0, absent), its hashes
// (integers, bytes, full-width), its block size (0) and its optional
// fields (absent, as older vLLM), the blocks it reports through the fake
// publisher are indexed under the keys of the request's tokens.
func TestPublisherVariantsIndex(t *testing.T) {
	for _, enc := range encodings {
		for name, v := range publisherVariants {
			t.Run(enc.String()+"/"+name, func(t *testing.T) {
				p := newPublisher(t, kveventstest.PublisherConfig{Encoding: enc, Variant: v})
				s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint()})
				waitSubscribed(t, p)

				tokens, loraTokens, cpuTokens := kveventstest.TokenRun(100, 12), kveventstest.TokenRun(900, 4), kveventstest.TokenRun(700, 4)
				h := kveventstest.IntHashes(11, 12, 13, 14, 15)
				publish(t, p, kvevents.Batch{TS: 1, HasDPRank: true, Events: []kvevents.Event{
					&kvevents.BlockStored{BlockHashes: h[:2], TokenIDs: tokens[:8], BlockSize: 4, Medium: "GPU"},
					&kvevents.BlockStored{BlockHashes: h[2:3], Parent: h[1], TokenIDs: tokens[8:], BlockSize: 4},
					&kvevents.BlockStored{BlockHashes: h[3:4], TokenIDs: loraTokens, BlockSize: 4,
						LoRAID: 1, HasLoRAID: true, LoRAName: "sql"},
					&kvevents.BlockStored{BlockHashes: h[4:5], Parent: h[1], TokenIDs: cpuTokens, BlockSize: 4, Medium: "CPU"},
					&kvevents.BlockRemoved{BlockHashes: h[:1], Medium: "GPU"},
				}})
				m := recv(t, s, 1)[0]
				if m.Err != nil {
					t.Fatal(m.Err)
				}
				tr := watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
				got := tr.Translate(m.Batch)

				// The keys of the request's tokens, and the events the
				// translator makes of what was published.
				keysOf := func(adapter string, toks []uint32) []uint64 {
					return blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt("m", adapter, "")), toks, 4)
				}
				stored := func(seq uint64, kind kvindex.CacheKind, tier kvindex.Tier, keys ...uint64) kvindex.Event {
					return kvindex.Event{Seq: seq, Cache: &kvindex.CacheEvent{Kind: kind, Tier: tier, Keys: keys}}
				}
				want := keysOf("", tokens)
				adapter, cpuTier := "sql", kvindex.TierCPU
				if v.StoredFields != 0 && v.StoredFields < kveventstest.FieldsLoRAName {
					adapter = "lora-id:1" // no lora_name: the id salts
				}
				if v.StoredFields != 0 && v.StoredFields < kveventstest.FieldsMedium {
					cpuTier = kvindex.TierGPU // no medium: the GPU
				}
				wantEvs := []kvindex.Event{
					{Seq: 1, Snapshot: &kvindex.Snapshot{}},
					stored(2, kvindex.Stored, kvindex.TierGPU, want[0], want[1]),
					stored(3, kvindex.Stored, kvindex.TierGPU, want[2]),
					stored(4, kvindex.Stored, kvindex.TierGPU, keysOf(adapter, loraTokens)...),
					stored(5, kvindex.Stored, cpuTier, blockkey.AppendTokens(nil, want[1], cpuTokens, 4)...),
					stored(6, kvindex.Removed, kvindex.TierGPU, want[0]),
				}
				if diff := cmp.Diff(wantEvs, got); diff != "" {
					t.Errorf("index events (-want +got):\n%s", diff)
				}
				if st := tr.Stats(); st.UnknownParent != 0 || st.BadStored != 0 || st.Stored != 5 {
					t.Errorf("stats %+v, want 5 stored and nothing dropped", st)
				}
				if tr.BlockSize() != 4 {
					t.Errorf("BlockSize %d, want 4", tr.BlockSize())
				}
				if !m.Batch.HasDPRank || m.Batch.DPRank != 0 {
					t.Errorf("data-parallel rank %d (%v), want 0 (sent)", m.Batch.DPRank, m.Batch.HasDPRank)
				}
			})
		}
	}
}

// TestDecodeNoParent: a first block's parent decodes to the zero Hash
// however it is written (nil, 0, empty bytes, absent), in every encoding;
// a parent of any other value keeps it.
func TestDecodeNoParent(t *testing.T) {
	stored := func(parent any, omit bool) map[string]any {
		m := map[string]any{"type": "BlockStored", "block_hashes": []any{7}, "token_ids": []any{1, 2}, "block_size": 2}
		if !omit {
			m["parent_block_hash"] = parent
		}
		return m
	}
	for name, tc := range map[string]struct {
		parent any
		omit   bool
		want   kvevents.Hash
	}{
		"nil":              {parent: nil},
		"absent":           {omit: true},
		"0":                {parent: 0},
		"0 as uint64":      {parent: uint64(0)},
		"empty bytes":      {parent: []byte{}},
		"1":                {parent: 1, want: kvevents.IntHash(1)},
		"negative":         {parent: -1, want: kvevents.IntHash(1<<64 - 1)},
		"bytes":            {parent: []byte{0, 1}, want: kvevents.BytesHash([]byte{0, 1})},
		"eight zero bytes": {parent: make([]byte, 8), want: kvevents.BytesHash(make([]byte, 8))},
	} {
		t.Run(name, func(t *testing.T) {
			payloads := map[string][]byte{
				"maps": mustMarshal(t, map[string]any{"ts": 1.0, "events": []any{stored(tc.parent, tc.omit)}}),
			}
			if !tc.omit {
				payloads["array-like"] = mustMarshal(t, []any{1.0, []any{
					[]any{"BlockStored", []any{7}, tc.parent, []any{1, 2}, 2, nil, nil, nil},
				}})
			}
			for enc, p := range payloads {
				b, err := kvevents.Decode(p)
				if err != nil {
					t.Fatalf("%s: %v", enc, err)
				}
				got := b.Events[0].(*kvevents.BlockStored).Parent
				if got != tc.want {
					t.Errorf("%s: parent %v, want %v", enc, got, tc.want)
				}
			}
		})
	}
}
