// Package kveventstest speaks the engines' KV event wire format for tests:
// an encoder of both msgpack encodings and a fake publisher with a replay
// socket.
package kveventstest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// Encoding is how a batch is laid out, as the engines' msgspec structs do.
type Encoding uint8

const (
	// ArrayLike: the batch and its events are arrays, an event's tag first
	// (vLLM before 0.26, SGLang).
	ArrayLike Encoding = iota
	// TaggedMaps: the batch is an array, its events maps with a "type" key
	// (vLLM 0.26).
	TaggedMaps
	// Maps: the batch is a map too (vLLM's main branch).
	Maps
)

// Encodings are every Encoding, for tests that try each.
var Encodings = []Encoding{ArrayLike, TaggedMaps, Maps}

func (e Encoding) String() string {
	switch e {
	case ArrayLike:
		return "array-like"
	case TaggedMaps:
		return "tagged-maps"
	case Maps:
		return "maps"
	}
	return fmt.Sprintf("Encoding(%d)", e)
}

// Variant is how a publisher writes what its encoding leaves open: real
// publishers differ there by version and by make. The zero Variant is
// current vLLM's.
type Variant struct {
	// NoParent is how the parent of a sequence's first block is written.
	NoParent NoParent
	// StoredFields, if not 0, is how many BlockStored fields are written,
	// as older vLLM wrote them (FieldsLoRAID, FieldsMedium,
	// FieldsLoRAName). Below FieldsMedium, BlockRemoved has only its
	// block_hashes too.
	StoredFields int
	// ZeroBlockSize writes block_size 0, as llm-d's inference simulator
	// does (its Go struct's field left unset).
	ZeroBlockSize bool
	// FixedInts writes hashes and token ids in full-width msgpack integers
	// (uint64, uint32), as Go's msgpack does for typed struct fields,
	// rather than in their shortest forms, as msgspec does.
	FixedInts bool
	// BytesHashes writes integer hashes as their 8 big-endian bytes, as
	// vLLM does with its bytes block hashes (ExternalBlockHash).
	BytesHashes bool
	// OmitNil leaves out the map fields whose value is nil (lora_id,
	// medium, lora_name, parent_block_hash with NoParent ParentNil).
	OmitNil bool
}

// NoParent is how a publisher writes "no parent".
type NoParent uint8

const (
	// ParentNil: msgpack nil, as vLLM writes it.
	ParentNil NoParent = iota
	// ParentZero: the integer 0, as llm-d's Go publishers write it.
	ParentZero
	// ParentAbsent: a map event without the key (an array-like event
	// cannot leave a field out before others: nil there).
	ParentAbsent
)

// The BlockStored fields of vLLM's releases, for Variant.StoredFields.
const (
	// FieldsLoRAID: block_hashes, parent_block_hash, token_ids,
	// block_size, lora_id, as vLLM 0.9 wrote them (its batch [ts, events],
	// BlockRemoved [block_hashes]).
	FieldsLoRAID = 5
	// FieldsMedium: and medium, as vLLM wrote once it had a CPU tier.
	FieldsMedium = 6
	// FieldsLoRAName: and lora_name, as vLLM wrote before extra_keys.
	FieldsLoRAName = 7
)

// Encode encodes a batch as an engine would. Fields are written as msgspec
// writes them with omit_defaults: the trailing optional fields of an
// array-like event only when set. A BlockStored with a CacheSalt is laid
// out as SGLang's, with its metadata map after medium.
func Encode(b kvevents.Batch, enc Encoding) ([]byte, error) {
	return EncodeVariant(b, enc, Variant{})
}

// EncodeVariant is Encode as a publisher of the Variant writes.
func EncodeVariant(b kvevents.Batch, enc Encoding, v Variant) ([]byte, error) {
	var buf bytes.Buffer
	buf.Grow(sizeHint(b))
	e := msgpack.NewEncoder(&buf)
	w := writer{e: e, v: v}
	if enc == Maps {
		n := 2
		if b.HasDPRank {
			n++
		}
		w.mapLen(n)
		w.str("ts")
		w.float(b.TS)
		w.str("events")
		w.events(b.Events, enc)
		if b.HasDPRank {
			w.str("data_parallel_rank")
			w.int(b.DPRank)
		}
	} else {
		n := 2
		if b.HasDPRank {
			n++
		}
		w.arrayLen(n)
		w.float(b.TS)
		w.events(b.Events, enc)
		if b.HasDPRank {
			w.int(b.DPRank)
		}
	}
	return buf.Bytes(), w.err
}

