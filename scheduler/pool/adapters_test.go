package pool

import (
	"slices"
	"testing"
)

func TestWorkerAdapters(t *testing.T) {
	w := &Worker{Name: "w", MaxLoRAs: 2}
	if w.HoldsAdapter("sql") || !w.AdapterSlotFree() {
		t.Fatalf("a new worker holds sql or has no free slot")
	}
	w.AddAdapter("sql")
	w.AddAdapter("chat")
	if !w.HoldsAdapter("sql") || !w.HoldsAdapter("chat") || w.AdapterSlotFree() {
		t.Errorf("after two loads: holds %v, slot free %t; want sql and chat, no free slot", w.Adapters(), w.AdapterSlotFree())
	}
	w.TouchAdapter("sql")
	if got, ok := w.LRUAdapter("math"); !ok || got != "chat" {
		t.Errorf("LRUAdapter = %q, %t; want chat (sql was used since)", got, ok)
	}
	if got, ok := w.LRUAdapter("chat"); !ok || got != "sql" {
		t.Errorf("LRUAdapter(keep chat) = %q, %t; want sql", got, ok)
	}
	w.RemoveAdapter("chat")
	if w.HoldsAdapter("chat") || !w.AdapterSlotFree() {
		t.Errorf("after removing chat: holds %v", w.Adapters())
	}

	// The engine's report replaces what the worker holds, but an adapter
	// the scheduler loaded lately stays: the engine may load it only on
	// its first request.
	w.SetAdapters([]string{"math"})
	if got := slices.Sorted(slices.Values(w.Adapters())); !slices.Equal(got, []string{"math", "sql"}) {
		t.Errorf("after the engine reported [math]: holds %v, want [math sql]", got)
	}
	w.lora.mu.Lock()
	w.lora.loaded["sql"] = w.lora.loaded["sql"].Add(-AdapterGrace)
	w.lora.mu.Unlock()
	w.SetAdapters([]string{"math"})
	if got := w.Adapters(); !slices.Equal(got, []string{"math"}) {
		t.Errorf("after the grace: holds %v, want [math]", got)
	}
	if _, ok := w.LRUAdapter("math"); ok {
		t.Errorf("LRUAdapter found an adapter other than math")
	}
	if (&Worker{}).AdapterSlotFree() {
		t.Errorf("a worker without max_loras has a free slot")
	}
}
