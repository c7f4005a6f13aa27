package watch

import (
	"context"
	"errors"
	"io"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/grpcworker"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket, of the fake engine's publisher, never stops its
	// writer goroutine on Close.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// fakeWorker is a worker's cache state and its Watch streams.
type fakeWorker struct {
	mu       sync.Mutex
	gpu      map[uint64]bool
	streams  []*fakeStream
	watches  int
	infos    int
	infoErr  error
	layers   int32
	subbed   chan struct{} // signalled on every Watch
	lastLoad *workerpb.LoadReport
}

func newFakeWorker(keys ...uint64) *fakeWorker {
	f := &fakeWorker{gpu: map[uint64]bool{}, subbed: make(chan struct{}, 100), layers: 40}
	for _, k := range keys {
		f.gpu[k] = true
	}
	return f
}

type fakeStream struct {
	grpc.ClientStream
	ctx context.Context
	ch  chan *workerpb.WatchEvent
	seq uint64
}

func (s *fakeStream) Recv() (*workerpb.WatchEvent, error) {
	select {
	case ev, ok := <-s.ch:
		if !ok {
			return nil, io.ErrUnexpectedEOF
		}
		return ev, nil
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
}

func (f *fakeWorker) Info(ctx context.Context) (*workerpb.InfoResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.infos++
	if f.infoErr != nil {
		return nil, f.infoErr
	}
	return &workerpb.InfoResponse{BlockChars: 64, Cost: &workerpb.CostParams{Layers: f.layers}}, nil
}

func (f *fakeWorker) Watch(ctx context.Context) (workerpb.Worker_WatchClient, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.watches++
	s := &fakeStream{ctx: ctx, ch: make(chan *workerpb.WatchEvent, 1000), seq: 1}
	var held []uint64
	for k := range f.gpu {
		held = append(held, k)
	}
	slices.Sort(held)
	s.ch <- &workerpb.WatchEvent{Seq: 1, Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{
		Load:   f.lastLoad,
		Blocks: []*workerpb.CacheEvent{{Kind: workerpb.CacheEvent_KIND_STORED, Tier: workerpb.Tier_TIER_GPU, Keys: held}},
	}}}
	f.streams = append(f.streams, s)
	f.subbed <- struct{}{}
	return s, nil
}

// change stores (or removes) keys and publishes the event, or, if lose,
// only counts it: the subscribers see a gap.
func (f *fakeWorker) change(kind workerpb.CacheEvent_Kind, lose bool, keys ...uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, k := range keys {
		if kind == workerpb.CacheEvent_KIND_STORED {
			f.gpu[k] = true
		} else {
			delete(f.gpu, k)
		}
	}
	for _, s := range f.streams {
		s.seq++
		if !lose {
			s.ch <- &workerpb.WatchEvent{Seq: s.seq, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
				Kind: kind, Tier: workerpb.Tier_TIER_GPU, Keys: keys}}}
		}
	}
}

func (f *fakeWorker) store(keys ...uint64) { f.change(workerpb.CacheEvent_KIND_STORED, false, keys...) }

// breakStreams ends every open stream with an error.
func (f *fakeWorker) breakStreams() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, s := range f.streams {
		close(s.ch)
	}
	f.streams = nil
}

func (f *fakeWorker) held() []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ks []uint64
	for k := range f.gpu {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// indexed returns the keys in [0, 100) the index says name holds in GPU.
func indexed(idx *kvindex.Index, name string) []uint64 {
	var ks []uint64
	out := make([]kvindex.Match, 1)
	for k := uint64(0); k < 100; k++ {
		idx.Lookup([]uint64{k}, []string{name}, out)
		if out[0].GPU == 1 {
			ks = append(ks, k)
		}
	}
	return ks
}

// eventually checks, once every goroutine of the test's bubble is
// blocked, that the index shows what the worker holds.
func eventually(t *testing.T, idx *kvindex.Index, name string, f *fakeWorker) {
	t.Helper()
	synctest.Wait()
	if got, want := indexed(idx, name), f.held(); !slices.Equal(got, want) {
		t.Fatalf("index holds %v for %s, worker holds %v", got, name, want)
	}
}

// waitSubscribed waits until f is subscribed to again, a second at most
// on the bubble's clock.
func waitSubscribed(t *testing.T, f *fakeWorker) {
	t.Helper()
	select {
	case <-f.subbed:
	case <-time.After(time.Second):
		t.Fatal("no subscription")
	}
}

type resyncs struct {
	mu   sync.Mutex
	errs []error
}

func (r *resyncs) record(_ string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
}

func (r *resyncs) get() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.errs)
}

