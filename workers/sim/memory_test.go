package sim

import (
	"context"
	"fmt"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/workers/engine"
)

// Bursts of long prompts sharing a prefix, as in a prefill fleet's worst
// minutes: the heap must come back after them, and hold no more than the
// requests in flight need while they run.
const (
	burstRequests = 500
	burstChars    = 32 << 10 // 8,192 tokens: 512 blocks
	burstShared   = burstChars / 2
	// burstKVScale makes blocks of 4 KiB (Llama-3.1-8B's 2 MiB over 512)
	// so that a burst moves 1 GiB, not 8, and runs in seconds under the
	// race detector.
	burstKVScale = 512
	// burstGPUBlocks lets 256 prompts hold their blocks at once.
	burstGPUBlocks = 140_000
	// burstPushes pushes are held until all of them have started, as
	// when the link is the bottleneck, however fast the machine.
	burstPushes = 128
	// burstGrowth bounds the heap a burst may leave behind, beyond the
	// idle heap: the caches' block records (about 100 bytes a block, and
	// the burst leaves some 130,000 blocks in each engine) and pools.
	burstGrowth = 48 << 20
	// burstPeak bounds the live heap during a burst, beyond the idle
	// heap: the prompts themselves (16 MiB), their sequences, the block
	// records, and one block's payload per push in flight. Pushes that
	// held the payload of every block they carried took 128 pushes × 512
	// blocks × 4 KiB: 256 MiB.
	burstPeak = 96 << 20
	// burstDeadline only guards against a hang: a burst takes a second or
	// so, 5 under the race detector, and past a minute on a machine busy
	// with other race-enabled tests.
	burstDeadline = 4 * time.Minute
)

// burstPrompt returns prompt i of a burst: the shared prefix, then text of
// its own.
func burstPrompt(prefix string, i int) string {
	var b strings.Builder
	b.Grow(burstChars + 32)
	b.WriteString(prefix)
	for n := 0; b.Len() < burstChars; n++ {
		fmt.Fprintf(&b, " request %d part %d", i, n)
	}
	return b.String()[:burstChars]
}

// heapInuse returns HeapInuse after a collection; after two, so that what
// sync.Pools held is gone too.
func heapInuse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// liveMax samples the heap the collector last found live until the
// returned function is called, which returns the largest value seen.
// Collections run often in a burst that allocates, so this sees the peak
// without counting garbage.
func liveMax() (stop func() uint64) {
	done := make(chan struct{})
	out := make(chan uint64)
	go func() {
		s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
		var peak uint64
		t := time.NewTicker(time.Millisecond)
		defer t.Stop()
		for {
			metrics.Read(s)
			peak = max(peak, s[0].Value.Uint64())
			select {
			case <-t.C:
			case <-done:
				out <- peak
				return
			}
		}
	}()
	return func() uint64 { close(done); return <-out }
}

// burstResult is the heap around one burst.
type burstResult struct {
	idle, after, peak uint64
}

func (r burstResult) String() string {
	return fmt.Sprintf("idle heap %.1f MiB; after the burst %.1f MiB (%.2f×); peak live %.1f MiB",
		mib(r.idle), mib(r.after), float64(r.after)/float64(r.idle), mib(r.peak))
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }

