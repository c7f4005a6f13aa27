package kvevents_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"runtime"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

var encodings = kveventstest.Encodings

// cmpHash compares hashes by value.
var cmpHash = cmp.Comparer(func(a, b kvevents.Hash) bool { return a == b })

// sampleBatches covers every field in both hash kinds.
func sampleBatches() map[string]kvevents.Batch {
	return map[string]kvevents.Batch{
		"int hashes": {TS: 1.5, Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(1, 2), TokenIDs: kveventstest.TokenRun(0, 8), BlockSize: 4, Medium: "GPU"},
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(3), Parent: kvevents.IntHash(2), TokenIDs: kveventstest.TokenRun(8, 4), BlockSize: 4},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1), Medium: "GPU"},
		}},
		"bytes hashes and rank": {TS: 2, HasDPRank: true, DPRank: 3, Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.BytesHashes("\x00\x01\x02", "0123456789abcdef0123456789abcdef"),
				Parent: kvevents.BytesHash([]byte("p")), TokenIDs: kveventstest.TokenRun(100, 4), BlockSize: 2},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.BytesHashes("\x00\x01\x02")},
			&kvevents.AllBlocksCleared{},
		}},
		"lora, extra keys, group": {TS: 3, Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(math.MaxUint64), TokenIDs: []uint32{math.MaxUint32, 0}, BlockSize: 2,
				LoRAID: 7, HasLoRAID: true, LoRAName: "sql", Medium: "CPU",
				ExtraKeys: [][]string{{"sql", "tenant-a"}}, Group: 1, HasGroup: true, CacheSpecKind: "full_attention"},
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(5), Medium: "CPU", Group: 1, HasGroup: true},
		}},
		"sglang cache salt": {TS: 4, HasDPRank: true, Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(9), TokenIDs: kveventstest.TokenRun(0, 1), BlockSize: 1, Medium: "CPU_PINNED", CacheSalt: "t1"},
		}},
		"empty": {TS: 5, Events: []kvevents.Event{}},
	}
}

func TestDecodeRoundTrip(t *testing.T) {
	for name, want := range sampleBatches() {
		for _, enc := range encodings {
			t.Run(name+"/"+enc.String(), func(t *testing.T) {
				got, err := kvevents.Decode(kveventstest.MustEncode(want, enc))
				if err != nil {
					t.Fatal(err)
				}
				if diff := cmp.Diff(want, got, cmpHash); diff != "" {
					t.Errorf("decoded batch (-want +got):\n%s", diff)
				}
			})
		}
	}
}

