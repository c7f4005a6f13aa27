package kvstore_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
)

// hotBackends opens a store of each implementation with the given TTL, as
// a HotTracker, with raw access.
var hotBackends = map[string]func(t *testing.T, ttl time.Duration) (transfer.HotTracker, raw){
	"memory": func(t *testing.T, ttl time.Duration) (transfer.HotTracker, raw) {
		s, r := memoryBackend(t, ttl)
		return transfer.Tracker(s), r
	},
	"redis": func(t *testing.T, ttl time.Duration) (transfer.HotTracker, raw) {
		s, r := redisBackend(t, ttl)
		return transfer.Tracker(s), r
	},
}

// hotModel is a model name of t's own (a shared Redis may hold earlier
// runs' sets, and decay guards live an hour).
func hotModel(t *testing.T) string {
	return fmt.Sprintf("%s@%d", t.Name(), time.Now().UnixNano())
}

func chain(base uint64, n int) []uint64 {
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = base + uint64(i)
	}
	return keys
}

func touch(t *testing.T, h transfer.HotTracker, ns transfer.Namespace, keys []uint64, times int) {
	t.Helper()
	for range times {
		if err := h.Touch(context.Background(), ns, keys); err != nil {
			t.Fatalf("Touch: %v", err)
		}
	}
}

func hottest(t *testing.T, h transfer.HotTracker, model string, k int) []transfer.HotPrefix {
	t.Helper()
	got, err := h.Hottest(context.Background(), model, k)
	if err != nil {
		t.Fatalf("Hottest: %v", err)
	}
	return got
}

func TestHotTracker(t *testing.T) {
	tests := map[string]func(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)){
		"Ranking":  testHotRanking,
		"Bounds":   testHotBounds,
		"Expiry":   testHotExpiry,
		"Stale":    testHotStale,
		"Parallel": testHotParallel,
	}
	for name, open := range hotBackends {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			if h, _ := open(t, 0); h == nil {
				t.Fatal("store is no HotTracker")
			}
			for tname, test := range tests {
				t.Run(tname, func(t *testing.T) {
					t.Parallel()
					test(t, open)
				})
			}
		})
	}
}

// Prefixes rank by uses, across tenants, with their chains; models are
// apart.
func testHotRanking(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)) {
	h, _ := open(t, 0)
	model := hotModel(t)
	a := transfer.Namespace{Model: model, Salt: 1}
	b := transfer.Namespace{Model: model, Salt: 2}
	pa, pb, pc := chain(100, 7), chain(200, 3), chain(300, 1)
	touch(t, h, a, pa, 5)
	touch(t, h, b, pb, 3)
	touch(t, h, a, pc, 1)
	touch(t, h, transfer.Namespace{Model: model + "-other", Salt: 1}, chain(400, 2), 9)

	got := hottest(t, h, model, 10)
	want := []transfer.HotPrefix{{NS: a, Keys: pa, Score: 5}, {NS: b, Keys: pb, Score: 3}, {NS: a, Keys: pc, Score: 1}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Hottest(10) =\n%v, want\n%v", got, want)
	}
	if got := hottest(t, h, model, 2); fmt.Sprint(got) != fmt.Sprint(want[:2]) {
		t.Errorf("Hottest(2) = %v, want %v", got, want[:2])
	}
	if got := hottest(t, h, model, 0); len(got) != 0 {
		t.Errorf("Hottest(0) = %v", got)
	}
	if got := hottest(t, h, model+"-none", 3); len(got) != 0 {
		t.Errorf("Hottest of an unknown model = %v", got)
	}
	// A longer chain ending elsewhere is another prefix; the same chain
	// touched again moves up.
	touch(t, h, b, pb, 3)
	if got := hottest(t, h, model, 1); len(got) != 1 || got[0].NS != b || got[0].Score != 6 {
		t.Errorf("after more uses of b: %v", got)
	}
	// The caller owns what Hottest returns.
	got = hottest(t, h, model, 1)
	clear(got[0].Keys)
	if again := hottest(t, h, model, 1); !slices.Equal(again[0].Keys, pb) {
		t.Errorf("chain changed by the caller: %v", again[0].Keys)
	}
}

