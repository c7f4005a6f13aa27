package transfer

import "testing"

func TestDirtyPool(t *testing.T) {
	var p dirtyPool
	for _, n := range []int{0, 1, 255, 256, 257, 16 << 10, 1<<20 + 30, 8 << 20, 8<<20 + 1} {
		b := p.Get(n)
		if len(*b) != n {
			t.Errorf("Get(%d): len %d", n, len(*b))
		}
		p.Put(b)
		if b := p.Get(n); len(*b) != n {
			t.Errorf("Get(%d) after Put: len %d", n, len(*b))
		}
	}
	foreign := make([]byte, 1000)
	p.Put(&foreign) // not a tier's size: dropped, not handed out
	if b := p.Get(1000); cap(*b) != 1024 {
		t.Errorf("Get(1000) after a foreign Put: cap %d, want 1024", cap(*b))
	}
}
