package scheduler_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// Adapter loads that race for one worker's slots: the 503s of
// bench/RESULTS-archive.md §11 ("no worker is available for model
// lora-21"), reproduced step by step.

// gatedStrategy is least_outstanding whose first pick for adapter that
// finds it held by some worker waits, once, until release is closed: the
// pick that follows the adapter's load, held between the load and the
// routing of the request that waited for it.
type gatedStrategy struct {
	routing.Strategy
	adapter          string
	reached, release chan struct{}
	once             sync.Once
}

func (g *gatedStrategy) Pick(req *routing.Request, snap *pool.Snapshot) (routing.Decision, error) {
	if req.Adapter == g.adapter && slices.ContainsFunc(snap.Workers, func(w *pool.Worker) bool { return w.HoldsAdapter(g.adapter) }) {
		g.once.Do(func() {
			close(g.reached)
			<-g.release
		})
	}
	return g.Strategy.Pick(req, snap)
}

// An adapter just loaded for the requests waiting for it is not evicted by
// a load of another adapter before they are routed: with the only slot's
// adapter (chat) loaded and its request not yet routed, a request for math
// waits for the slot, rather than evicting chat and leaving chat's request
// with no holder, a 503 "no worker is available for model chat".
func TestAdapterFreshLoadNotEvicted(t *testing.T) {
	_, cfgs := startLoRAWorkers(t, 1, 1)
	g := &gatedStrategy{adapter: "chat", reached: make(chan struct{}), release: make(chan struct{})}
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	reg.Register("gated", func(p routing.Params, d routing.Deps) (routing.Strategy, error) {
		var err error
		g.Strategy, err = routing.NewLeastOutstanding(p, d)
		return g, err
	})
	f := startFleetSpec(t, simfleet.Spec{Registry: reg, Scheduler: scheduler.Config{
		Strategy: "gated", Pool: loraPool(), Workers: cfgs, Adapters: loraAdapters}})
	waitDescribed(t, f.Scheduler)
	addr := f.Addr
	released := false
	defer func() {
		if !released {
			close(g.release)
		}
	}()
	c := oaClient(t, addr)
	hc := httpClient(t)
	w := f.Scheduler.Pool.Snapshot().Worker(cfgs[0].Name)

	chatDone := sendAdapter(c, ctxT(t, time.Minute), "chat")
	select {
	case <-g.reached:
	case p := <-chatDone:
		t.Fatalf("chat answered before its pick after the load: %v", p.err)
	case <-time.After(20 * time.Second):
		t.Fatal("chat's pick after its load never came")
	}
	// chat is loaded, its request not routed yet: math asks for the slot.
	mathDone := sendAdapter(c, ctxT(t, time.Minute), "math")
	eventually(t, 20*time.Second, func() error {
		if !w.HoldsAdapter("chat") {
			return nil // evicted under chat's request
		}
		if v, _ := metric(scrape(t, hc, addr), "baton_queue_depth"); v != 1 {
			return fmt.Errorf("queue depth %v, want math's request waiting for chat's slot", v)
		}
		return nil
	})
	close(g.release)
	released = true
	p := <-chatDone
	if p.err != nil {
		t.Fatalf("chat, loaded for it: %v", p.err)
	}
	if route := p.resp.Header.Get("X-Baton-Route"); !strings.HasSuffix(route, "adapter=loaded") {
		t.Errorf("chat's route %q, want adapter=loaded", route)
	}
	if p := <-mathDone; p.err != nil {
		t.Fatalf("math, once chat's request ended: %v", p.err)
	}
}

// loadGate sits in front of a vLLM engine and holds its adapter loads and
// unloads until opened, counting the adapters the engine holds.
type loadGate struct {
	t      *testing.T
	srv    *httptest.Server
	mu     sync.Mutex
	open   bool
	opened chan struct{}
	calls  []string // "load chat", "unload sql", in arrival order
	held   int      // adapters the engine holds
	most   int      // held at most
}

