package blockkey_test

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/transfer/blockkey"
)

func TestAppendTokensChains(t *testing.T) {
	seed := blockkey.TokenSeed(blockkey.Salt("m", "", ""))
	a := blockkey.AppendTokens(nil, seed, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4)
	if len(a) != 2 {
		t.Fatalf("got %d keys, want 2 (a partial block has none)", len(a))
	}
	b := blockkey.AppendTokens(nil, seed, []int{1, 2, 3, 4, 5, 6, 7, 0}, 4)
	if a[0] != b[0] {
		t.Error("equal first blocks gave different keys (or int and uint32 tokens differ)")
	}
	if a[1] == b[1] {
		t.Error("different second blocks gave equal keys")
	}
	c := blockkey.AppendTokens(nil, seed, []uint32{0, 2, 3, 4, 5, 6, 7, 8}, 4)
	if c[1] == a[1] {
		t.Error("equal second blocks after different first blocks gave equal keys")
	}
	if got := blockkey.AppendTokens(nil, seed, []uint32{1, 2}, 0); len(got) != 0 {
		t.Errorf("block size 0 gave %d keys", len(got))
	}
}

func TestSaltSeparates(t *testing.T) {
	tokens := tokenRun(0, 32)
	keys := map[uint64]string{}
	for _, s := range [][3]string{{"m", "", ""}, {"m", "a", ""}, {"m", "", "a"}, {"m2", "", ""}, {"", "m", ""}} {
		k := blockkey.AppendTokens(nil, blockkey.TokenSeed(blockkey.Salt(s[0], s[1], s[2])), tokens, 16)[0]
		if prev, dup := keys[k]; dup {
			t.Errorf("salts %v and %s share a key", s, prev)
		}
		keys[k] = fmt.Sprint(s)
	}
}

// TestNextKeyIsOneHash checks NextTokenKey against hashing the block's bytes at
// once, across the sizes where it writes its buffer several times.
func TestNextKeyIsOneHash(t *testing.T) {
	for _, n := range []int{1, 16, 63, 64, 65, 200} {
		block := tokenRun(1000, n)
		buf := make([]byte, 4*n)
		for i, tok := range block {
			binary.LittleEndian.PutUint32(buf[4*i:], tok)
		}
		var d xxhash.Digest
		d.ResetWithSeed(42)
		d.Write(buf)
		if got, want := blockkey.NextTokenKey(42, block), d.Sum64(); got != want {
			t.Errorf("%d tokens: NextTokenKey = %x, want %x", n, got, want)
		}
	}
}

func BenchmarkAppendTokens8000Tokens(b *testing.B) {
	tokens := tokenRun(0, 8000)
	dst := make([]uint64, 0, 500)
	b.SetBytes(4 * 8000)
	b.ReportAllocs()
	for b.Loop() {
		dst = blockkey.AppendTokens(dst[:0], 1, tokens, 16)
	}
}

// tokenRun is n token ids counting up from from.
func tokenRun(from, n int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = uint32(from + i)
	}
	return ts
}