func mustMarshal(t *testing.T, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestDecodeEngineLayouts decodes payloads laid out by hand as each engine
// version writes them.
func TestDecodeEngineLayouts(t *testing.T) {
	stored := &kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(11), TokenIDs: []uint32{1, 2}, BlockSize: 2}
	tests := []struct {
		name    string
		payload any
		want    kvevents.Batch
	}{{
		name: "vllm first release: [ts, events], BlockStored of five fields",
		payload: []any{1.0, []any{
			[]any{"BlockStored", []any{11}, nil, []any{1, 2}, 2, nil},
			[]any{"BlockRemoved", []any{11}},
			[]any{"AllBlocksCleared"},
		}},
		want: kvevents.Batch{TS: 1, Events: []kvevents.Event{stored,
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(11)}, &kvevents.AllBlocksCleared{}}},
	}, {
		name: "sglang: attn_dp_rank, medium with omitted trailing fields",
		payload: []any{1.0, []any{
			[]any{"BlockStored", []any{11}, nil, []any{1, 2}, 2, nil, "GPU"},
		}, 2},
		want: kvevents.Batch{TS: 1, DPRank: 2, HasDPRank: true, Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(11), TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU"}}},
	}, {
		name: "python hash(): a negative integer hash keeps its bits",
		payload: []any{1.0, []any{
			[]any{"BlockStored", []any{int64(-5)}, int64(-6), []any{1, 2}, 2, nil},
		}},
		want: kvevents.Batch{TS: 1, Events: []kvevents.Event{&kvevents.BlockStored{
			BlockHashes: []kvevents.Hash{kvevents.IntHash(math.MaxUint64 - 4)},
			Parent:      kvevents.IntHash(math.MaxUint64 - 5), TokenIDs: []uint32{1, 2}, BlockSize: 2}}},
	}, {
		name: "vllm main: maps everywhere, unknown keys and trailing fields skipped",
		payload: map[string]any{"ts": 2, "future": []any{[]any{1}}, "data_parallel_rank": 0, "events": []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{11}, "parent_block_hash": nil,
				"token_ids": []any{1, 2}, "block_size": 2, "lora_id": nil, "medium": nil,
				"kv_cache_spec_sliding_window": 128, "future": map[string]any{"a": 1}},
		}},
		want: kvevents.Batch{TS: 2, HasDPRank: true, Events: []kvevents.Event{stored}},
	}, {
		name: "array-like event with fields past the known ones",
		payload: []any{1.0, []any{
			[]any{"BlockRemoved", []any{11}, "GPU", 0, "later", []any{1, 2}},
		}},
		want: kvevents.Batch{TS: 1, Events: []kvevents.Event{
			&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(11), Medium: "GPU", HasGroup: true}}},
	}, {
		name: "multimodal extra keys: tuples are dropped, strings kept",
		payload: []any{1.0, []any{
			[]any{"BlockStored", []any{11}, nil, []any{1, 2}, 2, nil, "GPU", nil,
				[]any{[]any{[]any{"img-1", 0}, "salt", []byte{1}}}},
		}},
		want: kvevents.Batch{TS: 1, Events: []kvevents.Event{&kvevents.BlockStored{BlockHashes: kveventstest.IntHashes(11),
			TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU", ExtraKeys: [][]string{{"salt"}}}}},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := kvevents.Decode(mustMarshal(t, tt.payload))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, got, cmpHash); diff != "" {
				t.Errorf("decoded batch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDecodeUnknownTagKeepsTheRest(t *testing.T) {
	b := kvevents.Batch{TS: 1, Events: []kvevents.Event{
		&kvevents.BlockRemoved{BlockHashes: kveventstest.IntHashes(1)},
		kveventstest.Unknown{Name: "BlockTransferred"},
		&kvevents.AllBlocksCleared{},
	}}
	for _, enc := range encodings {
		t.Run(enc.String(), func(t *testing.T) {
			got, err := kvevents.Decode(kveventstest.MustEncode(b, enc))
			if !errors.Is(err, kvevents.ErrUnknownTag) {
				t.Fatalf("err = %v, want ErrUnknownTag", err)
			}
			want := kvevents.Batch{TS: 1, Events: []kvevents.Event{b.Events[0], b.Events[2]}}
			if diff := cmp.Diff(want, got, cmpHash); diff != "" {
				t.Errorf("decoded batch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDecodeMalformed(t *testing.T) {
	valid := kveventstest.MustEncode(sampleBatches()["int hashes"], kveventstest.ArrayLike)
	nested := append(bytes.Repeat([]byte{0x91}, 200_000), 0xc0)
	tests := []struct {
		name    string
		payload []byte
	}{
		{"empty", nil},
		{"not a batch", []byte{0x05}},
		{"batch of one field", mustMarshal(t, []any{1.0})},
		{"nil events", mustMarshal(t, []any{1.0, nil})},
		{"ts not a number", mustMarshal(t, []any{"now", []any{}})},
		{"event not a struct", mustMarshal(t, []any{1.0, []any{5}})},
		{"event without tag", mustMarshal(t, []any{1.0, []any{[]any{}}})},
		{"tag not a string", mustMarshal(t, []any{1.0, []any{[]any{1.5}}})},
		{"map event without type", mustMarshal(t, []any{1.0, []any{map[string]any{"block_hashes": []any{1}}}})},
		{"map batch without events", mustMarshal(t, map[string]any{"ts": 1})},
		{"stored without token_ids", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil}}})},
		{"removed without hashes", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved"}}})},
		{"negative token id", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{-1}, 1, nil}}})},
		{"token id above 32 bits", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{uint64(1) << 33}, 1, nil}}})},
		{"negative block size", mustMarshal(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{}, -1, nil}}})},
		{"float hash", mustMarshal(t, []any{1.0, []any{[]any{"BlockRemoved", []any{1.5}}}})},
		{"map key not a string", mustMarshal(t, map[any]any{1: 2})},
		{"trailing bytes", append(bytes.Clone(valid), 0xc0)},
		{"forged array length", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}},
		{"forged string length", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff}},
		{"forged bytes length in a skipped field", []byte{0x93, 0x01, 0x90, 0xc6, 0xff, 0xff, 0xff, 0xff}},
		{"forged extension length in a skipped field", []byte{0x93, 0x01, 0x90, 0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}},
		{"nesting bomb in a skipped field", append([]byte{0x93, 0x01, 0x90}, nested...)},
		{"unclosed nesting", bytes.Repeat([]byte{0x91}, 100_000)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := kvevents.Decode(tt.payload); !errors.Is(err, kvevents.ErrMalformed) {
				t.Errorf("err = %v, want ErrMalformed", err)
			}
		})
	}
	t.Run("every truncation", func(t *testing.T) {
		for n := range len(valid) {
			if _, err := kvevents.Decode(valid[:n]); !errors.Is(err, kvevents.ErrMalformed) {
				t.Fatalf("payload cut at %d/%d: err = %v, want ErrMalformed", n, len(valid), err)
			}
		}
	})
}

