// Package kveventstest speaks the engines' KV event wire format for tests:
// an encoder of both msgpack encodings and a fake publisher with a replay
// socket.
package kveventstest

import (
	"bytes"
	"fmt"

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

// Encode encodes a batch as an engine would. Fields are written as msgspec
// writes them with omit_defaults: the trailing optional fields of an
// array-like event only when set. A BlockStored with a CacheSalt is laid
// out as SGLang's, with its metadata map after medium.
func Encode(b kvevents.Batch, enc Encoding) ([]byte, error) {
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	w := writer{e: e}
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

func (w *writer) hash(h kvevents.Hash) {
	if h.IsZero() {
		w.null()
		return
	}
	if v, ok := h.Uint64(); ok {
		w.do(w.e.EncodeUint(v))
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

// field is one named field of an event, written by its function.
type field struct {
	name  string
	write func()
}

// storedFields returns a BlockStored's fields in msgspec order, the
// optional trailing ones only when set.
func (w *writer) storedFields(ev *kvevents.BlockStored) []field {
	fs := []field{
		{"block_hashes", func() { w.hashes(ev.BlockHashes) }},
		{"parent_block_hash", func() { w.hash(ev.Parent) }},
		{"token_ids", func() {
			w.arrayLen(len(ev.TokenIDs))
			for _, t := range ev.TokenIDs {
				w.do(w.e.EncodeUint(uint64(t)))
			}
		}},
		{"block_size", func() { w.int(int64(ev.BlockSize)) }},
		{"lora_id", func() {
			if ev.HasLoRAID {
				w.int(ev.LoRAID)
			} else {
				w.null()
			}
		}},
		{"medium", func() { w.optStr(ev.Medium) }},
	}
	if ev.CacheSalt != "" { // SGLang's BlockStoredWithMetadata
		return append(fs, field{"metadata", func() {
			w.mapLen(1)
			w.str("cache_salt")
			w.str(ev.CacheSalt)
		}})
	}
	fs = append(fs, field{"lora_name", func() { w.optStr(ev.LoRAName) }})
	var opt []field
	if ev.ExtraKeys != nil {
		opt = append(opt, field{"extra_keys", func() {
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
		opt = append(opt, field{"group_idx", func() {
			if ev.HasGroup {
				w.int(ev.Group)
			} else {
				w.null()
			}
		}})
	}
	if ev.CacheSpecKind != "" {
		opt = append(opt, field{"kv_cache_spec_kind", func() { w.str(ev.CacheSpecKind) }})
	}
	if len(opt) > 0 && ev.ExtraKeys == nil {
		// Positional: a later optional field needs the earlier ones.
		opt = append([]field{{"extra_keys", w.null}}, opt...)
	}
	return append(fs, opt...)
}

func (w *writer) removedFields(ev *kvevents.BlockRemoved) []field {
	fs := []field{
		{"block_hashes", func() { w.hashes(ev.BlockHashes) }},
		{"medium", func() { w.optStr(ev.Medium) }},
	}
	if ev.HasGroup {
		fs = append(fs, field{"group_idx", func() { w.int(ev.Group) }})
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
		return ev.Name, []field{{"payload", func() { w.str("?") }}}
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
	w.mapLen(1 + len(fs))
	w.str("type")
	w.str(tag)
	for _, f := range fs {
		w.str(f.name)
		f.write()
	}
}

var _ kvevents.Event = Unknown{}
