package routing

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeClient is an engine.Client whose Check returns a settable error.
type fakeClient struct {
	mu       sync.Mutex
	checkErr error
}

func (c *fakeClient) Check(context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.checkErr
}

func (c *fakeClient) Generate(context.Context, *engine.Request) (engine.Stream, error) {
	return nil, io.EOF
}

func (c *fakeClient) Close() error { return nil }

// fleet is a pool whose health changes only when the test says so, whose
// breakers open at the first failure, and whose workers are w00, w01, ….
type fleet struct {
	t    testing.TB
	pool *pool.Pool
}

func newFleet(t testing.TB, n int) *fleet {
	t.Helper()
	p, err := pool.New(pool.Config{HealthInterval: time.Hour, UnhealthyAfter: 1, BreakerFailures: 1, BreakerOpenTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	for i := range n {
		if err := p.Add(&pool.Worker{Name: fmt.Sprintf("w%02d", i), Client: &fakeClient{}}); err != nil {
			t.Fatal(err)
		}
	}
	return &fleet{t, p}
}

func (f *fleet) snap() *pool.Snapshot { return f.pool.Snapshot() }

func (f *fleet) worker(name string) *pool.Worker {
	f.t.Helper()
	w := f.snap().Worker(name)
	if w == nil {
		f.t.Fatalf("no worker %s", name)
	}
	return w
}

// add adds a worker serving only models.
func (f *fleet) add(name string, models ...string) {
	f.t.Helper()
	if err := f.pool.Add(&pool.Worker{Name: name, Models: models, Client: &fakeClient{}}); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fleet) setHealthy(name string, healthy bool) {
	f.t.Helper()
	var err error
	if !healthy {
		err = errors.New("down")
	}
	c := f.worker(name).Client.(*fakeClient)
	c.mu.Lock()
	c.checkErr = err
	c.mu.Unlock()
	f.pool.CheckNow(context.Background())
	if got := f.worker(name).Healthy(); got != healthy {
		f.t.Fatalf("%s healthy = %t, want %t", name, got, healthy)
	}
}

func (f *fleet) openBreaker(name string) {
	f.t.Helper()
	done, err := f.worker(name).Acquire()
	if err != nil {
		f.t.Fatal(err)
	}
	done(errors.New("boom"))
	if f.worker(name).Available() {
		f.t.Fatalf("%s available after its breaker opened", name)
	}
}

// load acquires n calls on the worker, released when the test ends.
func (f *fleet) load(name string, n int) {
	f.t.Helper()
	for range n {
		done, err := f.worker(name).Acquire()
		if err != nil {
			f.t.Fatal(err)
		}
		f.t.Cleanup(func() { done(nil) })
	}
}

func builtins(t testing.TB, params Params, deps Deps) []Strategy {
	t.Helper()
	var r Registry
	RegisterBuiltins(&r)
	if deps.Index == nil {
		deps.Index = kvindex.New(kvindex.Config{})
	}
	var out []Strategy
	for _, name := range r.Names() {
		s, err := r.New(name, params, deps)
		if err != nil {
			t.Fatalf("New(%s): %v", name, err)
		}
		out = append(out, s)
	}
	return out
}

func pick(t *testing.T, s Strategy, req *Request, snap *pool.Snapshot) Decision {
	t.Helper()
	d, err := s.Pick(req, snap)
	if err != nil {
		t.Fatalf("%s: Pick: %v", s.Name(), err)
	}
	return d
}

func TestOnlyAvailableWorkers(t *testing.T) {
	f := newFleet(t, 0)
	for _, name := range []string{"healthy1", "unhealthy", "breaker-open", "healthy2"} {
		f.add(name)
	}
	f.add("other-model", "qwen")
	f.add("same-model", "llama", "qwen")
	f.setHealthy("unhealthy", false)
	f.openBreaker("breaker-open")
	want := map[string]bool{"healthy1": true, "healthy2": true, "same-model": true}

	rng := rand.New(rand.NewPCG(1, 1))
	for _, s := range builtins(t, Params{}, Deps{Rand: SeededRand(1)}) {
		t.Run(s.Name(), func(t *testing.T) {
			got := map[string]bool{}
			for range 300 {
				d := pick(t, s, &Request{Model: "llama", PrefixKey: rng.Uint64()}, f.snap())
				if !want[d.Worker.Name] {
					t.Fatalf("picked %s, want one of %v", d.Worker.Name, want)
				}
				got[d.Worker.Name] = true
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("workers picked over 300 requests (-want +got):\n%s", diff)
			}
		})
	}
}

func TestNoWorker(t *testing.T) {
	empty := newFleet(t, 0)
	none := newFleet(t, 0)
	none.add("unhealthy")
	none.add("breaker-open")
	none.add("other-model", "qwen")
	none.setHealthy("unhealthy", false)
	none.openBreaker("breaker-open")

	for _, s := range builtins(t, Params{}, Deps{}) {
		for _, tt := range []struct {
			name string
			f    *fleet
		}{{"empty", empty}, {"none available", none}} {
			t.Run(s.Name()+"/"+tt.name, func(t *testing.T) {
				d, err := s.Pick(&Request{Model: "llama", PrefixKey: 42}, tt.f.snap())
				if !errors.Is(err, ErrNoWorker) {
					t.Errorf("Pick = %v, %v; want ErrNoWorker", d.Worker, err)
				}
			})
		}
	}
}

func TestRoundRobinCycles(t *testing.T) {
	f := newFleet(t, 4)
	s, err := NewRoundRobin(Params{}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for range 8 {
		got = append(got, pick(t, s, &Request{}, f.snap()).Worker.Name)
	}
	want := []string{"w00", "w01", "w02", "w03", "w00", "w01", "w02", "w03"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("round robin over 4 workers (-want +got):\n%s", diff)
	}

	f.setHealthy("w01", false)
	got = got[:0]
	for range 6 {
		got = append(got, pick(t, s, &Request{}, f.snap()).Worker.Name)
	}
	if got := strings.Join(got, " "); !strings.Contains(strings.Repeat("w00 w02 w03 ", 3), got) {
		t.Errorf("round robin without w01 = %q, want a run of w00 w02 w03 in turn", got)
	}
}

func TestLeastOutstanding(t *testing.T) {
	tests := []struct {
		name string
		load []int // in flight on w00, w01, …
		want []string
	}{
		{"single minimum", []int{3, 1, 2}, []string{"w01"}},
		{"minimum at the end", []int{3, 2, 0}, []string{"w02"}},
		{"ties", []int{0, 5, 0, 1}, []string{"w00", "w02"}},
		{"all equal", []int{2, 2, 2}, []string{"w00", "w01", "w02"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFleet(t, len(tt.load))
			for i, n := range tt.load {
				f.load(fmt.Sprintf("w%02d", i), n)
			}
			s, err := NewLeastOutstanding(Params{}, Deps{Rand: SeededRand(3)})
			if err != nil {
				t.Fatal(err)
			}
			seen := map[string]bool{}
			for range 200 {
				seen[pick(t, s, &Request{}, f.snap()).Worker.Name] = true
			}
			var got []string
			for _, w := range f.snap().Workers {
				if seen[w.Name] {
					got = append(got, w.Name)
				}
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("workers picked (-want +got):\n%s", diff)
			}
		})
	}
}

func prefixKey(model, tenant, text string) uint64 {
	return blockkey.Prefix(blockkey.Seed(model, tenant), text, 4096)
}

func newPrefixAware(t *testing.T, threshold int) Strategy {
	t.Helper()
	s, err := NewPrefixAware(Params{ConcurrencyThreshold: threshold}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestPrefixAwareSticky(t *testing.T) {
	f := newFleet(t, 8)
	s := newPrefixAware(t, 0)
	req := &Request{Model: "llama", Tenant: "acme", PrefixKey: prefixKey("llama", "acme", "You are a helpful assistant.")}
	first := pick(t, s, req, f.snap())
	if first.Spill || first.Reason != ReasonHome {
		t.Errorf("first pick = spill %t, reason %v; want no spill, reason %v", first.Spill, first.Reason, ReasonHome)
	}
	for i := range 100 {
		if got := pick(t, s, req, f.snap()).Worker; got != first.Worker {
			t.Fatalf("pick %d went to %s, want %s as every other pick of the same key", i, got.Name, first.Worker.Name)
		}
	}
}

func TestPrefixAwareSpreadsTenants(t *testing.T) {
	const workers, tenants = 8, 2000
	f := newFleet(t, workers)
	s := newPrefixAware(t, 0)
	count := map[string]int{}
	for i := range tenants {
		tenant := fmt.Sprintf("tenant-%d", i)
		req := &Request{Model: "llama", Tenant: tenant, PrefixKey: prefixKey("llama", tenant, "You are a helpful assistant.")}
		count[pick(t, s, req, f.snap()).Worker.Name]++
	}
	mean := tenants / workers
	for _, w := range f.snap().Workers {
		if got := count[w.Name]; got < mean/2 || got > mean*3/2 {
			t.Errorf("%s is home to %d of %d tenants, want %d±50%%", w.Name, got, tenants, mean)
		}
	}
	t.Logf("tenants per worker: %v", count)
}

func TestPrefixAwareSpill(t *testing.T) {
	const threshold = 2
	tests := []struct {
		name      string
		load      map[string]int // by role: "home" or a worker's offset after the home in name order
		wantWhom  string         // "home", or the offset after home
		wantSpill bool
		wantWhy   Reason
	}{
		{"home under threshold", map[string]int{"home": 1}, "home", false, ReasonHome},
		{"home at threshold", map[string]int{"home": 2}, "+1", true, ReasonSpill},
		{"spill to least loaded", map[string]int{"home": 2, "+1": 1, "+2": 1}, "+3", true, ReasonSpill},
		{"all full, home least", map[string]int{"home": 2, "+1": 3, "+2": 3, "+3": 3}, "home", false, ReasonAllFull},
		{"all full, other least", map[string]int{"home": 4, "+1": 3, "+2": 2, "+3": 3}, "+2", true, ReasonAllFull},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFleet(t, 4)
			s := newPrefixAware(t, threshold)
			req := &Request{Model: "llama", PrefixKey: prefixKey("llama", "", "spill me")}
			home := pick(t, s, req, f.snap()).Worker
			ws := f.snap().Workers
			hi := 0
			for i, w := range ws {
				if w == home {
					hi = i
				}
			}
			role := func(r string) *pool.Worker {
				if r == "home" {
					return home
				}
				var off int
				fmt.Sscanf(r, "+%d", &off)
				return ws[(hi+off)%len(ws)]
			}
			for r, n := range tt.load {
				f.load(role(r).Name, n)
			}
			got := pick(t, s, req, f.snap())
			if want := role(tt.wantWhom); got.Worker != want {
				t.Errorf("picked %s, want %s (%s)", got.Worker.Name, want.Name, tt.wantWhom)
			}
			if got.Spill != tt.wantSpill || got.Reason != tt.wantWhy {
				t.Errorf("spill %t, reason %v; want spill %t, reason %v", got.Spill, got.Reason, tt.wantSpill, tt.wantWhy)
			}
		})
	}
}

// TestPrefixAwareFailover checks that when a home becomes unavailable its
// keys move to their ring successors, and no other key moves.
func TestPrefixAwareFailover(t *testing.T) {
	f := newFleet(t, 6)
	s := newPrefixAware(t, 0)
	snap := f.snap()
	rng := rand.New(rand.NewPCG(5, 5))
	keys := make([]uint64, 5000)
	homes := make([]string, len(keys))
	successors := make([]string, len(keys))
	for i := range keys {
		keys[i] = rng.Uint64()
		homes[i] = pick(t, s, &Request{PrefixKey: keys[i]}, snap).Worker.Name
		var walk []int
		snap.Ring.Walk(keys[i], func(m int) bool { walk = append(walk, m); return len(walk) < 2 })
		successors[i] = snap.Workers[walk[1]].Name
	}
	const down = "w03"
	for _, mark := range []func(){
		func() { f.setHealthy(down, false) },
		func() { f.setHealthy(down, true); f.openBreaker(down) },
	} {
		mark()
		moved := 0
		for i, k := range keys {
			got := pick(t, s, &Request{PrefixKey: k}, snap).Worker.Name
			want := homes[i]
			if want == down {
				want = successors[i]
				moved++
			}
			if got != want {
				t.Fatalf("key %x (home %s, successor %s) went to %s, want %s", k, homes[i], successors[i], got, want)
			}
		}
		if moved == 0 {
			t.Fatalf("no key had %s as home", down)
		}
	}
}

func TestPickDoesNotAllocate(t *testing.T) {
	skipUnderRace(t)
	f := newFleet(t, 16)
	f.setHealthy("w03", false)
	f.load("w05", 20) // over prefix_aware's default threshold: spills
	var timed atomic.Int64
	timer := func(string, string) func(time.Duration) {
		return func(d time.Duration) { timed.Add(int64(d)) }
	}
	untimed, withTimers := builtins(t, Params{}, Deps{}), builtins(t, Params{}, Deps{PartTimer: timer})
	for i, s := range append(untimed, withTimers...) {
		name := s.Name()
		if i >= len(untimed) {
			name += "/timed"
		}
		t.Run(name, func(t *testing.T) {
			req := &Request{Model: "llama"}
			snap := f.snap()
			allocs := testing.AllocsPerRun(1000, func() {
				req.PrefixKey = req.PrefixKey*0x9e3779b97f4a7c15 + 1
				if _, err := s.Pick(req, snap); err != nil {
					t.Fatal(err)
				}
			})
			if allocs != 0 {
				t.Errorf("Pick allocates %v times, want 0", allocs)
			}
		})
	}
}

// Each part of a profile is timed once per pick: its filters, each
// scorer, its picker.
func TestPartTimers(t *testing.T) {
	var mu sync.Mutex
	counts := map[string]int{}
	timer := func(profile, part string) func(time.Duration) {
		key := profile + "/" + part
		return func(d time.Duration) {
			if d < 0 {
				t.Errorf("%s: negative time %v", key, d)
			}
			mu.Lock()
			counts[key]++
			mu.Unlock()
		}
	}
	f := newFleet(t, 4)
	for _, s := range builtins(t, Params{}, Deps{PartTimer: timer}) {
		for i := range 3 {
			if _, err := s.Pick(&Request{Model: "llama", PrefixKey: uint64(i)}, f.snap()); err != nil {
				t.Fatal(err)
			}
		}
	}
	want := map[string]int{}
	for _, parts := range [][]string{
		{"random", "filters", "picker"},
		{"round_robin", "filters", "picker"},
		{"least_outstanding", "filters", "load", "picker"},
		{"prefix_aware", "filters", "prefix", "load", "picker"},
		{"kv_aware", "filters", "kv", "picker"},
	} {
		for _, part := range parts[1:] {
			want[parts[0]+"/"+part] = 3
		}
	}
	if diff := cmp.Diff(want, counts); diff != "" {
		t.Errorf("parts timed (-want +got):\n%s", diff)
	}
}

func TestConcurrentPicks(t *testing.T) {
	f := newFleet(t, 8)
	strategies := builtins(t, Params{}, Deps{Rand: SeededRand(9)})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 300 {
				s := strategies[(g+i)%len(strategies)]
				d, err := s.Pick(&Request{PrefixKey: uint64(i)}, f.snap())
				if err != nil {
					t.Error(err)
					return
				}
				done, err := d.Worker.Acquire()
				if err == nil {
					done(nil)
				}
			}
		})
	}
	wg.Wait()
}

func TestRoute(t *testing.T) {
	tests := []struct {
		d        Decision
		strategy string
		want     string
	}{
		{Decision{}, PrefixAware, "prefix_aware; spill=false"},
		{Decision{Spill: true, Reason: ReasonSpill}, PrefixAware, "prefix_aware; spill=true"},
		{Decision{Reason: ReasonRandom}, Random, "random; spill=false"},
	}
	for _, tt := range tests {
		if got := tt.d.Route(tt.strategy); got != tt.want {
			t.Errorf("Route(%s) of %+v = %q, want %q", tt.strategy, tt.d, got, tt.want)
		}
	}
}
