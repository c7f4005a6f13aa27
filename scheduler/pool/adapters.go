package pool

import (
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// AdapterGrace is how long an adapter the scheduler loaded onto a worker
// (AddAdapter) counts as held even when the engine's description omits
// it: engines that load on a request's arrival list it only once that
// request reached them.
const AdapterGrace = 10 * time.Second

// adapters is what a worker holds of LoRA adapters: the set the routing
// filter reads without locks, and when each was loaded and last used,
// for the least-recently-used choice of what to evict.
type adapters struct {
	held atomic.Pointer[[]string]
	mu   sync.Mutex
	used map[string]int64 // adapter → last use, Unix nanoseconds
	// running counts the requests in flight on the worker by adapter:
	// an adapter in use is never the one evicted.
	running map[string]int
	// loaded are the adapters the scheduler loaded, by when.
	loaded map[string]time.Time
	// evicted are the adapters the scheduler evicted to make room
	// (ReserveAdapter's victims), by when: until the unload reaches the
	// engine, and a report read after it arrives, the engine's reports
	// still list them, and must not give their slot back to them.
	evicted map[string]time.Time
	// loading are the adapters being loaded onto the worker
	// (ReserveAdapter), each in a slot of its own; nLoading counts them
	// for readers without the lock.
	loading  map[string]bool
	nLoading atomic.Int32
	// slots is the adapter slots the engine reports (SetAdapterSlots).
	slots atomic.Int32
	// loadSeconds is the measured load time (ObserveAdapterLoad), as
	// float64 bits; 0: none measured.
	loadSeconds atomic.Uint64
}

// copyTo gives b, a new worker's, what a knows: the adapters held, when
// each was loaded and last used, the slots and the load time. Requests in
// flight and loads under way stay with a's worker, which ends them.
func (a *adapters) copyTo(b *adapters) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if h := a.held.Load(); h != nil {
		held := slices.Clone(*h)
		b.held.Store(&held)
	}
	b.loaded = maps.Clone(a.loaded)
	b.evicted = maps.Clone(a.evicted)
	b.used = maps.Clone(a.used)
	b.slots.Store(a.slots.Load())
	b.loadSeconds.Store(a.loadSeconds.Load())
}

// HoldsAdapter reports whether the worker holds the LoRA adapter name. It
// reads an atomic and does not allocate.
func (w *Worker) HoldsAdapter(name string) bool {
	if h := w.lora.held.Load(); h != nil {
		return slices.Contains(*h, name)
	}
	return false
}

// Adapters returns the LoRA adapters the worker holds. The slice must not
// be modified.
func (w *Worker) Adapters() []string {
	if h := w.lora.held.Load(); h != nil {
		return *h
	}
	return nil
}

// AdapterSlotFree reports whether the scheduler may load one more adapter
// onto the worker without evicting one: it holds, and is loading, fewer
// than AdapterSlots.
func (w *Worker) AdapterSlotFree() bool {
	return len(w.Adapters())+int(w.lora.nLoading.Load()) < w.AdapterSlots()
}

// AdapterSlots returns how many adapters the scheduler may have the
// worker hold: MaxLoRAs when configured, else the slots its engine
// reports (SetAdapterSlots); 0: the scheduler loads none onto it.
func (w *Worker) AdapterSlots() int {
	if w.MaxLoRAs > 0 {
		return w.MaxLoRAs
	}
	return int(w.lora.slots.Load())
}

// SetAdapterSlots records the adapter slots the worker's engine reports
// (a baton worker's Info, vLLM's max_lora); 0: it does not say.
func (w *Worker) SetAdapterSlots(n int) {
	w.lora.slots.Store(int32(min(max(n, 0), 1<<20)))
}

// AddAdapter records that the worker holds name, loaded now.
func (w *Worker) AddAdapter(name string) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	a.add(name)
}

// add records that the worker holds name, loaded now. a.mu is held.
func (a *adapters) add(name string) {
	if a.loaded == nil {
		a.loaded = make(map[string]time.Time)
	}
	a.loaded[name] = time.Now()
	delete(a.evicted, name)
	a.touch(name)
	var held []string
	if h := a.held.Load(); h != nil {
		held = slices.Clone(*h)
	}
	if !slices.Contains(held, name) {
		held = append(held, name)
	}
	a.held.Store(&held)
}

// RemoveAdapter records that the worker no longer holds name.
func (w *Worker) RemoveAdapter(name string) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	a.remove(name)
}

// remove records that the worker no longer holds name. a.mu is held.
func (a *adapters) remove(name string) {
	delete(a.loaded, name)
	delete(a.used, name)
	var held []string
	if h := a.held.Load(); h != nil {
		held = slices.DeleteFunc(slices.Clone(*h), func(s string) bool { return s == name })
	}
	a.held.Store(&held)
}

// SetAdapters replaces the adapters the worker holds with those its engine
// reports, keeping any the scheduler loaded in the last AdapterGrace and
// leaving out any it evicted in that time (ReserveAdapter): a report may
// have been read before a load or an unload reached the engine.
func (w *Worker) SetAdapters(names []string) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	a.expireEvicted(now)
	held := slices.DeleteFunc(slices.Clone(names), func(n string) bool { _, ok := a.evicted[n]; return ok })
	for n, t := range a.loaded {
		switch {
		case slices.Contains(held, n):
		case now.Sub(t) < AdapterGrace:
			held = append(held, n)
		default:
			delete(a.loaded, n)
		}
	}
	for n := range a.used {
		if !slices.Contains(held, n) {
			delete(a.used, n)
		}
	}
	slices.Sort(held)
	a.held.Store(&held)
}

