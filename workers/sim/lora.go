package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/batonllm/baton/workers/engine"
)

// DefaultMaxLoRAs is how many adapters an engine holds at once by
// default: vLLM's --max-loras default.
const DefaultMaxLoRAs = 1

// DefaultLoRAStepSeconds is the modelled cost each distinct adapter adds
// to a step: a batch mixing adapters runs one gathered low-rank product
// per adapter (Punica's BGMV, S-LoRA's MBGMM), whose launches and reads
// of the adapter weights do not overlap the base model's.
const DefaultLoRAStepSeconds = 0.0005

// LoRA models the LoRA adapters an engine serves, as vLLM does with
// --enable-lora: a request naming an adapter runs on its base model with
// the adapter's weights, which must be in one of MaxLoRAs GPU slots. A
// request for an adapter not in a slot loads it first, from host memory
// over the host link, evicting the least recently used adapter that no
// running request uses.
type LoRA struct {
	// Adapters the engine can load; each Base must be one of Models.
	Adapters []engine.Adapter
	// MaxLoRAs is the number of adapter slots. Default DefaultMaxLoRAs.
	MaxLoRAs int
	// StepSeconds is the modelled seconds each distinct adapter in a step
	// adds to it. Default DefaultLoRAStepSeconds; negative: none.
	StepSeconds float64
}

// WithDefaults returns l with its zero fields set to their defaults.
func (l LoRA) WithDefaults() LoRA {
	if l.MaxLoRAs == 0 {
		l.MaxLoRAs = DefaultMaxLoRAs
	}
	if l.StepSeconds == 0 {
		l.StepSeconds = DefaultLoRAStepSeconds
	}
	return l
}

// validate reports the first invalid field of l (defaults applied) as
// "adapters[1].base: ...", for models, the engine's base models.
func (l LoRA) validate(models []string) error {
	l = l.WithDefaults()
	if l.MaxLoRAs < 1 {
		return fmt.Errorf("max_loras: %d is below 1", l.MaxLoRAs)
	}
	seen := map[string]bool{}
	for i, a := range l.Adapters {
		switch {
		case a.Name == "":
			return fmt.Errorf("adapters[%d].name: required", i)
		case seen[a.Name] || slices.Contains(models, a.Name):
			return fmt.Errorf("adapters[%d].name: %q is already a model or adapter", i, a.Name)
		case !slices.Contains(models, a.Base):
			return fmt.Errorf("adapters[%d].base: %q is not one of the engine's models %v", i, a.Base, models)
		case a.Bytes < 0:
			return fmt.Errorf("adapters[%d].bytes: %d is negative", i, a.Bytes)
		}
		seen[a.Name] = true
	}
	return nil
}

// loraSlots are an engine's adapter slots.
type loraSlots struct {
	known map[string]engine.Adapter
	max   int
	// loadSeconds returns the real time a load of a adapter takes.
	loadSeconds func(a engine.Adapter) (modelled float64, real time.Duration)
	quit        <-chan struct{}

	mu    sync.Mutex
	slots map[string]*loraSlot
	tick  int64
	// freed is closed and replaced each time a slot's last user leaves,
	// waking loads that found every slot in use.
	freed chan struct{}
	stats LoRAStats
}

// LoRAStats count an engine's adapter loads.
type LoRAStats struct {
	// Loads and Evictions count adapters loaded into and evicted from a
	// slot; LoadSeconds is the loads' modelled time.
	Loads, Evictions uint64
	LoadSeconds      float64
}

// loraSlot is an adapter in a slot, or being loaded into it (ready open).
type loraSlot struct {
	ready chan struct{}
	users int   // requests running with it or waiting for its load
	used  int64 // tick of its last use
}

func newLoRASlots(l LoRA, quit <-chan struct{}, load func(engine.Adapter) (float64, time.Duration)) *loraSlots {
	ls := &loraSlots{known: make(map[string]engine.Adapter, len(l.Adapters)), max: l.MaxLoRAs, loadSeconds: load, quit: quit,
		slots: make(map[string]*loraSlot), freed: make(chan struct{})}
	for _, a := range l.Adapters {
		ls.known[a.Name] = a
	}
	return ls
}

// adapter returns the adapter named model, if the engine knows one.
func (ls *loraSlots) adapter(model string) (engine.Adapter, bool) {
	a, ok := ls.known[model]
	return a, ok
}

// errClosedLoad ends a load the engine's Close cut short.
var errClosedLoad = errors.New("engine closed during an adapter load")

// acquire returns once name is in a slot, loading it if need be (one
// load however many requests wait for it), and counts the caller as its
// user until release is called.
func (ls *loraSlots) acquire(ctx context.Context, name string) (release func(), err error) {
	a := ls.known[name]
	for {
		ls.mu.Lock()
		ls.tick++
		if sl, ok := ls.slots[name]; ok {
			sl.users++
			sl.used = ls.tick
			ls.mu.Unlock()
			select {
			case <-sl.ready:
				return ls.releaser(name, sl), nil
			case <-ctx.Done():
				ls.releaser(name, sl)()
				return nil, ctx.Err()
			case <-ls.quit:
				ls.releaser(name, sl)()
				return nil, ErrClosed
			}
		}
		if len(ls.slots) >= ls.max && !ls.evict() {
			freed := ls.freed
			ls.mu.Unlock()
			select {
			case <-freed:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-ls.quit:
				return nil, ErrClosed
			}
		}
		sl := &loraSlot{ready: make(chan struct{}), users: 1, used: ls.tick}
		ls.slots[name] = sl
		modelled, real := ls.loadSeconds(a)
		ls.stats.Loads++
		ls.stats.LoadSeconds += modelled
		ls.mu.Unlock()
		// The load goes on if this request goes away: others may wait
		// for it.
		if !sleepUntil(time.Now().Add(real), nil, ls.quit, nil) {
			return nil, errClosedLoad
		}
		close(sl.ready)
		return ls.releaser(name, sl), nil
	}
}

