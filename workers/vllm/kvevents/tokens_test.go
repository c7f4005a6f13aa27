package kvevents

import (
	"bytes"
	"math"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// TestTokenAt: the token ids read straight from a payload agree with
// msgpack's decoder for every integer encoding, and anything that is not
// an id (negative, over 2³²−1, truncated, not an integer) is left to it.
func TestTokenAt(t *testing.T) {
	values := []int64{0, 1, 127, 128, 255, 256, 32767, 32768, 65535, 65536, 1<<31 - 1, 1 << 31, math.MaxUint32,
		math.MaxUint32 + 1, -1, -32, -33, -129, math.MinInt32, math.MaxInt64}
	encoders := map[string]func(e *msgpack.Encoder, v int64) error{
		"compact": func(e *msgpack.Encoder, v int64) error { return e.EncodeInt(v) },
		"int8":    func(e *msgpack.Encoder, v int64) error { return e.EncodeInt8(int8(v)) },
		"int16":   func(e *msgpack.Encoder, v int64) error { return e.EncodeInt16(int16(v)) },
		"int32":   func(e *msgpack.Encoder, v int64) error { return e.EncodeInt32(int32(v)) },
		"int64":   func(e *msgpack.Encoder, v int64) error { return e.EncodeInt64(v) },
		"uint8":   func(e *msgpack.Encoder, v int64) error { return e.EncodeUint8(uint8(v)) },
		"uint16":  func(e *msgpack.Encoder, v int64) error { return e.EncodeUint16(uint16(v)) },
		"uint32":  func(e *msgpack.Encoder, v int64) error { return e.EncodeUint32(uint32(v)) },
		"uint64":  func(e *msgpack.Encoder, v int64) error { return e.EncodeUint64(uint64(v)) },
	}
	for name, enc := range encoders {
		for _, v := range values {
			var buf bytes.Buffer
			if err := enc(msgpack.NewEncoder(&buf), v); err != nil {
				t.Fatal(err)
			}
			b := buf.Bytes()
			want, err := msgpack.NewDecoder(bytes.NewReader(b)).DecodeInt64()
			if c := b[0]; c == 0xcf { // uint64: msgpack reads its bits
				u, _ := msgpack.NewDecoder(bytes.NewReader(b)).DecodeUint64()
				want, err = int64(u), nil
				if u > math.MaxInt64 {
					want = -1
				}
			}
			got, n, ok := tokenAt(b)
			wantOK := err == nil && want >= 0 && want <= math.MaxUint32
			if ok != wantOK || ok && (int64(got) != want || n != len(b)) {
				t.Errorf("%s %d (% x): tokenAt = %d, %d, %v; msgpack reads %d (%v)", name, v, b, got, n, ok, want, err)
			}
			if _, _, ok := tokenAt(b[:len(b)-1]); ok {
				t.Errorf("%s %d: a truncated integer (% x) read as a token id", name, v, b[:len(b)-1])
			}
		}
	}
	for _, b := range [][]byte{{0xc0}, {0xa1, 'x'}, {0xca, 0, 0, 0, 0}, {0xe0}} {
		if _, _, ok := tokenAt(b); ok {
			t.Errorf("% x read as a token id", b)
		}
	}
}