// NoteAdapters records that the worker holds names too, as an engine
// tells of the adapters its requests use (vLLM's lora_requests_info),
// without dropping the others it holds, nor taking back those the
// scheduler evicted in the last AdapterGrace.
func (w *Worker) NoteAdapters(names []string) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	a.expireEvicted(time.Now())
	var held []string
	for _, n := range names {
		_, gone := a.evicted[n]
		if !gone && !w.HoldsAdapter(n) && !slices.Contains(held, n) {
			held = append(held, n)
		}
	}
	if len(held) > 0 {
		held = append(held, w.Adapters()...)
		slices.Sort(held)
		a.held.Store(&held)
	}
}

// expireEvicted forgets evictions older than AdapterGrace: by then the
// engine's reports say what it holds. a.mu is held.
func (a *adapters) expireEvicted(now time.Time) {
	for n, t := range a.evicted {
		if now.Sub(t) >= AdapterGrace {
			delete(a.evicted, n)
		}
	}
}

// TouchAdapter records a use of name on the worker, for LRUAdapter.
func (w *Worker) TouchAdapter(name string) {
	w.lora.mu.Lock()
	w.lora.touch(name)
	w.lora.mu.Unlock()
}

// touch records a use of name. a.mu is held.
func (a *adapters) touch(name string) {
	if a.used == nil {
		a.used = make(map[string]int64)
	}
	a.used[name] = time.Now().UnixNano()
}

// BeginAdapter records a request for the adapter name in flight on the
// worker until the returned function is called (once): an adapter in use
// is never evicted (LRUAdapter, ReserveAdapter).
func (w *Worker) BeginAdapter(name string) (end func()) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.begin(name)
}

// PinAdapter is BeginAdapter if the worker holds name, checked and
// counted at once: no load evicts name between the check and the count.
// ok is false, and nothing counted, when it does not hold name (evicted
// since the pick that chose the worker for it).
func (w *Worker) PinAdapter(name string) (end func(), ok bool) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	if !w.HoldsAdapter(name) {
		return nil, false
	}
	return a.begin(name), true
}

// begin counts a use of name in flight until end is called. a.mu is held.
func (a *adapters) begin(name string) (end func()) {
	if a.running == nil {
		a.running = make(map[string]int)
	}
	a.running[name]++
	var once sync.Once
	return func() {
		once.Do(func() {
			a.mu.Lock()
			if a.running[name]--; a.running[name] <= 0 {
				delete(a.running, name)
			}
			a.mu.Unlock()
		})
	}
}

// ReserveAdapter takes a slot of the worker for a load of name, which
// must end with EndAdapterLoad: a free slot, else that of the least
// recently used adapter with no request in flight, which the worker stops
// holding at once and which is returned as victim, for the caller to
// unload. Checking and taking are one step, so two loads never take one
// slot. ok is false when no slot can be had, or the worker holds name or
// is loading it.
func (w *Worker) ReserveAdapter(name string) (victim string, ok bool) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	if w.HoldsAdapter(name) || a.loading[name] {
		return "", false
	}
	if !w.AdapterSlotFree() {
		if victim, ok = a.lru(w.Adapters(), name); !ok {
			return "", false
		}
		a.remove(victim)
		if a.evicted == nil {
			a.evicted = make(map[string]time.Time)
		}
		a.evicted[victim] = time.Now()
	}
	if a.loading == nil {
		a.loading = make(map[string]bool)
	}
	a.loading[name] = true
	a.nLoading.Add(1)
	return victim, true
}

// EndAdapterLoad ends the load of name that ReserveAdapter began. When it
// loaded, the worker holds name, pinned as by PinAdapter until unpin is
// called: the requests that waited for the load are routed to it before
// any other load may evict it. When it did not, its slot is free again
// and unpin does nothing.
func (w *Worker) EndAdapterLoad(name string, loaded bool) (unpin func()) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.loading[name] {
		delete(a.loading, name)
		a.nLoading.Add(-1)
	}
	if !loaded {
		return func() {}
	}
	a.add(name)
	return a.begin(name)
}

// CanTakeAdapter reports whether one more adapter fits on the worker: a
// slot is free, or some adapter other than keep has no request in flight
// and may be evicted.
func (w *Worker) CanTakeAdapter(keep string) bool {
	if w.AdapterSlotFree() {
		return true
	}
	_, ok := w.LRUAdapter(keep)
	return ok
}

// LRUAdapter returns the adapter the worker used least lately, other than
// keep and those with requests in flight (BeginAdapter); an adapter never
// used counts as oldest. ok is false when there is none such.
func (w *Worker) LRUAdapter(keep string) (name string, ok bool) {
	a := &w.lora
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.lru(w.Adapters(), keep)
}

// lru is LRUAdapter among held. a.mu is held.
func (a *adapters) lru(held []string, keep string) (name string, ok bool) {
	var oldest int64
	for _, n := range held {
		if n == keep || a.running[n] > 0 {
			continue
		}
		if t := a.used[n]; !ok || t < oldest {
			name, oldest, ok = n, t, true
		}
	}
	return name, ok
}

// ObserveAdapterLoad records that an adapter load onto the worker took d:
// AdapterLoadSeconds is a moving average that halves the weight of the
// earlier loads at each.
func (w *Worker) ObserveAdapterLoad(d time.Duration) {
	s := d.Seconds()
	for {
		old := w.lora.loadSeconds.Load()
		v := s
		if prev := math.Float64frombits(old); prev > 0 {
			v = (prev + s) / 2
		}
		if w.lora.loadSeconds.CompareAndSwap(old, math.Float64bits(v)) {
			return
		}
	}
}

// AdapterLoadSeconds returns the worker's measured adapter load time
// (ObserveAdapterLoad), 0 when none was measured.
func (w *Worker) AdapterLoadSeconds() float64 {
	return math.Float64frombits(w.lora.loadSeconds.Load())
}
