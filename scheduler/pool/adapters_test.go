package pool

import (
	"slices"
	"testing"
	"time"
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

// A slot is reserved by one load at a time: a free one, then the least
// recently used idle adapter's, which stops being held at once; a loaded
// adapter is pinned until its waiters are routed, and a pin needs the
// adapter held.
func TestWorkerAdapterReservations(t *testing.T) {
	w := &Worker{Name: "w", MaxLoRAs: 2}
	w.AddAdapter("sql")
	if v, ok := w.ReserveAdapter("chat"); !ok || v != "" {
		t.Fatalf("ReserveAdapter(chat) with a free slot = %q, %t; want no victim", v, ok)
	}
	if w.AdapterSlotFree() {
		t.Errorf("a slot is free while chat loads into the last one")
	}
	if _, ok := w.ReserveAdapter("chat"); ok {
		t.Errorf("chat reserved twice")
	}
	// The only slot left is sql's, idle: math takes it, and sql goes.
	if v, ok := w.ReserveAdapter("math"); !ok || v != "sql" || w.HoldsAdapter("sql") {
		t.Fatalf("ReserveAdapter(math) = %q, %t, holds %v; want victim sql, no longer held", v, ok, w.Adapters())
	}
	if v, ok := w.ReserveAdapter("code"); ok {
		t.Errorf("ReserveAdapter(code) with both slots loading = %q, true; want none", v)
	}
	unpin := w.EndAdapterLoad("chat", true)
	w.EndAdapterLoad("math", false)
	if !w.HoldsAdapter("chat") || w.HoldsAdapter("math") || !w.AdapterSlotFree() {
		t.Fatalf("after chat loaded and math failed: holds %v, slot free %t", w.Adapters(), w.AdapterSlotFree())
	}
	w.AddAdapter("code")
	// chat, just loaded, is pinned for its waiters: not evicted, though
	// older than code.
	if v, ok := w.ReserveAdapter("math"); !ok || v != "code" {
		t.Fatalf("ReserveAdapter(math) with chat pinned = %q, %t; want code", v, ok)
	}
	w.EndAdapterLoad("math", false)
	unpin()
	unpin() // once only
	w.AddAdapter("code")
	end, ok := w.PinAdapter("chat")
	endCode, okCode := w.PinAdapter("code")
	if !ok || !okCode {
		t.Fatal("PinAdapter failed while held")
	}
	if v, ok := w.ReserveAdapter("math"); ok {
		t.Errorf("ReserveAdapter(math) = %q, true with every slot's adapter pinned", v)
	}
	end()
	w.TouchAdapter("chat")
	endCode()
	endCode()
	w.TouchAdapter("code")
	if v, ok := w.ReserveAdapter("math"); !ok || v != "chat" {
		t.Errorf("ReserveAdapter(math) with chat idle = %q, %t; want chat", v, ok)
	}
	if _, ok := w.PinAdapter("chat"); ok {
		t.Error("PinAdapter(chat) succeeded once chat was evicted")
	}
}

// An engine's report read before an unload reached it still lists the
// adapter the scheduler evicted: it does not give that adapter its slot
// back, so a second load cannot evict it again and take the slot twice.
// Once the grace is over, the engine's reports say what it holds.
func TestStaleReportKeepsEvictedOut(t *testing.T) {
	w := &Worker{Name: "w", MaxLoRAs: 1}
	w.AddAdapter("sql")
	if v, ok := w.ReserveAdapter("chat"); !ok || v != "sql" {
		t.Fatalf("ReserveAdapter(chat) = %q, %t; want victim sql", v, ok)
	}
	w.SetAdapters([]string{"sql"}) // read before sql's unload reached the engine
	w.NoteAdapters([]string{"sql"})
	if w.HoldsAdapter("sql") {
		t.Errorf("a stale report gave evicted sql its slot back: holds %v", w.Adapters())
	}
	if v, ok := w.ReserveAdapter("math"); ok {
		t.Fatalf("ReserveAdapter(math) = %q, true while chat loads into the one slot", v)
	}
	w.EndAdapterLoad("chat", true)()
	w.SetAdapters([]string{"sql"}) // stale again, after chat's load
	if got := w.Adapters(); !slices.Equal(got, []string{"chat"}) {
		t.Errorf("after chat loaded and a stale report: holds %v, want [chat]", got)
	}
	// Reloaded later, sql counts as held again at once.
	w.EndAdapterLoad("sql", true)()
	if !w.HoldsAdapter("sql") {
		t.Errorf("sql, loaded again, not held: %v", w.Adapters())
	}
	// Past the grace, a report of sql is believed.
	w.lora.mu.Lock()
	w.lora.evicted = map[string]time.Time{"code": time.Now().Add(-AdapterGrace)}
	w.lora.mu.Unlock()
	w.SetAdapters([]string{"code"})
	if !w.HoldsAdapter("code") {
		t.Errorf("a report of code, evicted longer than AdapterGrace ago, not believed: %v", w.Adapters())
	}
}

// A worker moved to another pool (its successor) keeps what it knew of
// the engine's adapters: which it holds and when each was loaded, its
// slots and their load time; adapters the scheduler loaded lately stay
// held through the engine's next report, as they would have.
func TestSuccessorKeepsAdapters(t *testing.T) {
	w := &Worker{Name: "w", Addr: "a", Models: []string{"m"}}
	w.SetAdapterSlots(2)
	w.AddAdapter("sql")
	w.SetAdapters([]string{"chat"})
	w.TouchAdapter("chat")
	w.ObserveAdapterLoad(300 * time.Millisecond)
	n := w.Successor()
	if n == w || n.Name != "w" || n.Addr != "a" || !slices.Equal(n.ServedModels(), []string{"m"}) {
		t.Fatalf("successor %+v, want a new worker w at a serving m", n)
	}
	if got := slices.Sorted(slices.Values(n.Adapters())); !slices.Equal(got, []string{"chat", "sql"}) {
		t.Errorf("successor holds %v, want [chat sql]", got)
	}
	if n.AdapterSlots() != 2 || n.AdapterLoadSeconds() != w.AdapterLoadSeconds() || n.AdapterLoadSeconds() == 0 {
		t.Errorf("successor: %d slots, load %v s; want 2 and %v", n.AdapterSlots(), n.AdapterLoadSeconds(), w.AdapterLoadSeconds())
	}
	n.SetAdapters(nil) // sql was loaded by the scheduler within AdapterGrace
	if got := n.Adapters(); !slices.Equal(got, []string{"sql"}) {
		t.Errorf("after the engine reported none: successor holds %v, want [sql]", got)
	}
	if got := w.Adapters(); len(got) != 2 {
		t.Errorf("the successor's changes reached the old worker: it holds %v", got)
	}
}