// newWatcher returns a watcher that backs off from 1 ms to 10 ms. The
// tests run in synctest bubbles: backoffs take no time, and a test checks
// what the watcher did once every goroutine is blocked.
func newWatcher(t *testing.T, r *resyncs) (*Watcher, *kvindex.Index) {
	idx := kvindex.New(kvindex.Config{})
	cfg := Config{MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	if r != nil {
		cfg.OnResync = r.record
	}
	w := New(idx, cfg)
	t.Cleanup(func() { w.Close() })
	return w, idx
}

func TestWatchAppliesSnapshotAndEvents(t *testing.T) {
	synctest.Test(t, testWatchAppliesSnapshotAndEvents)
}

func testWatchAppliesSnapshotAndEvents(t *testing.T) {
	w, idx := newWatcher(t, nil)
	f := newFakeWorker(1, 2, 3)
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, f)
	eventually(t, idx, "a", f)
	f.store(4, 5)
	f.change(workerpb.CacheEvent_KIND_REMOVED, false, 1)
	eventually(t, idx, "a", f)
	out := make([]kvindex.Match, 1)
	idx.Lookup(nil, []string{"a"}, out)
	if !out[0].HasCost || out[0].Cost.Layers != 40 {
		t.Errorf("cost from Info: %+v, want layers 40", out[0].Cost)
	}
}

func TestWatchGapResyncs(t *testing.T) { synctest.Test(t, testWatchGapResyncs) }

func testWatchGapResyncs(t *testing.T) {
	var r resyncs
	w, idx := newWatcher(t, &r)
	f := newFakeWorker(1, 2)
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, f)
	f.store(3)
	eventually(t, idx, "a", f)
	// An event is lost (the worker dropped block 1): the next one
	// reveals the gap, and the watcher resubscribes for a snapshot that
	// replaces what the index held, block 1 included.
	f.change(workerpb.CacheEvent_KIND_REMOVED, true, 1)
	f.store(10, 11)
	waitSubscribed(t, f)
	eventually(t, idx, "a", f)
	if got := indexed(idx, "a"); slices.Contains(got, 1) || !slices.Contains(got, 10) {
		t.Errorf("index holds %v after the resync: want block 1 gone and 10 there", got)
	}
	if errs := r.get(); len(errs) != 1 || !errors.Is(errs[0], kvindex.ErrGap) || ResyncReason(errs[0]) != ResyncGap {
		t.Errorf("resyncs %v, want one ErrGap (reason %q)", errs, ResyncGap)
	}
	// Events on the new stream apply.
	f.store(20)
	eventually(t, idx, "a", f)
}

func TestWatchStreamErrorResubscribes(t *testing.T) {
	synctest.Test(t, testWatchStreamErrorResubscribes)
}

func testWatchStreamErrorResubscribes(t *testing.T) {
	var r resyncs
	w, idx := newWatcher(t, &r)
	f := newFakeWorker(1)
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, f)
	eventually(t, idx, "a", f)
	f.mu.Lock()
	f.layers = 80 // the worker restarts with another model
	f.mu.Unlock()
	f.breakStreams()
	f.store(7, 8) // while disconnected
	waitSubscribed(t, f)
	eventually(t, idx, "a", f)
	out := make([]kvindex.Match, 1)
	idx.Lookup(nil, []string{"a"}, out)
	if out[0].Cost.Layers != 80 {
		t.Errorf("cost after resubscribing: layers %d, want 80 (Info again)", out[0].Cost.Layers)
	}
	if errs := r.get(); len(errs) != 1 || !errors.Is(errs[0], io.ErrUnexpectedEOF) || ResyncReason(errs[0]) != ResyncStream {
		t.Errorf("resyncs %v, want one io.ErrUnexpectedEOF (reason %q)", errs, ResyncStream)
	}
}

func TestWatchInfoFailureBacksOff(t *testing.T) { synctest.Test(t, testWatchInfoFailureBacksOff) }