// TestDecodeForgedLengthsAllocateNothing decodes, again and again, a
// payload whose skipped field declares 3 GB of bytes it does not hold:
// Decode must not allocate by the declared length, nor keep a buffer grown
// by one call for the next.
func TestDecodeForgedLengthsAllocateNothing(t *testing.T) {
	payloads := map[string][]byte{
		"bytes in a skipped batch field": []byte("\x83\xa90000\x00\x00\x00\x80\xc6\xc6\xc6\xc6\xc6\xc6\xc6\xc6000\xc0"),
		"extension in a skipped event field": mustMarshal(t, []any{1.0, []any{
			[]any{"BlockRemoved", []any{1}, nil, nil, msgpack.RawMessage{0xc9, 0xc6, 0xc6, 0xc6, 0xc6, 0x01}}}}),
	}
	for name, payload := range payloads {
		t.Run(name, func(t *testing.T) {
			const calls = 8
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range calls {
				if _, err := kvevents.Decode(payload); !errors.Is(err, kvevents.ErrMalformed) {
					t.Fatalf("err = %v, want ErrMalformed", err)
				}
			}
			runtime.ReadMemStats(&after)
			if got, limit := after.TotalAlloc-before.TotalAlloc, uint64(64<<10); got > limit {
				t.Errorf("%d calls allocated %d bytes, want at most %d", calls, got, limit)
			}
		})
	}
}

func TestHash(t *testing.T) {
	i, b := kvevents.IntHash(7), kvevents.BytesHash([]byte{0, 0, 0, 0, 0, 0, 0, 7})
	if i == b {
		t.Error("an integer hash equals the bytes hash of its bytes")
	}
	if v, ok := i.Uint64(); !ok || v != 7 {
		t.Errorf("IntHash(7).Uint64() = %d, %v", v, ok)
	}
	if _, ok := b.Uint64(); ok {
		t.Error("a bytes hash has an integer value")
	}
	if got, want := b.String(), "0x0000000000000007"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if !(kvevents.Hash{}).IsZero() || kvevents.IntHash(0).IsZero() || kvevents.BytesHash(nil).IsZero() {
		t.Error("IsZero is wrong")
	}
}

