package kvstore_test

import (
	"testing"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
)

func TestMemoryEvictsLeastRecentlyUsed(t *testing.T) {
	const size = 1 << 10
	// Room for 4 blocks of 1 KiB with their key and overhead, not 5.
	m := kvstore.NewMemory(kvstore.MemoryConfig{Capacity: 4*size + 4*300})
	t.Cleanup(func() { m.Close() })
	ns := transfer.Namespace{Model: "m"}
	mustPut(t, m, ns, blocks(size, 1, 2, 3, 4))
	mustGet(t, m, ns, []uint64{1}, size) // 1 is now the most recently used
	mustPut(t, m, ns, blocks(size, 5))   // evicts 2

	got := mustExist(t, m, ns, []uint64{1, 2, 3, 4, 5})
	want := []bool{true, false, true, true, true}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("after eviction Exists = %v, want %v", got, want)
			break
		}
	}
	if m.Len() != 4 {
		t.Errorf("Len = %d, want 4", m.Len())
	}
	if used, capacity := m.Used(), int64(4*size+4*300); used > capacity {
		t.Errorf("Used = %d, over the capacity %d", used, capacity)
	}
}

func TestMemorySkipsBlocksLargerThanCapacity(t *testing.T) {
	m := kvstore.NewMemory(kvstore.MemoryConfig{Capacity: 4096})
	t.Cleanup(func() { m.Close() })
	ns := transfer.Namespace{Model: "m"}
	mustPut(t, m, ns, blocks(1024, 1))
	mustPut(t, m, ns, blocks(8192, 2))
	if got := mustExist(t, m, ns, []uint64{1, 2}); !got[0] || got[1] {
		t.Errorf("Exists = %v, want [true false]: an oversized block neither stored nor evicting", got)
	}
}
