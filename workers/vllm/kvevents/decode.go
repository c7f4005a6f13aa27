package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Errors of Decode.
var (
	// ErrMalformed: the payload is not a batch of KV events. Nothing of it
	// is usable.
	ErrMalformed = errors.New("kvevents: malformed payload")
	// ErrUnknownTag: the batch holds events of a kind this package does not
	// know (a newer engine's). Decode still returns the events it knows.
	ErrUnknownTag = errors.New("kvevents: unknown event tag")
)

// Batch is one published batch of events.
type Batch struct {
	// TS is the engine's wall-clock time of the batch, in Unix seconds.
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank that published the batch, when the
	// engine said (vLLM's data_parallel_rank, SGLang's attn_dp_rank).
	DPRank    int64
	HasDPRank bool
}

// Event is one of *BlockStored, *BlockRemoved and *AllBlocksCleared, as
// Decode returns them.
type Event interface {
	// Tag returns the engine's tag of the event's kind: its class name.
	Tag() string
}

// BlockStored: the engine stored full blocks. Their token ids follow the
// block with hash Parent (none for a sequence's first block), in order.
type BlockStored struct {
	BlockHashes []Hash
	// Parent is the hash of the block the first one follows. The zero
	// Hash means none: the first block starts a sequence. Decode returns
	// the zero Hash for every encoding of "none" (see NoParent).
	Parent Hash
	// TokenIDs are the tokens of all the blocks, BlockSize per block.
	TokenIDs  []uint32
	BlockSize int
	LoRAID    int64
	HasLoRAID bool
	LoRAName  string
	// Medium is where the blocks are ("GPU", "CPU", SGLang's "CPU_PINNED",
	// ...); empty when the engine did not say, which means the GPU.
	Medium string
	// CacheSalt is SGLang's cache_salt metadata. vLLM folds its salt into
	// ExtraKeys instead.
	CacheSalt string
	// ExtraKeys are vLLM's extra hash inputs of each block (LoRA name,
	// multimodal ids, cache salt, in that order); only their strings are
	// kept. Nil when the engine sent none.
	ExtraKeys [][]string
	// Group is the KV cache group (vLLM's group_idx, for hybrid models).
	Group    int64
	HasGroup bool
	// CacheSpecKind is vLLM's kv_cache_spec_kind ("full_attention", ...).
	CacheSpecKind string
}

// BlockRemoved: the engine no longer holds the blocks in Medium.
type BlockRemoved struct {
	BlockHashes []Hash
	Medium      string
	Group       int64
	HasGroup    bool
}

// AllBlocksCleared: the engine dropped every block.
type AllBlocksCleared struct{}

// The engines' msgspec tags: the class names.
const (
	tagStored  = "BlockStored"
	tagRemoved = "BlockRemoved"
	tagCleared = "AllBlocksCleared"
)

// Tag returns "BlockStored".
func (*BlockStored) Tag() string { return tagStored }

// Tag returns "BlockRemoved".
func (*BlockRemoved) Tag() string { return tagRemoved }

// Tag returns "AllBlocksCleared".
func (*AllBlocksCleared) Tag() string { return tagCleared }