func testWatchInfoFailureBacksOff(t *testing.T) {
	var r resyncs
	w, idx := newWatcher(t, &r)
	f := newFakeWorker(1)
	f.infoErr = errors.New("unavailable")
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	// Attempts at 0, 1, 3, 7, 15 and 25 ms: the wait doubles from
	// MinBackoff to MaxBackoff. Each check falls between two attempts.
	time.Sleep(time.Millisecond / 2)
	for i, wait := range []time.Duration{0, 1, 2, 4, 8, 10} {
		time.Sleep(wait * time.Millisecond)
		synctest.Wait()
		if got := len(r.get()); got != i+1 {
			t.Fatalf("%d failed attempts, want %d", got, i+1)
		}
	}
	f.mu.Lock()
	f.infoErr = nil
	watches := f.watches
	f.mu.Unlock()
	if watches != 0 {
		t.Errorf("Watch called %d times while Info failed", watches)
	}
	for _, err := range r.get() {
		if got := ResyncReason(err); got != ResyncUnreachable {
			t.Errorf("ResyncReason(%v) = %q, want %q", err, got, ResyncUnreachable)
		}
	}
	waitSubscribed(t, f) // at the next attempt
	eventually(t, idx, "a", f)
}

func TestWatchRemoveAndReplace(t *testing.T) { synctest.Test(t, testWatchRemoveAndReplace) }

func testWatchRemoveAndReplace(t *testing.T) {
	w, idx := newWatcher(t, nil)
	a, b := newFakeWorker(1, 2), newFakeWorker(5)
	for name, f := range map[string]*fakeWorker{"a": a, "b": b} {
		if err := w.Add(name, f); err != nil {
			t.Fatal(err)
		}
		waitSubscribed(t, f)
		eventually(t, idx, name, f)
	}
	w.Remove("a")
	if got := indexed(idx, "a"); len(got) != 0 {
		t.Errorf("after Remove, index holds %v for a", got)
	}
	if got, want := idx.Len(), 1; got != want {
		t.Errorf("Len = %d, want %d", got, want)
	}
	// Replacing b's source stops the old stream first.
	b2 := newFakeWorker(6, 7)
	if err := w.Add("b", b2); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, b2)
	eventually(t, idx, "b", b2)
	b.store(9) // the old source's events go nowhere
	eventually(t, idx, "b", b2)
}

func TestWatchClose(t *testing.T) { synctest.Test(t, testWatchClose) }

func testWatchClose(t *testing.T) {
	idx := kvindex.New(kvindex.Config{})
	w := New(idx, Config{})
	f := newFakeWorker(1)
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	waitSubscribed(t, f)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := w.Add("b", f); !errors.Is(err, ErrClosed) {
		t.Fatalf("Add after Close: %v, want ErrClosed", err)
	}
	w.Remove("a")
}

// The baton gRPC worker client is a Source.
var _ Source = (*grpcworker.Client)(nil)

// TestWatchRetryCutsBackoffShort: a worker down long enough that the
// watcher waits seconds between attempts comes back; Retry (the
// scheduler calls it when the worker's health checks pass again) has the
// watcher resubscribe at once, so the index does not route on what the
// old process held for the rest of the backoff.
func TestWatchRetryCutsBackoffShort(t *testing.T) { synctest.Test(t, testWatchRetryCutsBackoffShort) }

func testWatchRetryCutsBackoffShort(t *testing.T) {
	var r resyncs
	idx := kvindex.New(kvindex.Config{})
	w := New(idx, Config{MinBackoff: 50 * time.Millisecond, MaxBackoff: 10 * time.Second, OnResync: r.record})
	t.Cleanup(func() { w.Close() })
	f := newFakeWorker(1)
	f.infoErr = errors.New("unavailable")
	if err := w.Add("a", f); err != nil {
		t.Fatal(err)
	}
	// Six failures: 50+100+200+400+800 ms waited, the next wait 1.6 s.
	time.Sleep(1600 * time.Millisecond)
	synctest.Wait()
	if got := len(r.get()); got != 6 {
		t.Fatalf("%d failed attempts, want 6", got)
	}
	f.mu.Lock()
	f.infoErr = nil
	f.mu.Unlock()
	start := time.Now()
	w.Retry("a")
	w.Retry("nobody") // not watched: nothing happens
	waitSubscribed(t, f)
	if d := time.Since(start); d != 0 {
		t.Errorf("resubscribed %v after Retry, want at once", d)
	}
	eventually(t, idx, "a", f)
}
