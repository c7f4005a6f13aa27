package kvevents_test

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/workers/vllm/kvevents"
)

func TestAppendKeysChains(t *testing.T) {
	seed := kvevents.Seed(kvevents.Salt("m", "", ""))
	a := kvevents.AppendKeys(nil, seed, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4)
	if len(a) != 2 {
		t.Fatalf("got %d keys, want 2 (a partial block has none)", len(a))
	}
	b := kvevents.AppendKeys(nil, seed, []int{1, 2, 3, 4, 5, 6, 7, 0}, 4)
	if a[0] != b[0] {
		t.Error("equal first blocks gave different keys (or int and uint32 tokens differ)")
	}
	if a[1] == b[1] {
		t.Error("different second blocks gave equal keys")
	}
	c := kvevents.AppendKeys(nil, seed, []uint32{0, 2, 3, 4, 5, 6, 7, 8}, 4)
	if c[1] == a[1] {
		t.Error("equal second blocks after different first blocks gave equal keys")
	}
	if got := kvevents.AppendKeys(nil, seed, []uint32{1, 2}, 0); len(got) != 0 {
		t.Errorf("block size 0 gave %d keys", len(got))
	}
}

func TestSaltSeparates(t *testing.T) {
	tokens := seq(0, 32)
	keys := map[uint64]string{}
	for _, s := range [][3]string{{"m", "", ""}, {"m", "a", ""}, {"m", "", "a"}, {"m2", "", ""}, {"", "m", ""}} {
		k := kvevents.AppendKeys(nil, kvevents.Seed(kvevents.Salt(s[0], s[1], s[2])), tokens, 16)[0]
		if prev, dup := keys[k]; dup {
			t.Errorf("salts %v and %s share a key", s, prev)
		}
		keys[k] = fmt.Sprint(s)
	}
}

// TestNextKeyIsOneHash checks NextKey against hashing the block's bytes at
// once, across the sizes where it writes its buffer several times.
func TestNextKeyIsOneHash(t *testing.T) {
	for _, n := range []int{1, 16, 63, 64, 65, 200} {
		block := seq(1000, n)
		buf := make([]byte, 4*n)
		for i, tok := range block {
			binary.LittleEndian.PutUint32(buf[4*i:], tok)
		}
		var d xxhash.Digest
		d.ResetWithSeed(42)
		d.Write(buf)
		if got, want := kvevents.NextKey(42, block), d.Sum64(); got != want {
			t.Errorf("%d tokens: NextKey = %x, want %x", n, got, want)
		}
	}
}

func BenchmarkAppendKeys8000Tokens(b *testing.B) {
	tokens := seq(0, 8000)
	dst := make([]uint64, 0, 500)
	b.SetBytes(4 * 8000)
	b.ReportAllocs()
	for b.Loop() {
		dst = kvevents.AppendKeys(dst[:0], 1, tokens, 16)
	}
}