// MustEncode is Encode that panics on error, for test tables.
func MustEncode(b kvevents.Batch, enc Encoding) []byte {
	p, err := Encode(b, enc)
	if err != nil {
		panic(err)
	}
	return p
}

// Unknown is an event of a kind the decoder does not know, as a newer
// engine would send.
type Unknown struct{ Name string }

// Tag returns the event's name.
func (u Unknown) Tag() string { return u.Name }

// writer keeps the first error of a sequence of writes.
type writer struct {
	e   *msgpack.Encoder
	v   Variant
	err error
}

func (w *writer) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) arrayLen(n int)  { w.do(w.e.EncodeArrayLen(n)) }
func (w *writer) mapLen(n int)    { w.do(w.e.EncodeMapLen(n)) }
func (w *writer) str(s string)    { w.do(w.e.EncodeString(s)) }
func (w *writer) float(f float64) { w.do(w.e.EncodeFloat64(f)) }
func (w *writer) int(v int64)     { w.do(w.e.EncodeInt(v)) }
func (w *writer) null()           { w.do(w.e.EncodeNil()) }

func (w *writer) optStr(s string) {
	if s == "" {
		w.null()
		return
	}
	w.str(s)
}

func (w *writer) uint(v uint64) {
	if w.v.FixedInts {
		w.do(w.e.EncodeUint64(v))
		return
	}
	w.do(w.e.EncodeUint(v))
}

func (w *writer) hash(h kvevents.Hash) {
	if h.IsZero() {
		w.null()
		return
	}
	if v, ok := h.Uint64(); ok {
		if w.v.BytesHashes {
			w.do(w.e.EncodeBytes(binary.BigEndian.AppendUint64(nil, v)))
			return
		}
		w.uint(v)
		return
	}
	b, _ := h.Bytes()
	w.do(w.e.EncodeBytes(b))
}

func (w *writer) hashes(hs []kvevents.Hash) {
	w.arrayLen(len(hs))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *writer) events(evs []kvevents.Event, enc Encoding) {
	w.arrayLen(len(evs))
	for _, ev := range evs {
		if enc == ArrayLike {
			w.arrayEvent(ev)
		} else {
			w.mapEvent(ev)
		}
	}
}

// field is one named field of an event, written by its function. A nil
// field is written as nil, or left out of a map with Variant.OmitNil.
type field struct {
	name  string
	write func()
	isNil bool
}

