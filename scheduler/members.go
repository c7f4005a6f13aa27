package scheduler

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/vllm"
)

// Membership: the workers discovery reports join the pools as static ones
// do at start (pending until they describe themselves, when they must);
// those that leave stop being routed to at once, leave the ring and the KV
// index, and keep their connection until their requests in flight end.

// discover adds the static workers, or starts the discovery source and
// follows it. Static workers are added before it returns, and an error
// adding one is returned; discovered ones join as they are found.
func (s *Scheduler) discover(cfg Config) error {
	s.members = make(map[string]WorkerConfig)
	var err error
	switch cfg.Discovery.Mode {
	case DiscoveryDNS:
		s.source, err = discovery.NewDNS(cfg.Discovery.DNS, s.log)
	case DiscoveryKubernetes:
		s.source, err = discovery.NewKubernetes(cfg.Discovery.Kubernetes, s.log)
	default:
		s.memberMu.Lock()
		defer s.memberMu.Unlock()
		for _, w := range cfg.Workers {
			for _, wc := range w.ranks() {
				if err := s.addWorker(wc); err != nil {
					return err
				}
				s.members[wc.Name] = wc
			}
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("discovery.%s.%w", cfg.Discovery.Mode, err)
	}
	s.log.Info("discovering workers", "mode", cfg.Discovery.Mode)
	s.discovered = promauto.With(s.Metrics.Registry).NewGauge(prometheus.GaugeOpts{
		Name: "baton_discovered_workers",
		Help: "Workers discovery reports (dns and kubernetes discovery).",
	})
	s.memberChanges = promauto.With(s.Metrics.Registry).NewCounterVec(prometheus.CounterOpts{
		Name: "baton_discovery_changes_total",
		Help: "Workers added and removed as discovery reported them.",
	}, []string{"change"})
	s.bg.Go(func() {
		for ms := range s.source.Updates() {
			s.setMembers(ms, cfg.Discovery.Worker)
		}
	})
	return nil
}

// setMembers adds and removes workers so that the discovered ones are ms,
// each configured from tmpl and its labels. A worker whose address, kind
// or role changed is removed and added again.
func (s *Scheduler) setMembers(ms []discovery.Member, tmpl WorkerConfig) {
	want := make(map[string]WorkerConfig, len(ms))
	for _, m := range ms {
		wc, err := memberConfig(m, tmpl)
		if err != nil {
			s.log.Warn("discovered worker skipped", "worker", m.Name, "addr", m.Address, "err", err)
			continue
		}
		// An engine's data-parallel ranks join and leave with it: they
		// share its address, so a change of it replaces them all.
		for _, rc := range wc.ranks() {
			want[rc.Name] = rc
		}
	}
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	removed, added := 0, 0
	for name, old := range s.members {
		if wc, ok := want[name]; !ok || wc.Address != old.Address || wc.Kind != old.Kind || wc.Role != old.Role {
			s.removeWorker(name)
			delete(s.members, name)
			removed++
		}
	}
	for name, wc := range want {
		if _, ok := s.members[name]; ok {
			continue
		}
		if err := s.addWorker(wc); err != nil {
			s.log.Warn("discovered worker not added", "worker", name, "addr", wc.Address, "err", err)
			continue
		}
		s.members[name] = wc
		added++
	}
	if added > 0 || removed > 0 {
		s.log.Info("workers discovered", "added", added, "removed", removed, "workers", len(s.members))
	}
	s.discovered.Set(float64(len(s.members)))
	s.memberChanges.WithLabelValues("added").Add(float64(added))
	s.memberChanges.WithLabelValues("removed").Add(float64(removed))
}

// memberConfig returns the configuration of a discovered worker: tmpl's,
// with the member's name and address, and its kind and role if its labels
// say. {host} in the template's events endpoints is the member's host.
func memberConfig(m discovery.Member, tmpl WorkerConfig) (WorkerConfig, error) {
	wc := tmpl
	wc.Models = slices.Clone(tmpl.Models)
	wc.Name, wc.Address = m.Name, m.Address
	if m.Kind != "" {
		wc.Kind = m.Kind
	}
	if m.Role != "" {
		wc.Role = m.Role
	}
	if wc.Kind == "" {
		wc.Kind = KindGRPC
	}
	k := kindOf(wc.Kind)
	switch {
	case k == nil:
		return wc, fmt.Errorf("%s %q: unknown kind", discovery.LabelKind, wc.Kind)
	case wc.Role != "" && wc.Role != RoleBoth && wc.Role != RolePrefill && wc.Role != RoleDecode:
		return wc, fmt.Errorf("%s %q: unknown role", discovery.LabelRole, wc.Role)
	}
	if wc.DataParallelSize > 1 {
		if err := validateRanks(wc, "discovery.worker"); err != nil {
			return wc, fmt.Errorf("%s %q, role %q: %w", discovery.LabelKind, wc.Kind, wc.Role, err)
		}
	}
	if rest := wc.EngineConfig.beyond(k); rest != (EngineConfig{}) {
		return wc, fmt.Errorf("%s %q: discovery.worker has settings of %s workers only (%s)", discovery.LabelKind, wc.Kind, kindList("and", hasEvents), rest.firstSet())
	}
	host, _, err := net.SplitHostPort(m.Address)
	if err != nil {
		return wc, err
	}
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	if k.URL {
		wc.Address = "http://" + m.Address
		if wc.TLS != (tlsconf.Config{}) {
			wc.Address = "https://" + m.Address
		}
	}
	wc.Events = strings.ReplaceAll(wc.Events, "{host}", host)
	wc.EventsReplay = strings.ReplaceAll(wc.EventsReplay, "{host}", host)
	return wc, nil
}

// addWorker connects to a worker, puts it in its pool (the pending pool
// until it describes itself) and has the watcher follow it.
func (s *Scheduler) addWorker(wc WorkerConfig) error {
	w, desc, err := s.connect(wc)
	if err != nil {
		return err
	}
	s.placeMu.Lock()
	s.roles[wc.Name] = wc.Role
	s.placeMu.Unlock()
	if s.engineTokens != nil && tokenizes(wc) {
		tc, err := s.engineTLS(wc)
		if err == nil {
			err = s.engineTokens.add(wc, vllm.WithTLS(tc))
		}
		if err != nil {
			s.log.Warn("worker's tokenizer unavailable", "worker", wc.Name, "err", err)
		}
	}
	// Placed before it is watched, so that what the watcher hears of it
	// at once (its adapters and slots) finds it.
	if desc == nil {
		// Not known yet: the pending pool's health checks ask again
		// until the worker answers; it serves nothing until then.
		s.log.Warn("worker info unavailable; not routing to it until it answers", "worker", wc.Name, "addr", wc.Address)
		s.place(w, s.pending)
	} else {
		s.apply(w, *desc)
	}
	// Baton workers stream their cache events into the index; the
	// blocks of engines that publish none are learned from routing.
	if kindOfWorker(wc).Scrape != nil {
		// Their load feeds kv_aware and kv_usage alike: always scraped.
		err = s.watchEngine(wc, s.watchWorkers)
	} else if src, ok := w.Client.(watch.Source); ok && s.watchWorkers {
		err = s.watcher.Add(w.Name, src)
	} else if s.watchWorkers {
		err = s.Index.Learn(w.Name, kvindex.Capacity{Prompts: wc.CachePrompts})
		if c, ok := wc.Cost.Figures(); ok && err == nil {
			err = s.Index.SetInfo(w.Name, kvindex.Info{Cost: c, HasCost: true})
		}
	}
	if err != nil {
		s.log.Warn("worker not indexed; kv_aware treats it as holding nothing", "worker", w.Name, "err", err)
	}
	return nil
}

// removeWorker takes a worker out of its pool, the ring and the KV index
// at once; its requests in flight go on, and its connection closes when
// they have ended (or with the scheduler). memberMu is held.
func (s *Scheduler) removeWorker(name string) {
	s.placeMu.Lock()
	p := s.where[name]
	delete(s.where, name)
	delete(s.roles, name)
	var w *pool.Worker
	if p != nil {
		w = p.Remove(name)
	}
	s.placeMu.Unlock()
	s.watcher.Remove(name) // stops following it; its index entries go
	if s.engineTokens != nil {
		s.engineTokens.remove(name)
	}
	s.mu.Lock()
	sc := s.scrapers[name]
	delete(s.scrapers, name)
	s.mu.Unlock()
	if sc != nil {
		sc.Close()
	}
	if w == nil {
		return
	}
	s.log.Info("worker removed; draining", "worker", name, "in_flight", w.InFlight())
	s.bg.Go(func() {
		select {
		case <-w.Drained():
		case <-s.base.Done():
			return // Close closes the client
		}
		s.mu.Lock()
		s.clients = slices.DeleteFunc(s.clients, func(c engine.Client) bool { return c == w.Client })
		s.mu.Unlock()
		w.Client.Close()
		s.log.Info("worker drained", "worker", name)
	})
}

// errNoEngine fails a tokenization while no vllm or sglang worker is
// known; the front end keys the request by its text.
var errNoEngine = errors.New("no vllm or sglang worker discovered yet")

// engineTokens tokenizes requests with the engine of a discovered vllm or
// sglang worker: the first by name of those present, so that requests are
// keyed by one engine's tokenizer, as they are with listed workers (a
// fleet serves one model). Its methods are safe for concurrent use.
type engineTokens struct {
	mu         sync.Mutex
	tokenizers map[string]*vllm.Tokenizer // by worker
}

func newEngineTokens() *engineTokens {
	return &engineTokens{tokenizers: make(map[string]*vllm.Tokenizer)}
}

// add tokenizes with worker wc's engine once it is the first by name.
func (e *engineTokens) add(wc WorkerConfig, opts ...vllm.HTTPOption) error {
	t, err := vllm.NewTokenizer(wc.Address, wc.TokenizePath, opts...)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if old := e.tokenizers[wc.Name]; old != nil {
		old.Close()
	}
	e.tokenizers[wc.Name] = t
	return nil
}

// remove forgets a worker's tokenizer; its calls in flight end on their
// own.
func (e *engineTokens) remove(name string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if t := e.tokenizers[name]; t != nil {
		t.Close()
		delete(e.tokenizers, name)
	}
}

// current returns the first worker by name and its tokenizer, or "" and
// nil.
func (e *engineTokens) current() (string, *vllm.Tokenizer) {
	e.mu.Lock()
	defer e.mu.Unlock()
	first := ""
	for name := range e.tokenizers {
		if first == "" || name < first {
			first = name
		}
	}
	return first, e.tokenizers[first]
}

// Tokenize implements frontend.Tokenizer.
func (e *engineTokens) Tokenize(ctx context.Context, req *engine.Request) ([]uint32, error) {
	_, t := e.current()
	if t == nil {
		return nil, errNoEngine
	}
	return t.Tokenize(ctx, req)
}

// close closes every tokenizer.
func (e *engineTokens) close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for name, t := range e.tokenizers {
		t.Close()
		delete(e.tokenizers, name)
	}
}

// discoveredTokenKeys keys requests by the tokens of the discovered
// engines, of the block size and model of the one that tokenizes.
func (s *Scheduler) discoveredTokenKeys(tmpl WorkerConfig) *frontend.TokenKeys {
	s.log.Info("requests keyed by the tokens of a discovered engine", "kind", tmpl.Kind, "tokenize_path", tmpl.TokenizePath)
	return &frontend.TokenKeys{
		Tokenizer: s.engineTokens,
		Model: func() string {
			name, _ := s.engineTokens.current()
			return s.modelOf(WorkerConfig{Name: name, Models: tmpl.Models})
		},
		BlockSize: func() int {
			name, _ := s.engineTokens.current()
			return s.blockTokens(name)
		},
		Timeout:     tmpl.TokenizeTimeout,
		CacheTokens: tmpl.TokenizeCacheTokens,
	}
}

var _ frontend.Tokenizer = (*engineTokens)(nil)