// Chains are recorded up to MaxHotChain blocks; no keys is no use.
func testHotBounds(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)) {
	h, _ := open(t, 0)
	model := hotModel(t)
	ns := transfer.Namespace{Model: model, Salt: 7}
	long := chain(1<<40, transfer.MaxHotChain+500)
	touch(t, h, ns, long, 2)
	touch(t, h, ns, nil, 3)
	got := hottest(t, h, model, 5)
	if len(got) != 1 || got[0].Score != 2 || !slices.Equal(got[0].Keys, long[:transfer.MaxHotChain]) {
		t.Fatalf("Hottest = %d prefixes (%v), want the first %d blocks of the long one, score 2", len(got), got, transfer.MaxHotChain)
	}
}

// Prefixes not touched for the store's TTL are forgotten.
func testHotExpiry(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)) {
	h, r := open(t, time.Second)
	model := hotModel(t)
	ns := transfer.Namespace{Model: model, Salt: 3}
	touch(t, h, ns, chain(10, 4), 1)
	id := transfer.HotID(ns, 13)
	if ttl := r.TTL(t, "baton:hotchain:"+model+":"+id); ttl <= 0 || ttl > time.Second {
		if _, mem := r.(memoryRaw); !mem { // Memory keeps chains apart from blocks
			t.Errorf("chain TTL %v, want in (0, 1s]", ttl)
		}
	}
	if got := hottest(t, h, model, 3); len(got) != 1 {
		t.Fatalf("Hottest before the TTL: %v", got)
	}
	r.Expire(t, "baton:hotchain:"+model+":"+id)
	if got := hottest(t, h, model, 3); len(got) != 0 {
		t.Errorf("Hottest after the TTL: %v", got)
	}
}

// A member whose chain is gone or bad is skipped (Redis); Hottest still
// returns k prefixes when more are known.
func testHotStale(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)) {
	h, r := open(t, 0)
	rr, ok := r.(redisRaw)
	if !ok {
		return // Memory keeps entry and chain together
	}
	model := hotModel(t)
	ns := transfer.Namespace{Model: model, Salt: 4}
	touch(t, h, ns, chain(10, 2), 5)
	touch(t, h, ns, chain(20, 2), 4)
	touch(t, h, ns, chain(30, 2), 3)
	ctx := context.Background()
	if err := rr.c.Del(ctx, "baton:hotchain:"+model+":"+transfer.HotID(ns, 11)).Err(); err != nil {
		t.Fatal(err)
	}
	rr.Set(t, "baton:hotchain:"+model+":"+transfer.HotID(ns, 21), []byte("not a chain"))
	got := hottest(t, h, model, 1)
	if len(got) != 1 || !slices.Equal(got[0].Keys, chain(30, 2)) {
		t.Errorf("Hottest = %v, want the one prefix left", got)
	}
	if n := rr.c.ZCard(ctx, "baton:hot:"+model).Val(); n != 1 {
		t.Errorf("%d members left, want the stale ones removed", n)
	}
}