// evict frees the slot of the least recently used adapter no request
// uses, reporting whether there was one. ls.mu is held.
func (ls *loraSlots) evict() bool {
	victim, oldest := "", int64(0)
	for n, sl := range ls.slots {
		if sl.users == 0 && (victim == "" || sl.used < oldest) {
			victim, oldest = n, sl.used
		}
	}
	if victim == "" {
		return false
	}
	delete(ls.slots, victim)
	ls.stats.Evictions++
	return true
}

func (ls *loraSlots) releaser(name string, sl *loraSlot) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			ls.mu.Lock()
			defer ls.mu.Unlock()
			sl.users--
			ls.tick++
			sl.used = ls.tick
			if sl.users == 0 {
				close(ls.freed)
				ls.freed = make(chan struct{})
			}
		})
	}
}

// held returns the adapters loaded in a slot, sorted.
func (ls *loraSlots) held() []string {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var names []string
	for n, sl := range ls.slots {
		select {
		case <-sl.ready:
			names = append(names, n)
		default:
		}
	}
	slices.Sort(names)
	return names
}

// Adapters returns the LoRA adapters the engine holds in its slots now.
func (e *Engine) Adapters() []string { return e.lora.held() }

// reportedAdapters returns the adapters the engine holds, as its Info and
// load reports tell them: nil when it serves no adapter, so that "holds
// none" differs from "does not say".
func (e *Engine) reportedAdapters() []string {
	if len(e.cfg.LoRA.Adapters) == 0 {
		return nil
	}
	if h := e.lora.held(); h != nil {
		return h
	}
	return []string{}
}

// LoRAStats returns the engine's adapter load counters.
func (e *Engine) LoRAStats() LoRAStats {
	e.lora.mu.Lock()
	defer e.lora.mu.Unlock()
	return e.lora.stats
}

// loraLoadTime is the time a load of a takes: its bytes over the host
// link (the PCIe bandwidth of the CPU tier), modelled and real.
func (e *Engine) loraLoadTime(a engine.Adapter) (float64, time.Duration) {
	s := float64(a.Bytes) / e.cfg.Tiers.pcieBandwidth(e.cost)
	return s, time.Duration(s / e.cfg.TimeScale * float64(time.Second))
}

// loraStream releases its sequence's adapter slot when it ends.
type loraStream struct {
	engine.Stream
	release func()
}

func (s loraStream) Recv() (engine.Event, error) {
	ev, err := s.Stream.Recv()
	if err != nil {
		s.release()
	}
	return ev, err
}

func (s loraStream) Close() error {
	s.release()
	return s.Stream.Close()
}

// loraStepSeconds is the modelled time the distinct adapters of the
// step's batch add to it. Step loop only.
func (e *Engine) loraStepSeconds() float64 {
	if e.cfg.LoRA.StepSeconds <= 0 || len(e.cfg.LoRA.Adapters) == 0 {
		return 0
	}
	seen := e.loraSeen[:0]
	for _, s := range e.batch.Run {
		if s.adapter != "" && (s.Chunk > 0 || s.Decode) && !slices.Contains(seen, s.adapter) {
			seen = append(seen, s.adapter)
		}
	}
	e.loraSeen = seen
	return float64(len(seen)) * e.cfg.LoRA.StepSeconds
}

var (
	loraLoadsDesc = prometheus.NewDesc("baton_worker_adapter_loads_total",
		"LoRA adapters loaded into a slot.", nil, nil)
	loraEvictionsDesc = prometheus.NewDesc("baton_worker_adapter_evictions_total",
		"LoRA adapters evicted from a slot to load another.", nil, nil)
	loraSecondsDesc = prometheus.NewDesc("baton_worker_adapter_load_modelled_seconds_total",
		"Modelled time of the LoRA adapter loads (their size over the host link).", nil, nil)
	loraHeldDesc = prometheus.NewDesc("baton_worker_adapters_held",
		"LoRA adapters loaded in a slot now.", nil, nil)
)

// loraCollector reads an engine's adapter slots at each scrape.
type loraCollector struct{ e *Engine }

func (c loraCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{loraLoadsDesc, loraEvictionsDesc, loraSecondsDesc, loraHeldDesc} {
		ch <- d
	}
}

func (c loraCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.LoRAStats()
	ch <- prometheus.MustNewConstMetric(loraLoadsDesc, prometheus.CounterValue, float64(s.Loads))
	ch <- prometheus.MustNewConstMetric(loraEvictionsDesc, prometheus.CounterValue, float64(s.Evictions))
	ch <- prometheus.MustNewConstMetric(loraSecondsDesc, prometheus.CounterValue, s.LoadSeconds)
	ch <- prometheus.MustNewConstMetric(loraHeldDesc, prometheus.GaugeValue, float64(len(c.e.Adapters())))
}

var _ prometheus.Collector = loraCollector{}
