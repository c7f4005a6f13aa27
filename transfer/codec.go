package transfer

import (
	"encoding/binary"
	"errors"
	"fmt"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the codec kvCodec delegates to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/batonllm/baton/transfer/kvblock"
)

// codecName is the content-subtype of pushes that use kvCodec
// ("application/grpc+batonkv"). A gRPC server picks a call's codec by its
// content-subtype, so a worker needs no server option to serve it.
const codecName = "batonkv"

// kvCodec encodes BlockChunk messages (proto/worker.proto) by hand, with
// the protobuf wire format, and delegates every other message to the proto
// codec. On the receiving side it copies a chunk's data straight from
// gRPC's receive buffers into the block being reassembled, where the proto
// codec would first flatten the message into one buffer and then allocate
// the bytes field anew: one copy and one allocation per chunk fewer.
type kvCodec struct{ proto encoding.CodecV2 }

func init() {
	// gRPC's registry is global and must be filled at init time
	// (encoding.RegisterCodecV2 is not safe for concurrent use).
	encoding.RegisterCodecV2(kvCodec{proto: encoding.GetCodecV2("proto")})
}

func (kvCodec) Name() string { return codecName }

// chunkOut is a BlockChunk to send.
type chunkOut struct {
	transferID string
	key        uint64
	size, crc  uint32
	data       []byte
}

// chunkReady is a BlockChunk already encoded, by encodeBlock, in a buffer
// from kvPool. Sending it hands the buffer to gRPC, which returns it to
// the pool once written; a chunk is sent at most once.
type chunkReady struct {
	buf *[]byte
	n   int // data bytes
}

// encodeBlock encodes the chunks of a block, of at most chunk bytes of
// data each, into buffers from kvPool, appending them to out. It copies
// the block's data once and checksums each piece just after copying it,
// while it is in cache, so the sender reads the caller's bytes only once;
// the first chunk's header, which carries the checksum, is written last.
func encodeBlock(out []chunkReady, key uint64, data []byte, chunk int) []chunkReady {
	size := uint32(len(data))
	var crc uint32
	var first *[]byte
	for i := 0; i == 0 || len(data) > 0; i++ {
		n := min(len(data), chunk)
		h := 1 + protowire.SizeVarint(uint64(n)) // data's tag and length
		if i == 0 {
			h += 1 + 8 + 1 + protowire.SizeVarint(uint64(size)) + 1 + 4
		}
		buf := kvPool.Get(h + n)
		dst := (*buf)[h:]
		for off := 0; off < n; {
			k := copy(dst[off:min(n, off+sumPiece)], data[off:])
			crc = kvblock.UpdateChecksum(crc, dst[off:off+k])
			off += k
		}
		b := (*buf)[:0]
		if i == 0 {
			first = buf
			b = b[:h-1-protowire.SizeVarint(uint64(n))] // the block header, below
		}
		b = protowire.AppendTag(b, fieldData, protowire.BytesType)
		protowire.AppendVarint(b, uint64(n))
		out = append(out, chunkReady{buf: buf, n: n})
		data = data[n:]
	}
	b := protowire.AppendTag((*first)[:0], fieldKey, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, key)
	b = protowire.AppendTag(b, fieldSize, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(size))
	b = protowire.AppendTag(b, fieldCRC, protowire.Fixed32Type)
	protowire.AppendFixed32(b, crc)
	return out
}

// chunkIn is a BlockChunk received into an assembler: the codec sets the
// transfer id, begins blocks and copies their data as it decodes.
type chunkIn struct {
	a *assembler
}

// Field numbers of BlockChunk.
const (
	fieldTransferID protowire.Number = 1
	fieldKey        protowire.Number = 2
	fieldSize       protowire.Number = 3
	fieldCRC        protowire.Number = 4
	fieldData       protowire.Number = 5
)