// storedFields returns a BlockStored's fields in msgspec order, the
// optional trailing ones only when set.
func (w *writer) storedFields(ev *kvevents.BlockStored) []field {
	parent := field{"parent_block_hash", func() { w.hash(ev.Parent) }, ev.Parent.IsZero()}
	if ev.Parent.IsZero() {
		switch w.v.NoParent {
		case ParentZero:
			parent = field{"parent_block_hash", func() { w.uint(0) }, false}
		case ParentAbsent:
			parent.isNil = true // left out of maps even without OmitNil
		}
	}
	bs := int64(ev.BlockSize)
	if w.v.ZeroBlockSize {
		bs = 0
	}
	fs := []field{
		{"block_hashes", func() { w.hashes(ev.BlockHashes) }, false},
		parent,
		{"token_ids", func() {
			w.arrayLen(len(ev.TokenIDs))
			for _, t := range ev.TokenIDs {
				if w.v.FixedInts {
					w.do(w.e.EncodeUint32(t))
				} else {
					w.do(w.e.EncodeUint(uint64(t)))
				}
			}
		}, false},
		{"block_size", func() { w.int(bs) }, false},
		{"lora_id", func() {
			if ev.HasLoRAID {
				w.int(ev.LoRAID)
			} else {
				w.null()
			}
		}, !ev.HasLoRAID},
		{"medium", func() { w.optStr(ev.Medium) }, ev.Medium == ""},
	}
	if ev.CacheSalt != "" { // SGLang's BlockStoredWithMetadata
		return append(fs, field{"metadata", func() {
			w.mapLen(1)
			w.str("cache_salt")
			w.str(ev.CacheSalt)
		}, false})
	}
	fs = append(fs, field{"lora_name", func() { w.optStr(ev.LoRAName) }, ev.LoRAName == ""})
	if n := w.v.StoredFields; n > 0 && n < len(fs) {
		return fs[:n]
	}
	var opt []field
	if ev.ExtraKeys != nil {
		opt = append(opt, field{name: "extra_keys", write: func() {
			w.arrayLen(len(ev.ExtraKeys))
			for _, ks := range ev.ExtraKeys {
				if ks == nil {
					w.null()
					continue
				}
				w.arrayLen(len(ks))
				for _, k := range ks {
					w.str(k)
				}
			}
		}})
	}
	if ev.HasGroup || ev.CacheSpecKind != "" {
		opt = append(opt, field{name: "group_idx", write: func() {
			if ev.HasGroup {
				w.int(ev.Group)
			} else {
				w.null()
			}
		}})
	}
	if ev.CacheSpecKind != "" {
		opt = append(opt, field{name: "kv_cache_spec_kind", write: func() { w.str(ev.CacheSpecKind) }})
	}
	if len(opt) > 0 && ev.ExtraKeys == nil {
		// Positional: a later optional field needs the earlier ones.
		opt = append([]field{{name: "extra_keys", write: w.null, isNil: true}}, opt...)
	}
	return append(fs, opt...)
}

func (w *writer) removedFields(ev *kvevents.BlockRemoved) []field {
	fs := []field{{name: "block_hashes", write: func() { w.hashes(ev.BlockHashes) }}}
	if n := w.v.StoredFields; n > 0 && n < FieldsMedium {
		return fs
	}
	fs = append(fs, field{"medium", func() { w.optStr(ev.Medium) }, ev.Medium == ""})
	if ev.HasGroup {
		fs = append(fs, field{name: "group_idx", write: func() { w.int(ev.Group) }})
	}
	return fs
}

func (w *writer) fieldsOf(ev kvevents.Event) (tag string, fs []field) {
	switch ev := ev.(type) {
	case *kvevents.BlockStored:
		return "BlockStored", w.storedFields(ev)
	case *kvevents.BlockRemoved:
		return "BlockRemoved", w.removedFields(ev)
	case *kvevents.AllBlocksCleared:
		return "AllBlocksCleared", nil
	case Unknown:
		return ev.Name, []field{{name: "payload", write: func() { w.str("?") }}}
	}
	w.do(fmt.Errorf("kveventstest: cannot encode %T", ev))
	return "", nil
}

func (w *writer) arrayEvent(ev kvevents.Event) {
	tag, fs := w.fieldsOf(ev)
	w.arrayLen(1 + len(fs))
	w.str(tag)
	for _, f := range fs {
		f.write()
	}
}

func (w *writer) mapEvent(ev kvevents.Event) {
	tag, fs := w.fieldsOf(ev)
	fs = slices.DeleteFunc(fs, func(f field) bool {
		return f.isNil && (w.v.OmitNil || (f.name == "parent_block_hash" && w.v.NoParent == ParentAbsent))
	})
	w.mapLen(1 + len(fs))
	w.str("type")
	w.str(tag)
	for _, f := range fs {
		w.str(f.name)
		f.write()
	}
}

var _ kvevents.Event = Unknown{}

// sizeHint is about the bytes b encodes to at most, so that the buffer is
// allocated once: a fleet of fakes publishing a million blocks a second
// spent a fifth of its time growing buffers.
func sizeHint(b kvevents.Batch) int {
	n := 64
	for _, ev := range b.Events {
		n += 96
		switch ev := ev.(type) {
		case *kvevents.BlockStored:
			n += 9*len(ev.BlockHashes) + 5*len(ev.TokenIDs) + 16*len(ev.ExtraKeys)
		case *kvevents.BlockRemoved:
			n += 9 * len(ev.BlockHashes)
		}
	}
	return n
}
