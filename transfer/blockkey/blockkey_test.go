package blockkey

import (
	"strings"
	"testing"
)

func TestAppendChains(t *testing.T) {
	seed := Seed("m", "")
	a := Append(nil, seed, strings.Repeat("a", 64)+strings.Repeat("b", 64)+"tail", 64)
	if len(a) != 2 {
		t.Fatalf("got %d keys, want 2 (partial block has none)", len(a))
	}
	b := Append(nil, seed, strings.Repeat("a", 64)+strings.Repeat("c", 64), 64)
	if a[0] != b[0] {
		t.Errorf("equal first blocks gave different keys")
	}
	if a[1] == b[1] {
		t.Errorf("different second blocks gave equal keys")
	}
	// A block's key depends on everything before it.
	c := Append(nil, seed, strings.Repeat("z", 64)+strings.Repeat("b", 64), 64)
	if c[1] == a[1] {
		t.Errorf("equal second blocks after different first blocks gave equal keys")
	}
}

func TestTenantSalts(t *testing.T) {
	text := strings.Repeat("x", 128)
	a := Append(nil, Seed("m", "tenant-a"), text, 64)
	b := Append(nil, Seed("m", "tenant-b"), text, 64)
	for i := range a {
		if a[i] == b[i] {
			t.Fatalf("block %d: tenants share a key", i)
		}
	}
	if Prefix(Seed("m", "a"), text, 4096) == Prefix(Seed("m", "b"), text, 4096) {
		t.Fatal("tenants share a prefix key")
	}
	if Seed("ab", "c") == Seed("a", "bc") {
		t.Fatal("model/tenant boundary is ambiguous")
	}
}

func TestCharactersNotBytes(t *testing.T) {
	// 64 three-byte runes form one block, not three.
	text := strings.Repeat("語", 64)
	if got := len(Append(nil, 1, text, 64)); got != 1 {
		t.Fatalf("got %d keys, want 1", got)
	}
	if got := len(Append(nil, 1, text[:len(text)-3], 64)); got != 0 {
		t.Fatalf("63 runes: got %d keys, want 0", got)
	}
}

func TestPrefixBoundsText(t *testing.T) {
	base := strings.Repeat("p", 100)
	if Prefix(1, base+"one", 100) != Prefix(1, base+"two", 100) {
		t.Error("texts equal in their first 100 characters got different keys")
	}
	if Prefix(1, base+"one", 101) == Prefix(1, base+"two", 101) {
		t.Error("texts differing within the prefix got equal keys")
	}
	if PrefixBytes(1, []byte(base+"x"), 100) != PrefixBytes(1, []byte(base+"y"), 100) {
		t.Error("bodies equal in their first 100 bytes got different keys")
	}
}

func TestTokens(t *testing.T) {
	for _, c := range []struct{ chars, want int }{{0, 0}, {1, 1}, {4, 1}, {5, 2}, {64, 16}} {
		if got := Tokens(c.chars); got != c.want {
			t.Errorf("Tokens(%d) = %d, want %d", c.chars, got, c.want)
		}
	}
}

func BenchmarkAppend8000Tokens(b *testing.B) {
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 32000/45)
	dst := make([]uint64, 0, 600)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		dst = Append(dst[:0], 7, text, DefaultBlockChars)
	}
}

func BenchmarkPrefix4096(b *testing.B) {
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 200)
	b.ReportAllocs()
	for b.Loop() {
		Prefix(7, text, 4096)
	}
}

// TestByteLenMatchesRunes: byteLen counts characters as ranging over the
// string does, for ASCII, multi-byte and invalid UTF-8 at every position
// of the word-at-a-time scan.
func TestByteLenMatchesRunes(t *testing.T) {
	want := func(s string, n int) int {
		c := 0
		for i := range s {
			if c == n {
				return i
			}
			c++
		}
		if c == n {
			return len(s)
		}
		return -1
	}
	pieces := []string{"a", "b", "é", "語", "🙂", "\xff", "\xe8\x80"}
	for size := range 24 {
		for pos := range size + 1 {
			for _, p := range pieces {
				s := strings.Repeat("x", pos) + p + strings.Repeat("y", size-pos)
				for n := 0; n <= len(s)+1; n++ {
					if got, w := byteLen(s, n), want(s, n); got != w {
						t.Fatalf("byteLen(%q, %d) = %d, want %d", s, n, got, w)
					}
				}
			}
		}
	}
}