func testHotParallel(t *testing.T, open func(*testing.T, time.Duration) (transfer.HotTracker, raw)) {
	h, _ := open(t, 0)
	model := hotModel(t)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 7 { // fewer than a decay check's 64 touches
				ns := transfer.Namespace{Model: model, Salt: uint64(i % 2)}
				if err := h.Touch(context.Background(), ns, chain(uint64(1000*(i%4)), 3)); err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				if _, err := h.Hottest(context.Background(), model, 2); err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	var total float64
	for _, p := range hottest(t, h, model, 10) {
		total += p.Score
	}
	if total != 8*7 {
		t.Errorf("scores add up to %v, want %d", total, 8*7)
	}
}

// Memory: scores halve every HotHalfLife, and a model keeps at most
// MaxHotPrefixes prefixes, the most used.
func TestMemoryHotDecayAndTrim(t *testing.T) {
	m := kvstore.NewMemory(kvstore.MemoryConfig{TTL: -1})
	defer m.Close()
	now := time.Unix(1_700_000_000, 0)
	m.SetNow(func() time.Time { return now })
	ns := transfer.Namespace{Model: "m"}
	touch(t, m, ns, chain(1, 2), 4)
	now = now.Add(kvstore.HotHalfLife)
	touch(t, m, ns, chain(10, 2), 3)
	got := hottest(t, m, "m", 2)
	if len(got) != 2 || got[0].Keys[0] != 10 || got[0].Score != 3 || got[1].Score != 2 {
		t.Errorf("after a half-life: %v, want the recent prefix (3) above the old one (4 halved)", got)
	}
	for i := range kvstore.MaxHotPrefixes + kvstore.MaxHotPrefixes/8 {
		touch(t, m, ns, []uint64{uint64(1_000_000 + i)}, 1)
	}
	got = hottest(t, m, "m", kvstore.MaxHotPrefixes+10)
	if len(got) > kvstore.MaxHotPrefixes+kvstore.MaxHotPrefixes/8 {
		t.Errorf("%d prefixes tracked, want at most about %d", len(got), kvstore.MaxHotPrefixes)
	}
	if got[0].Keys[0] != 10 || got[1].Keys[0] != 1 {
		t.Errorf("trimming dropped the hottest: %v", got[:2])
	}
}

// Redis: every hotTrimEvery touches a client checks the model's decay
// guard; the first check halves the scores.
func TestRedisHotDecay(t *testing.T) {
	s, _ := redisBackend(t, 0)
	h := transfer.Tracker(s)
	model := hotModel(t)
	ns := transfer.Namespace{Model: model}
	touch(t, h, ns, chain(5, 2), 64)
	if got := hottest(t, h, model, 1); len(got) != 1 || got[0].Score != 32 {
		t.Errorf("after 64 touches: %v, want score 32 (halved once)", got)
	}
	touch(t, h, ns, chain(5, 2), 64) // the guard holds for an hour
	if got := hottest(t, h, model, 1); len(got) != 1 || got[0].Score != 96 {
		t.Errorf("after 64 more: %v, want score 96 (not halved again)", got)
	}
}

// hotFake is a fakeStore that also tracks.
type hotFake struct{ fakeStore }

func (f *hotFake) Touch(context.Context, transfer.Namespace, []uint64) error { return f.result() }
func (f *hotFake) Hottest(context.Context, string, int) ([]transfer.HotPrefix, error) {
	if err := f.result(); err != nil {
		return nil, err
	}
	return []transfer.HotPrefix{{Score: 1}}, nil
}

func TestBreakerHotTracker(t *testing.T) {
	ctx := context.Background()
	ns := transfer.Namespace{Model: "m"}
	// Over a store that tracks nothing, the breaker tracks nothing.
	plain := kvstore.NewBreaker(&fakeStore{}, kvstore.BreakerConfig{})
	if transfer.Tracker(plain) != nil {
		t.Error("Tracker of a breaker over a plain store is not nil")
	}
	if err := plain.Touch(ctx, ns, []uint64{1}); !errors.Is(err, transfer.ErrNotTracked) {
		t.Errorf("Touch through a plain store: %v, want ErrNotTracked", err)
	}
	if transfer.Tracker(kvstore.NewBreaker(kvstore.NewBreaker(&fakeStore{}, kvstore.BreakerConfig{}), kvstore.BreakerConfig{})) != nil {
		t.Error("Tracker of nested breakers over a plain store is not nil")
	}

	// Over Memory: a pass-through.
	m := kvstore.NewMemory(kvstore.MemoryConfig{})
	b := kvstore.NewBreaker(m, kvstore.BreakerConfig{})
	defer b.Close()
	h := transfer.Tracker(b)
	if h == nil {
		t.Fatal("Tracker of a breaker over Memory is nil")
	}
	touch(t, h, ns, chain(1, 3), 2)
	if got := hottest(t, h, "m", 1); len(got) != 1 || got[0].Score != 2 || !slices.Equal(got[0].Keys, chain(1, 3)) {
		t.Errorf("Hottest through the breaker: %v", got)
	}

	// Failures count; an open breaker bypasses without calling the store.
	f := &hotFake{fakeStore{err: errDown}}
	fb := kvstore.NewBreaker(f, kvstore.BreakerConfig{Failures: 2, OpenTimeout: time.Minute})
	for range 2 {
		if err := fb.Touch(ctx, ns, []uint64{1}); !errors.Is(err, errDown) {
			t.Fatalf("Touch: %v, want the store's error", err)
		}
	}
	if fb.State() != gobreaker.StateOpen {
		t.Fatalf("state %v after 2 failed touches, want open", fb.State())
	}
	calls := f.count()
	if err := fb.Touch(ctx, ns, []uint64{1}); !errors.Is(err, transfer.ErrBypassed) {
		t.Errorf("Touch behind an open breaker: %v, want ErrBypassed", err)
	}
	if _, err := fb.Hottest(ctx, "m", 3); !errors.Is(err, transfer.ErrBypassed) {
		t.Errorf("Hottest behind an open breaker: %v, want ErrBypassed", err)
	}
	if f.count() != calls {
		t.Errorf("an open breaker called the store %d times", f.count()-calls)
	}
}