// runBurst runs do for burstRequests requests at once, waits for them and
// for idle (the engines idle), and measures the heap.
func runBurst(t testing.TB, idle func(), do func(i int, req *engine.Request) error) burstResult {
	prefix := longPrompt("shared system prompt", burstShared/64)
	var r burstResult
	r.idle = heapInuse()
	stop := liveMax()
	var wg sync.WaitGroup
	for i := range burstRequests {
		wg.Go(func() {
			req := &engine.Request{ID: fmt.Sprint(i), Model: testModel, Tenant: "t", Prompt: burstPrompt(prefix, i), MaxTokens: 4}
			if err := do(i, req); err != nil {
				t.Errorf("request %d: %v", i, err)
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(burstDeadline):
		t.Fatalf("the burst did not end within %v", burstDeadline)
	}
	r.peak = stop()
	idle()
	r.after = heapInuse()
	return r
}

// checkBurst checks a burst's heap against the bounds.
func checkBurst(t *testing.T, r burstResult) {
	t.Helper()
	t.Log(r)
	if r.after > r.idle+burstGrowth {
		t.Errorf("%v: the burst left more than %.0f MiB", r, mib(burstGrowth))
	}
	if r.peak > r.idle+burstPeak {
		t.Errorf("%v: the live heap peaked more than %.0f MiB above idle", r, mib(burstPeak))
	}
}

// prefillDecode returns a burst's request: a prefill on p pushing to d at
// addr over tr, then the decode on d.
func prefillDecode(t testing.TB, p, d *Engine, addr string, tr transfer.Transport) func(int, *engine.Request) error {
	return func(i int, req *engine.Request) error {
		ctx := context.Background()
		id := fmt.Sprint("x", i)
		if _, err := p.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: id, DecodeAddr: addr}, tr); err != nil {
			return err
		}
		st, err := d.Decode(ctx, req, id, 5*time.Second)
		if err != nil {
			return err
		}
		_, err = collect(t, st)
		return err
	}
}

// TestBurstMemoryPrefill drives a prefill engine with a burst, pushing
// each prompt's blocks to a decode engine in memory (what a gRPC receiver
// buffers is the decode worker's: BenchmarkBurstPrefillGRPC measures
// both), which then decodes it.
func TestBurstMemoryPrefill(t *testing.T) {
	if testing.Short() {
		t.Skip("a burst of 500 long prompts")
	}
	cfg := Config{Role: RolePrefill, TimeScale: 1e6, KVScale: burstKVScale, Tiers: Tiers{GPUBlocks: burstGPUBlocks}}
	p := newEngine(t, cfg)
	cfg.Role = RoleDecode
	d := newEngine(t, cfg)
	n := transfer.NewInMem()
	t.Cleanup(n.Listen("d", d))
	tr := &gatedTransport{Transport: closeTransport(t, n.Transport()), n: burstPushes, open: make(chan struct{})}
	checkBurst(t, runBurst(t, func() { waitIdle(t, p); waitIdle(t, d) }, prefillDecode(t, p, d, "d", tr)))
}

// gatedTransport holds pushes until n of them have started.
type gatedTransport struct {
	transfer.Transport
	n       int
	mu      sync.Mutex
	started int
	open    chan struct{}
}

func (g *gatedTransport) wait(ctx context.Context) error {
	g.mu.Lock()
	if g.started++; g.started == g.n {
		close(g.open)
	}
	g.mu.Unlock()
	select {
	case <-g.open:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *gatedTransport) Push(ctx context.Context, addr, id string, blocks []transfer.Block) (transfer.PushStats, error) {
	if err := g.wait(ctx); err != nil {
		return transfer.PushStats{}, err
	}
	return g.Transport.Push(ctx, addr, id, blocks)
}

func (g *gatedTransport) PushFill(ctx context.Context, addr, id string, keys []uint64, size int, fill transfer.FillFunc) (transfer.PushStats, error) {
	if err := g.wait(ctx); err != nil {
		return transfer.PushStats{}, err
	}
	return transfer.PushFill(ctx, g.Transport, addr, id, keys, size, fill)
}

// TestBurstMemoryColocated drives a colocated engine with a burst.
func TestBurstMemoryColocated(t *testing.T) {
	if testing.Short() {
		t.Skip("a burst of 500 long prompts")
	}
	e := newEngine(t, Config{TimeScale: 1e6, KVScale: burstKVScale, Tiers: Tiers{GPUBlocks: burstGPUBlocks}})
	checkBurst(t, runBurst(t, func() { waitIdle(t, e) }, func(_ int, req *engine.Request) error {
		st, err := e.Generate(context.Background(), req)
		if err != nil {
			return err
		}
		_, err = collect(t, st)
		return err
	}))
}

// BenchmarkBurstPrefillGRPC is TestBurstMemoryPrefill with the default
// block size (32 KiB) and default capacities, over gRPC between two
// workers of this process; it reports the heap in MiB.
func BenchmarkBurstPrefillGRPC(b *testing.B) {
	for range b.N {
		p, err := Start(Config{Name: "p", Role: RolePrefill, TimeScale: 1e6}, "127.0.0.1:0", "", nil)
		if err != nil {
			b.Fatal(err)
		}
		d, err := Start(Config{Name: "d", Role: RoleDecode, TimeScale: 1e6}, "127.0.0.1:0", "", nil)
		if err != nil {
			b.Fatal(err)
		}
		r := runBurst(b, func() {}, prefillDecode(b, p.Engine, d.Engine, d.GRPCAddr, p.Transport))
		p.Close()
		d.Close()
		b.ReportMetric(mib(r.idle), "idle-MiB")
		b.ReportMetric(mib(r.after), "after-MiB")
		b.ReportMetric(mib(r.peak), "peak-MiB")
	}
}