// Field order of the array-like encodings: the msgspec structs' field
// order. Position 7 of BlockStored is vLLM's lora_name or SGLang's
// metadata map; decodeField tells them apart by type.
var (
	storedFields = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

// Decode decodes one batch payload, in either encoding: msgspec's
// array-like structs (tag first) or maps (tag under "type"), at the batch
// and event levels alike. Fields it does not know are skipped, so newer
// engines' additions decode.
//
// Errors wrap ErrMalformed, or ErrUnknownTag when only some events had an
// unknown tag: then the batch holds the other events, in order.
func Decode(payload []byte) (Batch, error) {
	r := bytes.NewReader(payload)
	// A decoder of its own, not msgpack's pool: a pooled decoder keeps
	// the read buffer its last user grew, for whoever gets it next.
	dec := decoder{d: msgpack.NewDecoder(r), r: r, buf: payload}
	return dec.decode()
}

// A Decoder decodes batches as Decode does, into memory of its own that
// it reuses: the batch it returns, its events and their slices are valid
// until its next Decode. A stream's decoder allocates next to nothing once
// warm. The zero Decoder is ready; use it from one goroutine at a time.
type Decoder struct {
	d      *msgpack.Decoder
	r      bytes.Reader
	events []Event
	slots  []*eventSlot
	// strs interns the strings of fields (media, LoRA names, cache
	// kinds), which repeat from one batch to the next.
	strs map[string]string
}

// eventSlot is the memory of the event at one position of a batch.
type eventSlot struct {
	stored  BlockStored
	removed BlockRemoved
	hashes  []Hash
	tokens  []uint32
}

// Bounds of what a Decoder keeps from one batch to the next: an event's
// hashes and tokens beyond maxKeptTokens (a prompt of more than 64 Ki
// tokens), events beyond maxKeptEvents, and interned strings beyond
// maxInterned, are left to the garbage collector.
const (
	maxKeptTokens = 1 << 16
	maxKeptEvents = 1 << 10
	maxInterned   = 64
)

// Decode decodes one batch payload, as the package's Decode does, into the
// decoder's memory.
func (d *Decoder) Decode(payload []byte) (Batch, error) {
	d.r.Reset(payload)
	if d.d == nil {
		d.d = msgpack.NewDecoder(&d.r)
	} else {
		d.d.Reset(&d.r)
	}
	clear(d.events) // no event of the last batch kept alive through them
	if len(d.slots) > maxKeptEvents {
		d.events, d.slots = nil, nil
	}
	dec := decoder{d: d.d, r: &d.r, buf: payload, reuse: d}
	return dec.decode()
}

// slot returns the memory of the batch's event i.
func (d *Decoder) slot(i int) *eventSlot {
	for len(d.slots) <= i {
		d.slots = append(d.slots, new(eventSlot))
	}
	s := d.slots[i]
	if cap(s.tokens) > maxKeptTokens || cap(s.hashes) > maxKeptTokens {
		s.hashes, s.tokens = nil, nil
	}
	return s
}

// intern returns b as a string, the same string each time for the first
// maxInterned distinct ones.
func (d *Decoder) intern(b []byte) string {
	if s, ok := d.strs[string(b)]; ok {
		return s
	}
	s := string(b)
	if len(d.strs) < maxInterned && len(b) <= 64 {
		if d.strs == nil {
			d.strs = make(map[string]string)
		}
		d.strs[s] = s
	}
	return s
}

func (dc *decoder) decode() (Batch, error) {
	b, err := dc.batch()
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	if dc.r.Len() != 0 {
		return Batch{}, fmt.Errorf("%w: %d trailing bytes", ErrMalformed, dc.r.Len())
	}
	if dc.unknown > 0 {
		return b, fmt.Errorf("%w: %d events, the first %q", ErrUnknownTag, dc.unknown, dc.firstUnknown)
	}
	return b, nil
}

type decoder struct {
	d            *msgpack.Decoder
	r            *bytes.Reader
	buf          []byte   // the payload r reads
	reuse        *Decoder // whose memory to decode into; nil: fresh memory
	unknown      int
	firstUnknown string
}

var errNil = errors.New("nil where a value is required")

func (dc *decoder) peek() (byte, error) { return dc.d.PeekCode() }

// errTooLong is a string, byte array or extension longer than what is
// left of the payload: msgpack would allocate its declared length, a
// megabyte at a time, before reading it.
var errTooLong = errors.New("string, bytes or extension longer than the payload")

// fits checks that the string, byte array or extension at the reader's
// position, if any, is no longer than the rest of the payload.
func (dc *decoder) fits() error {
	rest := dc.buf[len(dc.buf)-dc.r.Len():]
	if len(rest) == 0 {
		return nil
	}
	var n, head int
	switch c := rest[0]; {
	case c >= 0xa0 && c <= 0xbf: // fixstr
		n, head = int(c&0x1f), 1
	case (c == 0xd9 || c == 0xc4) && len(rest) >= 2: // str8, bin8
		n, head = int(rest[1]), 2
	case (c == 0xda || c == 0xc5) && len(rest) >= 3: // str16, bin16
		n, head = int(binary.BigEndian.Uint16(rest[1:])), 3
	case (c == 0xdb || c == 0xc6) && len(rest) >= 5: // str32, bin32
		n, head = int(binary.BigEndian.Uint32(rest[1:])), 5
	case c == 0xc7 && len(rest) >= 2: // ext8: length, then the type byte
		n, head = int(rest[1]), 3
	case c == 0xc8 && len(rest) >= 3: // ext16
		n, head = int(binary.BigEndian.Uint16(rest[1:])), 4
	case c == 0xc9 && len(rest) >= 5: // ext32
		n, head = int(binary.BigEndian.Uint32(rest[1:])), 6
	default:
		return nil
	}
	if n > len(rest)-head {
		return errTooLong
	}
	return nil
}

// raw returns the string or byte array at the reader's position, in the
// payload's memory, and moves past it.
func (dc *decoder) raw() ([]byte, error) {
	rest := dc.buf[len(dc.buf)-dc.r.Len():]
	if len(rest) == 0 {
		return nil, io.ErrUnexpectedEOF
	}
	var n, head int
	switch c := rest[0]; {
	case c >= 0xa0 && c <= 0xbf: // fixstr
		n, head = int(c&0x1f), 1
	case c == 0xd9 || c == 0xc4: // str8, bin8
		head = 2
	case c == 0xda || c == 0xc5: // str16, bin16
		head = 3
	case c == 0xdb || c == 0xc6: // str32, bin32
		head = 5
	default:
		return nil, fmt.Errorf("code %#x is not a string nor bytes", c)
	}
	if len(rest) < head {
		return nil, io.ErrUnexpectedEOF
	}
	switch head {
	case 2:
		n = int(rest[1])
	case 3:
		n = int(binary.BigEndian.Uint16(rest[1:]))
	case 5:
		n = int(binary.BigEndian.Uint32(rest[1:]))
	}
	if n > len(rest)-head {
		return nil, errTooLong
	}
	if _, err := dc.r.Seek(int64(len(dc.buf)-len(rest)+head+n), io.SeekStart); err != nil {
		return nil, err
	}
	return rest[head : head+n], nil
}

// str decodes a string. The known names of fields, tags and media cost
// no allocation, nor do repeated strings with a reusing Decoder.
func (dc *decoder) str() (string, error) {
	b, err := dc.raw()
	if err != nil {
		return "", err
	}
	if s, ok := knownStrings[string(b)]; ok {
		return s, nil
	}
	if dc.reuse != nil {
		return dc.reuse.intern(b), nil
	}
	return string(b), nil
}

// knownStrings are the strings every batch holds: names of fields, tags,
// media.
var knownStrings = func() map[string]string {
	m := make(map[string]string)
	for _, s := range append([]string{"type", "ts", "events", "data_parallel_rank", "attn_dp_rank", "metadata",
		"cache_salt", tagStored, tagRemoved, tagCleared, "GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL"},
		append(storedFields, removedFields...)...) {
		m[s] = s
	}
	return m
}()

// capFor bounds a slice's preallocation by the bytes left: each element
// takes at least one, so a forged length cannot allocate more.
func (dc *decoder) capFor(n int) int { return min(n, dc.r.Len()) }

func isArray(c byte) bool {
	return (c >= msgpcode.FixedArrayLow && c <= msgpcode.FixedArrayHigh) ||
		c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isUint(c byte) bool {
	return c <= msgpcode.PosFixedNumHigh || (c >= msgpcode.Uint8 && c <= msgpcode.Uint64)
}

func isInt(c byte) bool {
	return isUint(c) || c >= msgpcode.NegFixedNumLow || (c >= msgpcode.Int8 && c <= msgpcode.Int64)
}

func isNumber(c byte) bool { return isInt(c) || c == msgpcode.Float || c == msgpcode.Double }

func (dc *decoder) batch() (Batch, error) {
	var b Batch
	c, err := dc.peek()
	if err != nil {
		return b, err
	}
	switch {
	case isArray(c):
		n, err := dc.d.DecodeArrayLen()
		if err != nil {
			return b, err
		}
		if n < 2 {
			return b, fmt.Errorf("batch of %d fields", n)
		}
		if b.TS, err = dc.float(); err != nil {
			return b, fmt.Errorf("ts: %w", err)
		}
		if b.Events, err = dc.events(); err != nil {
			return b, err
		}
		if n >= 3 {
			if b.DPRank, b.HasDPRank, err = dc.optInt(); err != nil {
				return b, fmt.Errorf("data parallel rank: %w", err)
			}
		}
		return b, dc.skipN(n - 3)
	case isMap(c):
		n, err := dc.d.DecodeMapLen()
		if err != nil {
			return b, err
		}
		var hasTS, hasEvents bool
		for range n {
			key, err := dc.key()
			if err != nil {
				return b, err
			}
			switch key {
			case "ts":
				b.TS, err = dc.float()
				hasTS = true
			case "events":
				b.Events, err = dc.events()
				hasEvents = true
			case "data_parallel_rank", "attn_dp_rank":
				b.DPRank, b.HasDPRank, err = dc.optInt()
			default:
				err = dc.skip()
			}
			if err != nil {
				return b, fmt.Errorf("batch %s: %w", key, err)
			}
		}
		if !hasTS || !hasEvents {
			return b, errors.New("batch without ts or events")
		}
		return b, nil
	}
	return b, fmt.Errorf("batch is code %#x, not an array or map", c)
}

func (dc *decoder) events() ([]Event, error) {
	n, err := dc.d.DecodeArrayLen()
	if err != nil {
		return nil, fmt.Errorf("events: %w", err)
	}
	if n < 0 {
		return nil, fmt.Errorf("events: %w", errNil)
	}
	var evs []Event
	if dc.reuse != nil {
		evs = grow(dc.reuse.events, dc.capFor(n))
	} else {
		evs = make([]Event, 0, dc.capFor(n))
	}
	for i := range n {
		var slot *eventSlot
		if dc.reuse != nil {
			slot = dc.reuse.slot(len(evs))
		}
		ev, err := dc.event(slot)
		if err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
		if ev != nil {
			evs = append(evs, ev)
		}
	}
	if dc.reuse != nil {
		dc.reuse.events = evs
	}
	return evs, nil
}

// grow returns s emptied, with room for n elements: s's own memory if it
// has the room.
func grow[T any](s []T, n int) []T {
	if s == nil || cap(s) < n {
		return make([]T, 0, n)
	}
	return s[:0]
}

// seenFields records which required fields an event carried.
type seenFields uint8

const (
	seenHashes seenFields = 1 << iota
	seenTokens
	seenBlockSize
)

// fields is every field an event may carry, as decoded.
type fields struct {
	seen      seenFields
	hashes    []Hash
	parent    Hash
	tokens    []uint32
	blockSize int
	loraID    int64
	hasLoRAID bool
	loraName  string
	medium    string
	cacheSalt string
	extra     [][]string
	group     int64
	hasGroup  bool
	specKind  string
}

// event decodes one event, into slot's memory if not nil; it returns nil,
// nil for an unknown tag, which it counts.
func (dc *decoder) event(slot *eventSlot) (Event, error) {
	c, err := dc.peek()
	if err != nil {
		return nil, err
	}
	var f fields
	if slot != nil {
		f.hashes, f.tokens = slot.hashes, slot.tokens
		defer func() { slot.hashes, slot.tokens = f.hashes, f.tokens }()
	}
	var tag string
	switch {
	case isArray(c):
		n, err := dc.d.DecodeArrayLen()
		if err != nil {
			return nil, err
		}
		if n < 1 {
			return nil, errors.New("event without a tag")
		}
		if tag, err = dc.tag(); err != nil {
			return nil, err
		}
		var names []string
		switch tag {
		case tagStored:
			names = storedFields
		case tagRemoved:
			names = removedFields
		}
		for i := 1; i < n; i++ {
			if i-1 < len(names) {
				err = dc.field(&f, names[i-1])
			} else {
				err = dc.skip()
			}
			if err != nil {
				return nil, err
			}
		}
	case isMap(c):
		n, err := dc.d.DecodeMapLen()
		if err != nil {
			return nil, err
		}
		for range n {
			key, err := dc.key()
			if err != nil {
				return nil, err
			}
			if key == "type" {
				if tag, err = dc.tag(); err != nil {
					return nil, err
				}
				continue
			}
			if err := dc.field(&f, key); err != nil {
				return nil, err
			}
		}
		if tag == "" {
			return nil, errors.New("event map without a type")
		}
	default:
		return nil, fmt.Errorf("event is code %#x, not an array or map", c)
	}
	return dc.build(tag, &f, slot)
}

// tag decodes an event's tag. msgspec may tag with integers too; no engine
// does, and such a tag is reported unknown.
func (dc *decoder) tag() (string, error) {
	c, err := dc.peek()
	if err != nil {
		return "", err
	}
	if msgpcode.IsString(c) {
		return dc.str()
	}
	if isInt(c) {
		v, err := dc.d.DecodeInt64()
		return fmt.Sprintf("%d", v), err
	}
	return "", fmt.Errorf("tag is code %#x", c)
}

// build returns the event of tag, in slot's memory if not nil.
func (dc *decoder) build(tag string, f *fields, slot *eventSlot) (Event, error) {
	switch tag {
	case tagStored:
		if f.seen&(seenHashes|seenTokens|seenBlockSize) != seenHashes|seenTokens|seenBlockSize {
			return nil, errors.New("BlockStored without block_hashes, token_ids or block_size")
		}
		var ev *BlockStored
		if slot != nil {
			ev = &slot.stored
		} else {
			ev = new(BlockStored)
		}
		*ev = BlockStored{
			BlockHashes: f.hashes, Parent: f.parent, TokenIDs: f.tokens, BlockSize: f.blockSize,
			LoRAID: f.loraID, HasLoRAID: f.hasLoRAID, LoRAName: f.loraName, Medium: f.medium,
			CacheSalt: f.cacheSalt, ExtraKeys: f.extra, Group: f.group, HasGroup: f.hasGroup,
			CacheSpecKind: f.specKind,
		}
		return ev, nil
	case tagRemoved:
		if f.seen&seenHashes == 0 {
			return nil, errors.New("BlockRemoved without block_hashes")
		}
		var ev *BlockRemoved
		if slot != nil {
			ev = &slot.removed
		} else {
			ev = new(BlockRemoved)
		}
		*ev = BlockRemoved{BlockHashes: f.hashes, Medium: f.medium, Group: f.group, HasGroup: f.hasGroup}
		return ev, nil
	case tagCleared:
		return &AllBlocksCleared{}, nil
	}
	if dc.unknown == 0 {
		dc.firstUnknown = tag
	}
	dc.unknown++
	return nil, nil
}

// field decodes the value of the named field into f, or skips it.
func (dc *decoder) field(f *fields, name string) error {
	var err error
	switch name {
	case "block_hashes":
		f.hashes, err = dc.hashes(f.hashes)
		f.seen |= seenHashes
	case "parent_block_hash":
		f.parent, err = dc.parentHash()
	case "token_ids":
		f.tokens, err = dc.tokens(f.tokens)
		f.seen |= seenTokens
	case "block_size":
		var v int64
		var ok bool
		v, ok, err = dc.optInt()
		if err == nil && (!ok || v < 0 || v > math.MaxInt32) {
			err = fmt.Errorf("block size %d", v)
		}
		f.blockSize = int(v)
		f.seen |= seenBlockSize
	case "lora_id":
		f.loraID, f.hasLoRAID, err = dc.optInt()
	case "medium":
		f.medium, err = dc.optString()
	case "lora_name":
		// SGLang puts its metadata map where vLLM puts lora_name.
		var c byte
		if c, err = dc.peek(); err == nil && isMap(c) {
			err = dc.metadata(f)
		} else if err == nil {
			f.loraName, err = dc.optString()
		}
	case "metadata":
		err = dc.metadata(f)
	case "extra_keys":
		f.extra, err = dc.extraKeys()
	case "group_idx":
		f.group, f.hasGroup, err = dc.optInt()
	case "kv_cache_spec_kind":
		f.specKind, err = dc.optString()
	default:
		return dc.skip()
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

func (dc *decoder) metadata(f *fields) error {
	c, err := dc.peek()
	if err != nil {
		return err
	}
	if c == msgpcode.Nil {
		return dc.d.DecodeNil()
	}
	n, err := dc.d.DecodeMapLen()
	if err != nil {
		return err
	}
	for range n {
		key, err := dc.key()
		if err != nil {
			return err
		}
		if key == "cache_salt" {
			f.cacheSalt, err = dc.optString()
		} else {
			err = dc.skip()
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (dc *decoder) key() (string, error) {
	c, err := dc.peek()
	if err != nil {
		return "", err
	}
	if !msgpcode.IsString(c) {
		return "", fmt.Errorf("map key is code %#x, not a string", c)
	}
	return dc.str()
}

func (dc *decoder) float() (float64, error) {
	c, err := dc.peek()
	if err != nil {
		return 0, err
	}
	if !isNumber(c) {
		return 0, fmt.Errorf("code %#x is not a number", c)
	}
	return dc.d.DecodeFloat64()
}

// optInt decodes nil (ok false) or an integer.
func (dc *decoder) optInt() (v int64, ok bool, err error) {
	c, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	if c == msgpcode.Nil {
		return 0, false, dc.d.DecodeNil()
	}
	if !isInt(c) {
		return 0, false, fmt.Errorf("code %#x is not an integer", c)
	}
	if c == msgpcode.Uint64 {
		u, err := dc.d.DecodeUint64()
		if err == nil && u > math.MaxInt64 {
			err = fmt.Errorf("integer %d out of range", u)
		}
		return int64(u), err == nil, err
	}
	v, err = dc.d.DecodeInt64()
	return v, err == nil, err
}

func (dc *decoder) optString() (string, error) {
	c, err := dc.peek()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		return "", dc.d.DecodeNil()
	}
	if !msgpcode.IsString(c) {
		return "", fmt.Errorf("code %#x is not a string", c)
	}
	return dc.str()
}

func (dc *decoder) optHash() (Hash, error) {
	c, err := dc.peek()
	if err != nil {
		return Hash{}, err
	}
	if c == msgpcode.Nil {
		return Hash{}, dc.d.DecodeNil()
	}
	return dc.hash()
}

// parentHash decodes a BlockStored's parent: nil, 0 and empty bytes are
// all "no parent" (the zero Hash). vLLM writes nil; publishers built on
// Go's msgpack structs (llm-d's kv-cache-manager and inference simulator,
// as their adapters read it) write 0 for a sequence's first block.
func (dc *decoder) parentHash() (Hash, error) {
	h, err := dc.optHash()
	if err != nil || NoParent(h) {
		return Hash{}, err
	}
	return h, nil
}

// hash decodes an integer or bytes hash; integers keep their bits.
func (dc *decoder) hash() (Hash, error) {
	c, err := dc.peek()
	if err != nil {
		return Hash{}, err
	}
	switch {
	case isInt(c):
		v, err := dc.d.DecodeUint64()
		return IntHash(v), err
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := dc.raw()
		return BytesHash(b), err
	}
	return Hash{}, fmt.Errorf("hash is code %#x", c)
}

// hashes decodes an array of hashes, into dst's memory if it has the
// room.
func (dc *decoder) hashes(dst []Hash) ([]Hash, error) {
	n, err := dc.d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, errNil
	}
	hs := grow(dst, dc.capFor(n))
	// Integers are read straight from the payload; anything else is left
	// to hash.
	for len(hs) < n {
		b := dc.buf[len(dc.buf)-dc.r.Len():]
		for len(hs) < n {
			v, k, ok := hashAt(b)
			if !ok {
				break
			}
			hs = append(hs, IntHash(v))
			b = b[k:]
		}
		if _, err := dc.r.Seek(int64(len(dc.buf)-len(b)), io.SeekStart); err != nil {
			return nil, err
		}
		if len(hs) == n {
			break
		}
		h, err := dc.hash()
		if err != nil {
			return nil, err
		}
		hs = append(hs, h)
	}
	return hs, nil
}

// hashAt decodes the msgpack integer b starts with, and its length, when
// it is a positive fixint, an unsigned integer or a 64-bit signed one (as
// its bits): the forms of the engines' hashes. ok is false for anything
// else (left to hash), and for a truncated integer.
func hashAt(b []byte) (v uint64, n int, ok bool) {
	if len(b) == 0 {
		return 0, 0, false
	}
	switch c := b[0]; {
	case c <= 0x7f:
		return uint64(c), 1, true
	case (c == msgpcode.Uint64 || c == msgpcode.Int64) && len(b) >= 9:
		return binary.BigEndian.Uint64(b[1:]), 9, true
	case c == msgpcode.Uint32 && len(b) >= 5:
		return uint64(binary.BigEndian.Uint32(b[1:])), 5, true
	case c == msgpcode.Uint16 && len(b) >= 3:
		return uint64(binary.BigEndian.Uint16(b[1:])), 3, true
	case c == msgpcode.Uint8 && len(b) >= 2:
		return uint64(b[1]), 2, true
	}
	return 0, 0, false
}

// tokens decodes an array of token ids, into dst's memory if it has the
// room.
func (dc *decoder) tokens(dst []uint32) ([]uint32, error) {
	n, err := dc.d.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, errNil
	}
	ts := grow(dst, dc.capFor(n))
	// The ids are read straight from the payload, as msgpack encodes
	// integers; anything else is left to optInt, which says what it is.
	pos := len(dc.buf) - dc.r.Len()
	b := dc.buf[pos:]
	for len(ts) < n && len(b) > 0 {
		// The usual forms first: fixint, uint16, uint32.
		var v uint32
		var k int
		switch c := b[0]; {
		case c <= 0x7f:
			v, k = uint32(c), 1
		case c == msgpcode.Uint16 && len(b) >= 3:
			v, k = uint32(binary.BigEndian.Uint16(b[1:])), 3
		case c == msgpcode.Uint32 && len(b) >= 5:
			v, k = binary.BigEndian.Uint32(b[1:]), 5
		default:
			var ok bool
			if v, k, ok = tokenAt(b); !ok {
				goto rest
			}
		}
		ts = append(ts, v)
		b = b[k:]
	}
rest:
	if _, err := dc.r.Seek(int64(len(dc.buf)-len(b)), io.SeekStart); err != nil {
		return nil, err
	}
	for len(ts) < n {
		v, ok, err := dc.optInt()
		if err != nil {
			return nil, err
		}
		if !ok || v < 0 || v > math.MaxUint32 {
			return nil, fmt.Errorf("token id %d out of range", v)
		}
		ts = append(ts, uint32(v))
	}
	return ts, nil
}

// tokenAt decodes the msgpack integer b starts with, and its length, when
// it is one a token id can be: 0 to 2³²−1, in any of msgpack's integer
// encodings. ok is false for anything else, and for a truncated integer.
func tokenAt(b []byte) (v uint32, n int, ok bool) {
	if len(b) == 0 {
		return 0, 0, false
	}
	c := b[0]
	if c <= 0x7f { // positive fixint
		return uint32(c), 1, true
	}
	var u uint64
	switch c {
	case msgpcode.Uint8, msgpcode.Int8:
		n = 2
	case msgpcode.Uint16, msgpcode.Int16:
		n = 3
	case msgpcode.Uint32, msgpcode.Int32:
		n = 5
	case msgpcode.Uint64, msgpcode.Int64:
		n = 9
	default:
		return 0, 0, false
	}
	if len(b) < n {
		return 0, 0, false
	}
	for _, x := range b[1:n] {
		u = u<<8 | uint64(x)
	}
	signed := c == msgpcode.Int8 || c == msgpcode.Int16 || c == msgpcode.Int32 || c == msgpcode.Int64
	if signed && b[1]&0x80 != 0 || u > math.MaxUint32 {
		return 0, 0, false // negative or too large: optInt's error
	}
	return uint32(u), n, true
}

// extraKeys decodes vLLM's list of per-block tuples (or nils), keeping the
// tuples' strings.
func (dc *decoder) extraKeys() ([][]string, error) {
	n, err := dc.d.DecodeArrayLen()
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([][]string, 0, dc.capFor(n))
	for range n {
		m, err := dc.d.DecodeArrayLen()
		if err != nil {
			return nil, err
		}
		var strs []string
		for range m {
			c, err := dc.peek()
			if err != nil {
				return nil, err
			}
			if msgpcode.IsString(c) {
				s, err := dc.str()
				if err != nil {
					return nil, err
				}
				strs = append(strs, s)
				continue
			}
			if err := dc.skip(); err != nil {
				return nil, err
			}
		}
		out = append(out, strs)
	}
	return out, nil
}

func (dc *decoder) skipN(n int) error {
	for range n {
		if err := dc.skip(); err != nil {
			return err
		}
	}
	return nil
}

// skip skips one value without recursion: a forged payload of nested
// arrays must not grow the stack.
func (dc *decoder) skip() error {
	for pending := uint64(1); pending > 0; pending-- {
		c, err := dc.peek()
		if err != nil {
			return err
		}
		switch {
		case isArray(c):
			n, err := dc.d.DecodeArrayLen()
			if err != nil {
				return err
			}
			pending += uint64(max(n, 0))
		case isMap(c):
			n, err := dc.d.DecodeMapLen()
			if err != nil {
				return err
			}
			pending += 2 * uint64(max(n, 0))
		default:
			if err := dc.fits(); err != nil {
				return err
			}
			if err := dc.d.Skip(); err != nil {
				return err
			}
		}
		if pending > uint64(dc.r.Len())+1 {
			return errors.New("more values declared than bytes left")
		}
	}
	return nil
}

var (
	_ Event = (*BlockStored)(nil)
	_ Event = (*BlockRemoved)(nil)
	_ Event = (*AllBlocksCleared)(nil)
)