// TestDecoder: a Decoder decodes every batch, in every encoding and
// variant, as Decode does, whatever it decoded before; once warm, a
// stream's batches cost it no allocation.
func TestDecoder(t *testing.T) {
	var payloads [][]byte
	for _, b := range sampleBatches() {
		for _, enc := range encodings {
			for _, v := range []kveventstest.Variant{{}, {NoParent: kveventstest.ParentZero}, {OmitNil: true},
				{StoredFields: kveventstest.FieldsLoRAID}, {FixedInts: true, BytesHashes: true}} {
				payloads = append(payloads, must(kveventstest.EncodeVariant(b, enc, v)))
			}
		}
	}
	var d kvevents.Decoder
	opts := cmp.Options{cmpHash, cmpopts.EquateNaNs()}
	for round := range 2 {
		for i, p := range payloads {
			want, wantErr := kvevents.Decode(p)
			got, err := d.Decode(p)
			if (err == nil) != (wantErr == nil) {
				t.Fatalf("round %d, payload %d: err %v, Decode's %v", round, i, err, wantErr)
			}
			if diff := cmp.Diff(want, got, opts); diff != "" {
				t.Fatalf("round %d, payload %d: Decoder and Decode differ (-Decode +Decoder):\n%s", round, i, diff)
			}
		}
	}

	for _, enc := range encodings {
		st := &kvevents.BlockStored{BlockSize: 16, Medium: "GPU", TokenIDs: kveventstest.TokenRun(1000, 512)}
		rm := &kvevents.BlockRemoved{Medium: "GPU"}
		for i := range 32 {
			st.BlockHashes = append(st.BlockHashes, kvevents.IntHash(uint64(1e12+i)))
			rm.BlockHashes = append(rm.BlockHashes, kvevents.IntHash(uint64(1e9+i)))
		}
		p := kveventstest.MustEncode(kvevents.Batch{TS: 1, Events: []kvevents.Event{rm, st}}, enc)
		if allocs := testing.AllocsPerRun(100, func() {
			if _, err := d.Decode(p); err != nil {
				t.Fatal(err)
			}
		}); allocs != 0 {
			t.Errorf("%v: a warm Decoder allocates %v times a batch, want 0", enc, allocs)
		}
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// FuzzDecode checks that Decode never panics, that a Decoder reused from
// one payload to the next decodes each as Decode does, and that what it
// returns re-encodes to a batch it decodes the same way.
func FuzzDecode(f *testing.F) {
	for _, b := range sampleBatches() {
		for _, enc := range encodings {
			f.Add(kveventstest.MustEncode(b, enc))
		}
	}
	unknown := kvevents.Batch{Events: []kvevents.Event{kveventstest.Unknown{Name: "X"}}}
	f.Add(kveventstest.MustEncode(unknown, kveventstest.ArrayLike))
	f.Add([]byte{})
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add(bytes.Repeat([]byte{0x91}, 64))
	f.Add([]byte{0x82, 0xa2, 't', 's', 0x01, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x91, 0x81, 0xa4, 't', 'y', 'p', 'e', 0xa1, 'X'})
	opts := cmp.Options{cmpHash, cmpopts.EquateNaNs(), cmpopts.EquateEmpty()}
	var d kvevents.Decoder
	f.Fuzz(func(t *testing.T, payload []byte) {
		b1, err := kvevents.Decode(payload)
		b0, err0 := d.Decode(payload)
		if fmt.Sprint(err0) != fmt.Sprint(err) {
			t.Fatalf("Decoder's error %v, Decode's %v", err0, err)
		}
		if diff := cmp.Diff(b1, b0, opts); diff != "" {
			t.Fatalf("Decoder and Decode differ (-Decode +Decoder):\n%s", diff)
		}
		if err != nil && !errors.Is(err, kvevents.ErrUnknownTag) {
			if !errors.Is(err, kvevents.ErrMalformed) {
				t.Fatalf("error %v is neither ErrMalformed nor ErrUnknownTag", err)
			}
			return
		}
		// One round normalises what the encoder cannot say (a LoRA name
		// beside SGLang's metadata); after it, batches round-trip.
		b2, err := kvevents.Decode(kveventstest.MustEncode(b1, kveventstest.ArrayLike))
		if err != nil {
			t.Fatalf("re-encoded batch: %v", err)
		}
		for _, enc := range encodings {
			b3, err := kvevents.Decode(kveventstest.MustEncode(b2, enc))
			if err != nil {
				t.Fatalf("%v: %v", enc, err)
			}
			if diff := cmp.Diff(b2, b3, opts); diff != "" {
				t.Fatalf("%v round trip (-want +got):\n%s", enc, diff)
			}
		}
	})
}