func (c kvCodec) Marshal(v any) (mem.BufferSlice, error) {
	if r, ok := v.(*chunkReady); ok {
		return mem.BufferSlice{mem.NewBuffer(r.buf, kvPool)}, nil
	}
	m, ok := v.(*chunkOut)
	if !ok {
		return c.proto.Marshal(v)
	}
	n := 0
	if m.transferID != "" {
		n += 1 + protowire.SizeBytes(len(m.transferID))
	}
	if m.size != 0 {
		n += 1 + 8 + 1 + protowire.SizeVarint(uint64(m.size)) + 1 + 4
	}
	if len(m.data) > 0 {
		n += 1 + protowire.SizeBytes(len(m.data))
	}
	pool := kvPool
	buf := pool.Get(n)
	b := (*buf)[:0]
	if m.transferID != "" {
		b = protowire.AppendTag(b, fieldTransferID, protowire.BytesType)
		b = protowire.AppendString(b, m.transferID)
	}
	if m.size != 0 {
		b = protowire.AppendTag(b, fieldKey, protowire.Fixed64Type)
		b = protowire.AppendFixed64(b, m.key)
		b = protowire.AppendTag(b, fieldSize, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(m.size))
		b = protowire.AppendTag(b, fieldCRC, protowire.Fixed32Type)
		b = protowire.AppendFixed32(b, m.crc)
	}
	if len(m.data) > 0 {
		b = protowire.AppendTag(b, fieldData, protowire.BytesType)
		b = protowire.AppendBytes(b, m.data)
	}
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

func (c kvCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(*chunkIn)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	return m.decode(data)
}

var errTruncated = errors.New("truncated BlockChunk")

// decode parses one BlockChunk from s into m.a. The header fields must
// precede the data, as every protobuf encoder writes them (in field
// order); data before its header is an error.
func (m *chunkIn) decode(s mem.BufferSlice) error {
	r := cursor{s: s}
	var (
		key       uint64
		size, crc uint32
		begun     bool
	)
	beginBlock := func() {
		if size != 0 && !begun {
			m.a.begin(key, size, crc)
			begun = true
		}
	}
	for !r.done() {
		tag, err := r.varint()
		if err != nil {
			return err
		}
		num, typ := protowire.DecodeTag(tag)
		switch {
		case num == fieldTransferID && typ == protowire.BytesType:
			n, err := r.varint()
			if err != nil {
				return err
			}
			if n > 1<<10 {
				return fmt.Errorf("transfer id of %d bytes", n)
			}
			id := make([]byte, n)
			if err := r.read(id); err != nil {
				return err
			}
			if m.a.id == "" { // only the first message's counts
				m.a.id = string(id)
			}
		case num == fieldKey && typ == protowire.Fixed64Type:
			var b [8]byte
			if err := r.read(b[:]); err != nil {
				return err
			}
			key = binary.LittleEndian.Uint64(b[:])
		case num == fieldSize && typ == protowire.VarintType:
			n, err := r.varint()
			if err != nil {
				return err
			}
			size = uint32(n)
		case num == fieldCRC && typ == protowire.Fixed32Type:
			var b [4]byte
			if err := r.read(b[:]); err != nil {
				return err
			}
			crc = binary.LittleEndian.Uint32(b[:])
		case num == fieldData && typ == protowire.BytesType:
			n, err := r.varint()
			if err != nil {
				return err
			}
			if n > uint64(r.remaining()) {
				return errTruncated
			}
			beginBlock()
			dst, err := m.a.reserve(int(n))
			if err != nil {
				return err
			}
			if dst != nil {
				err = r.readSummed(dst, m.a)
			} else {
				err = r.skip(int(n))
			}
			if err != nil {
				return err
			}
		default:
			if err := r.skipField(typ); err != nil {
				return fmt.Errorf("field %d: %w", num, err)
			}
		}
	}
	beginBlock()
	return nil
}

// cursor reads a mem.BufferSlice in place, without the allocation of a
// mem.Reader.
type cursor struct {
	s   mem.BufferSlice
	i   int // current buffer
	off int // offset in it
}

func (r *cursor) cur() []byte {
	for r.i < len(r.s) {
		b := r.s[r.i].ReadOnlyData()
		if r.off < len(b) {
			return b[r.off:]
		}
		r.i, r.off = r.i+1, 0
	}
	return nil
}

func (r *cursor) done() bool { return len(r.cur()) == 0 }

func (r *cursor) remaining() int {
	n := len(r.cur())
	for j := r.i + 1; j < len(r.s); j++ {
		n += r.s[j].Len()
	}
	return n
}

func (r *cursor) read(dst []byte) error {
	for len(dst) > 0 {
		b := r.cur()
		if len(b) == 0 {
			return errTruncated
		}
		n := copy(dst, b)
		dst, r.off = dst[n:], r.off+n
	}
	return nil
}

// readSummed is read for the block in progress of a: it adds each piece
// to the block's checksum as soon as it is copied, while it is in cache.
func (r *cursor) readSummed(dst []byte, a *assembler) error {
	for len(dst) > 0 {
		b := r.cur()
		if len(b) == 0 {
			return errTruncated
		}
		n := copy(dst[:min(len(dst), sumPiece)], b)
		a.summed(dst[:n])
		dst, r.off = dst[n:], r.off+n
	}
	return nil
}

func (r *cursor) skip(n int) error {
	for n > 0 {
		b := r.cur()
		if len(b) == 0 {
			return errTruncated
		}
		k := min(n, len(b))
		n, r.off = n-k, r.off+k
	}
	return nil
}

func (r *cursor) varint() (uint64, error) {
	var x uint64
	for shift := uint(0); shift < 64; shift += 7 {
		b := r.cur()
		if len(b) == 0 {
			return 0, errTruncated
		}
		c := b[0]
		r.off++
		x |= uint64(c&0x7f) << shift
		if c < 0x80 {
			return x, nil
		}
	}
	return 0, errors.New("varint overflow")
}

func (r *cursor) skipField(typ protowire.Type) error {
	switch typ {
	case protowire.VarintType:
		_, err := r.varint()
		return err
	case protowire.Fixed32Type:
		return r.skip(4)
	case protowire.Fixed64Type:
		return r.skip(8)
	case protowire.BytesType:
		n, err := r.varint()
		if err != nil {
			return err
		}
		if n > uint64(r.remaining()) {
			return errTruncated
		}
		return r.skip(int(n))
	default:
		return fmt.Errorf("unsupported wire type %d", typ)
	}
}
