package kvblock

import (
	"errors"
	"testing"
)

func TestSize(t *testing.T) {
	for _, c := range []struct {
		perToken      int64
		tokens, scale int
		want          int
	}{
		{128 << 10, 16, 1, 2 << 20},   // Llama-3.1-8B, real size
		{128 << 10, 16, 64, 32 << 10}, // default scale
		{320 << 10, 16, 0, 80 << 10},  // Llama-3.1-70B, default scale
		{10, 1, 1000, 64},             // floor
	} {
		if got := Size(c.perToken, c.tokens, c.scale); got != c.want {
			t.Errorf("Size(%d, %d, %d) = %d, want %d", c.perToken, c.tokens, c.scale, got, c.want)
		}
	}
}

func TestFillVerify(t *testing.T) {
	a := make([]byte, 1000)
	Fill(a, 42)
	b := make([]byte, 1000)
	Fill(b, 42)
	if string(a) != string(b) {
		t.Fatal("Fill is not deterministic")
	}
	crc := Checksum(a)
	if err := Verify(42, a, 1000, crc); err != nil {
		t.Fatalf("good block: %v", err)
	}
	if err := Verify(43, a, 1000, crc); !errors.Is(err, ErrContents) {
		t.Errorf("wrong key: got %v", err)
	}
	if err := Verify(42, a[:999], 1000, crc); !errors.Is(err, ErrSize) {
		t.Errorf("short block: got %v", err)
	}
	a[500] ^= 1
	if err := Verify(42, a, 1000, crc); !errors.Is(err, ErrChecksum) {
		t.Errorf("flipped bit: got %v", err)
	}
	// Right checksum, wrong tail: another block's last word.
	d := append([]byte(nil), b...)
	other := make([]byte, 1000)
	Fill(other, 44)
	copy(d[992:1000], other[992:1000])
	if err := Verify(42, d, 1000, Checksum(d)); !errors.Is(err, ErrContents) {
		t.Errorf("wrong last word: got %v", err)
	}
	c := make([]byte, 1000)
	Fill(c, 43)
	if string(c[:8]) == string(b[:8]) {
		t.Error("different keys gave equal contents")
	}
}

func TestUpdateChecksumVerifySum(t *testing.T) {
	a := make([]byte, 1000)
	Fill(a, 42)
	crc := Checksum(a)
	var sum uint32
	for _, p := range [][]byte{a[:1], a[1:333], a[333:333], a[333:]} {
		sum = UpdateChecksum(sum, p)
	}
	if sum != crc {
		t.Fatalf("piecewise checksum %x, want %x", sum, crc)
	}
	if err := VerifySum(42, a, 1000, crc, sum); err != nil {
		t.Fatalf("good block: %v", err)
	}
	if err := VerifySum(42, a, 1000, crc, sum^1); !errors.Is(err, ErrChecksum) {
		t.Errorf("wrong sum: got %v", err)
	}
	if err := VerifySum(43, a, 1000, Checksum(a), Checksum(a)); !errors.Is(err, ErrContents) {
		t.Errorf("wrong key: got %v", err)
	}
	if err := VerifySum(42, a[:999], 1000, crc, Checksum(a[:999])); !errors.Is(err, ErrSize) {
		t.Errorf("short block: got %v", err)
	}
}

func BenchmarkFill1MiB(b *testing.B) {
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		Fill(buf, 7)
	}
}

func BenchmarkChecksum1MiB(b *testing.B) {
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		Checksum(buf)
	}
}