func newLoadGate(t *testing.T, engineURL string) *loadGate {
	u, err := url.Parse(engineURL)
	if err != nil {
		t.Fatal(err)
	}
	g := &loadGate{t: t, open: true, opened: make(chan struct{})}
	rp := httputil.NewSingleHostReverseProxy(u)
	g.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var op string
		switch r.URL.Path {
		case httpengine.LoadAdapterPath:
			op = "load"
		case httpengine.UnloadAdapterPath:
			op = "unload"
		default:
			rp.ServeHTTP(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		name := "?"
		if i := strings.Index(string(body), `"lora_name":"`); i >= 0 {
			name = string(body[i+len(`"lora_name":"`):])
			name = name[:strings.IndexByte(name, '"')]
		}
		g.mu.Lock()
		g.calls = append(g.calls, op+" "+name)
		opened := g.opened
		wait := !g.open
		g.mu.Unlock()
		if wait {
			<-opened
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		r.ContentLength = int64(len(body))
		rec := httptest.NewRecorder()
		rp.ServeHTTP(rec, r)
		g.mu.Lock()
		if rec.Code == http.StatusOK {
			if op == "load" {
				g.held++
			} else {
				g.held--
			}
			g.most = max(g.most, g.held)
		}
		g.mu.Unlock()
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(rec.Body.Bytes())
	}))
	t.Cleanup(func() {
		g.release()
		g.srv.Close()
	})
	return g
}

// hold makes loads and unloads wait; release lets them through.
func (g *loadGate) hold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open {
		g.open, g.opened = false, make(chan struct{})
	}
}

func (g *loadGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.open {
		g.open = true
		close(g.opened)
	}
}

func (g *loadGate) snapshot() (calls []string, most int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.calls), g.most
}

// Two loads of different adapters onto one worker at once never take its
// slots twice: with a vLLM engine of one slot, while chat loads (into the
// free slot, or after unloading the idle sql), a request for math waits
// for the slot rather than loading math beside chat, or unloading sql a
// second time; both are then served, and the engine never holds more
// adapters than its slots.
func TestAdapterConcurrentLoadsShareNoSlot(t *testing.T) {
	for _, tc := range []struct {
		name string
		idle string // an adapter in the slot, idle, before the race
	}{
		{"free slot", ""},
		{"idle adapter", "sql"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := vllmtest.New(vllmtest.Config{Model: model, TimeScale: 1000, NoEvents: true, MaxLoRAs: 1, RuntimeLoRA: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(e.Close)
			g := newLoadGate(t, e.URL)
			s, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Pool: loraPool(), Adapters: loraAdapters,
				Workers: []scheduler.WorkerConfig{{Name: "v0", Kind: scheduler.KindVLLM, Address: g.srv.URL, Models: []string{model},
					MaxLoRAs: 1, EngineConfig: scheduler.EngineConfig{MetricsInterval: 20 * time.Millisecond}}}})
			c := oaClient(t, addr)
			hc := httpClient(t)
			if tc.idle != "" {
				chat(t, c, adapterChat(tc.idle, text("before", 200)))
			}
			g.hold()
			before, _ := g.snapshot()
			chatDone := sendAdapter(c, ctxT(t, time.Minute), "chat")
			eventually(t, 20*time.Second, func() error {
				if calls, _ := g.snapshot(); len(calls) == len(before) {
					return fmt.Errorf("calls %v: chat's load not started", calls)
				}
				return nil
			})
			before, _ = g.snapshot()
			mathDone := sendAdapter(c, ctxT(t, time.Minute), "math")
			eventually(t, 20*time.Second, func() error {
				if calls, _ := g.snapshot(); len(calls) > len(before) {
					return nil // math's load or unload went out beside chat's
				}
				if v, _ := metric(scrape(t, hc, addr), "baton_queue_depth"); v != 1 {
					return fmt.Errorf("queue depth %v, want math's request waiting for the slot", v)
				}
				return nil
			})
			g.release()
			for _, d := range []struct {
				adapter string
				done    <-chan pending
			}{{"chat", chatDone}, {"math", mathDone}} {
				if p := <-d.done; p.err != nil {
					t.Errorf("%s: %v", d.adapter, p.err)
				}
			}
			calls, most := g.snapshot()
			if most > 1 {
				t.Errorf("the engine held %d adapters in its one slot; calls %v", most, calls)
			}
			if got := e.Adapters(); len(got) > 1 {
				t.Errorf("the engine holds %v in its one slot; calls %v", got, calls)
			}
			// A report of the engine's read before an unload may come
			// after it; the next one says what it holds.
			eventually(t, 10*time.Second, func() error {
				if w := s.Pool.Snapshot().Worker("v0"); len(w.Adapters()) > 1 {
					return fmt.Errorf("the scheduler sees v0 holding %v in its one slot", w.Adapters())
				}
				return nil
			})
		})
	}
}
