package sim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
)

// startWorker starts a worker on loopback, closed at the end of the test.
func startWorker(t *testing.T, cfg Config, opts ...StartOption) (*Worker, *grpcworker.Client) {
	t.Helper()
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 1000
	}
	w, err := Start(cfg, "127.0.0.1:0", "", nil, opts...)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { w.Close() })
	c, err := grpcworker.Dial(w.GRPCAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return w, c
}

// longPrompt returns a prompt of blocks full blocks (64 characters each),
// distinct per tag.
func longPrompt(tag string, blocks int) string {
	var b strings.Builder
	for i := range blocks {
		line := fmt.Sprintf("%s block %d: the quick brown fox jumps over the lazy dog", tag, i)
		b.WriteString((line + strings.Repeat(".", 64))[:64])
	}
	return b.String()
}

func requestKeys(req *engine.Request) []uint64 {
	return blockkey.Append(nil, blockkey.Seed(req.Model, req.Tenant), req.Prompt, blockkey.DefaultBlockChars)
}

// closeTransport closes a test-owned transport at the end of the test.
func closeTransport(t *testing.T, tr transfer.Transport) transfer.Transport {
	t.Cleanup(func() { tr.Close() })
	return tr
}

// collectOK returns a function reading a stream to its end, failing the
// test on any error: collectOK(t)(c.Generate(ctx, req)).
func collectOK(t *testing.T) func(engine.Stream, error) result {
	return func(st engine.Stream, err error) result {
		t.Helper()
		if err != nil {
			t.Fatalf("start: %v", err)
		}
		r, err := collect(t, st)
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		return r
	}
}

func TestDisaggRolesInfo(t *testing.T) {
	for role, want := range map[string]workerpb.Role{
		"": workerpb.Role_ROLE_BOTH, RoleBoth: workerpb.Role_ROLE_BOTH,
		RolePrefill: workerpb.Role_ROLE_PREFILL, RoleDecode: workerpb.Role_ROLE_DECODE,
	} {
		_, c := startWorker(t, Config{Role: role})
		info, err := c.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if info.GetRole() != want {
			t.Errorf("role %q: Info().Role = %v, want %v", role, info.GetRole(), want)
		}
	}
	if err := (Config{Role: "middle"}).Validate(); err == nil || !strings.HasPrefix(err.Error(), "role:") {
		t.Errorf("Validate(role middle) = %v", err)
	}
}

func TestDisaggWrongRole(t *testing.T) {
	p, pc := startWorker(t, Config{Role: RolePrefill})
	d, dc := startWorker(t, Config{Role: RoleDecode})
	req := &engine.Request{Model: testModel, Prompt: longPrompt("role", 4), MaxTokens: 5}
	if _, err := dc.Prefill(context.Background(), &engine.PrefillRequest{
		Request: req, TransferID: "x", DecodeAddr: p.GRPCAddr,
	}); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Prefill on a decode worker: %v, want ErrUnavailable", err)
	}
	if _, err := pc.Decode(context.Background(), req, "", 0); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Decode on a prefill worker: %v, want ErrUnavailable", err)
	}
	// Generate works on both: a prefill worker may serve colocated.
	want := collectOK(t)(pc.Generate(context.Background(), req))
	got := collectOK(t)(dc.Generate(context.Background(), req))
	if got.text != want.text || got.text == "" {
		t.Errorf("Generate texts differ: %q, %q", got.text, want.text)
	}
	_ = d
}

func TestDisaggPrefillDecode(t *testing.T) {
	ctx := context.Background()
	p, pc := startWorker(t, Config{Name: "p", Role: RolePrefill})
	d, dc := startWorker(t, Config{Name: "d", Role: RoleDecode})
	_, cc := startWorker(t, Config{Name: "c"})

	req := &engine.Request{ID: "r1", Model: testModel, Tenant: "t", Prompt: longPrompt("pd", 40) + "tail", MaxTokens: 30}
	keys := requestKeys(req)
	res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "t1", DecodeAddr: d.GRPCAddr})
	if err != nil {
		t.Fatalf("Prefill: %v", err)
	}
	prompt := blockkey.Tokens(len(req.Prompt))
	if res.Skipped || res.PromptTokens != prompt || res.CachedTokens != 0 || res.DecodeHeldTokens != 0 ||
		res.BlocksSent != len(keys) || res.BlocksHeld != 0 || res.BlocksRejected != 0 ||
		res.BytesSent != int64(len(keys)*d.Engine.BlockBytes()) || res.Prefill <= 0 || res.Transfer <= 0 {
		t.Errorf("Prefill() = %+v, want %d blocks of %d bytes sent", res, len(keys), d.Engine.BlockBytes())
	}
	if n := d.Engine.Cache().Lookup(keys); n != len(keys) {
		t.Errorf("decode worker holds %d of %d blocks", n, len(keys))
	}
	if u := p.Engine.Load().BlocksUsed; u != 0 {
		t.Errorf("prefill worker still uses %d blocks", u)
	}
	if n := p.Engine.Cache().Lookup(keys); n != len(keys) {
		t.Errorf("prefill worker caches %d of %d blocks", n, len(keys))
	}
	if st, ok := d.Engine.Transfer("t1"); !ok || !st.Finished || st.Err != nil || st.Accepted != len(keys) || st.Rejected != 0 {
		t.Errorf("Transfer(t1) = %+v, %v", st, ok)
	}

	got := collectOK(t)(dc.Decode(ctx, req, "t1", time.Second))
	want := collectOK(t)(cc.Generate(ctx, req))
	if got.text != want.text || got.text == "" {
		t.Errorf("Decode text %q, colocated Generate %q", got.text, want.text)
	}
	if got.final.CachedTokens != len(keys)*BlockTokens || got.final.PromptTokens != prompt ||
		got.final.CompletionTokens != want.final.CompletionTokens {
		t.Errorf("Decode final = %+v, want %d cached tokens, colocated %+v", got.final, len(keys)*BlockTokens, want.final)
	}
	if want.final.CachedTokens != 0 {
		t.Errorf("fresh colocated worker reports %d cached tokens", want.final.CachedTokens)
	}

	// The same prefix with a new suffix: only the new blocks move.
	req2 := &engine.Request{ID: "r2", Model: testModel, Tenant: "t", Prompt: longPrompt("pd", 40) + longPrompt("more", 3) + "x", MaxTokens: 10}
	keys2 := requestKeys(req2)
	res2, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req2, TransferID: "t2", DecodeAddr: d.GRPCAddr, MinRemoteTokens: 16})
	if err != nil {
		t.Fatalf("Prefill 2: %v", err)
	}
	if res2.Skipped || res2.BlocksHeld != len(keys) || res2.BlocksSent != len(keys2)-len(keys) ||
		res2.DecodeHeldTokens != len(keys)*BlockTokens || res2.CachedTokens != len(keys)*BlockTokens {
		t.Errorf("Prefill 2 = %+v, want %d held and %d sent", res2, len(keys), len(keys2)-len(keys))
	}
	got2 := collectOK(t)(dc.Decode(ctx, req2, "t2", time.Second))
	want2 := collectOK(t)(cc.Generate(ctx, req2))
	if got2.text != want2.text || got2.final.CachedTokens != len(keys2)*BlockTokens {
		t.Errorf("Decode 2: %q %+v; colocated %q", got2.text, got2.final, want2.text)
	}
}

// A Decode that arrives before its transfer waits for it, and then finds
// the blocks.
func TestDisaggDecodeFirst(t *testing.T) {
	ctx := context.Background()
	_, pc := startWorker(t, Config{Role: RolePrefill})
	d, dc := startWorker(t, Config{Role: RoleDecode})
	req := &engine.Request{Model: testModel, Prompt: longPrompt("first", 30), MaxTokens: 8}
	keys := requestKeys(req)

	type out struct {
		r   result
		err error
	}
	done := make(chan out, 1)
	go func() {
		st, err := dc.Decode(ctx, req, "early", 5*time.Second)
		if err != nil {
			done <- out{err: err}
			return
		}
		r, err := collect(t, st)
		done <- out{r, err}
	}()
	waitFor(t, "Decode to wait for its transfer", func() bool {
		x := &d.Engine.xfers
		x.mu.Lock()
		defer x.mu.Unlock()
		return x.m["early"] != nil && x.m["early"].waiters == 1
	})
	if _, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "early", DecodeAddr: d.GRPCAddr}); err != nil {
		t.Fatalf("Prefill: %v", err)
	}
	o := <-done
	if o.err != nil {
		t.Fatalf("Decode: %v", o.err)
	}
	// Prompt of whole blocks: the last token is always recomputed.
	if want := len(keys)*BlockTokens - 1; o.r.final.CachedTokens != want {
		t.Errorf("cached tokens %d, want %d", o.r.final.CachedTokens, want)
	}
}

func TestDisaggMinRemoteTokens(t *testing.T) {
	ctx := context.Background()
	p, pc := startWorker(t, Config{Role: RolePrefill})
	d, dc := startWorker(t, Config{Role: RoleDecode})

	short := &engine.Request{Model: testModel, Prompt: longPrompt("short", 3), MaxTokens: 5}
	res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: short, TransferID: "s", DecodeAddr: d.GRPCAddr, MinRemoteTokens: 64})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Skipped || res.SkipReason != SkipShort || res.BlocksSent != 0 || res.BytesSent != 0 || res.PromptTokens != 48 {
		t.Errorf("short Prefill = %+v, want skipped", res)
	}
	if p.Engine.Cache().Cached() != 0 || d.Engine.Cache().Cached() != 0 || p.Engine.Stats().Steps != 0 {
		t.Errorf("short prompt computed or sent: prefill caches %d, decode %d, %d steps",
			p.Engine.Cache().Cached(), d.Engine.Cache().Cached(), p.Engine.Stats().Steps)
	}
	if _, ok := d.Engine.Transfer("s"); ok {
		t.Errorf("decode worker saw transfer s")
	}

	long := &engine.Request{Model: testModel, Prompt: longPrompt("long", 10) + "abc", MaxTokens: 5}
	res, err = pc.Prefill(ctx, &engine.PrefillRequest{Request: long, TransferID: "l", DecodeAddr: d.GRPCAddr, MinRemoteTokens: 64})
	if err != nil {
		t.Fatal(err)
	}
	if res.Skipped || res.BlocksSent != 10 {
		t.Errorf("long Prefill = %+v, want 10 blocks sent", res)
	}
	// Now the decode worker holds all but a few tokens: skipped again.
	longer := &engine.Request{Model: testModel, Prompt: longPrompt("long", 10) + longPrompt("x", 1), MaxTokens: 5}
	res, err = pc.Prefill(ctx, &engine.PrefillRequest{Request: longer, TransferID: "l2", DecodeAddr: d.GRPCAddr, MinRemoteTokens: 64})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Skipped || res.DecodeHeldTokens != 160 {
		t.Errorf("mostly held Prefill = %+v, want skipped with 160 held tokens", res)
	}
	r := collectOK(t)(dc.Decode(ctx, longer, "", 0))
	if r.final.CachedTokens != 160 {
		t.Errorf("local prefill cached tokens %d, want 160", r.final.CachedTokens)
	}
}

func TestDisaggCorruptBlock(t *testing.T) {
	ctx := context.Background()
	req := &engine.Request{Model: testModel, Prompt: longPrompt("corrupt", 12) + "end", MaxTokens: 20}
	keys := requestKeys(req)
	bad := keys[3]
	tr := closeTransport(t, transfer.NewGRPC(transfer.WithFault(func(key uint64, data []byte) []byte {
		if key == bad {
			data[len(data)/2] ^= 0x40
		}
		return data
	})))
	_, pc := startWorker(t, Config{Role: RolePrefill}, WithTransport(tr))
	d, dc := startWorker(t, Config{Role: RoleDecode})
	_, cc := startWorker(t, Config{})

	res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "c", DecodeAddr: d.GRPCAddr})
	if err != nil {
		t.Fatalf("Prefill: %v", err)
	}
	if res.BlocksSent != len(keys) || res.BlocksRejected != 1 {
		t.Errorf("Prefill = %+v, want %d sent, 1 rejected", res, len(keys))
	}
	held := d.Engine.Has(keys)
	for i, h := range held {
		if h != (i != 3) {
			t.Errorf("decode worker holds block %d: %v", i, h)
		}
	}
	if st, _ := d.Engine.Transfer("c"); st.Accepted != len(keys)-1 || st.Rejected != 1 {
		t.Errorf("Transfer(c) = %+v", st)
	}
	got := collectOK(t)(dc.Decode(ctx, req, "c", time.Second))
	want := collectOK(t)(cc.Generate(ctx, req))
	if got.text != want.text || got.final.CachedTokens != 3*BlockTokens || got.final.CompletionTokens != want.final.CompletionTokens {
		t.Errorf("Decode %q %+v; colocated %q %+v", got.text, got.final, want.text, want.final)
	}
	// The decode worker recomputed the block: it holds the whole prompt now.
	if n := d.Engine.Cache().Lookup(keys); n != len(keys) {
		t.Errorf("after Decode the worker holds %d of %d blocks", n, len(keys))
	}
}

func TestDisaggStalledTransfer(t *testing.T) {
	ctx := context.Background()
	tr := closeTransport(t, transfer.NewGRPC(transfer.WithDelay(func(uint64) time.Duration { return time.Hour })))
	p, pc := startWorker(t, Config{Role: RolePrefill}, WithTransport(tr))
	d, dc := startWorker(t, Config{Role: RoleDecode})
	_, cc := startWorker(t, Config{})
	req := &engine.Request{Model: testModel, Prompt: longPrompt("stall", 8), MaxTokens: 12}

	var wg sync.WaitGroup
	var dec result
	var decErr error
	var decTook time.Duration
	wg.Add(1)
	go func() {
		defer wg.Done()
		start := time.Now()
		st, err := dc.Decode(ctx, req, "stall", 400*time.Millisecond)
		if err != nil {
			decErr = err
			return
		}
		decTook = time.Since(start)
		dec, decErr = collect(t, st)
	}()
	start := time.Now()
	_, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "stall", DecodeAddr: d.GRPCAddr, TransferTimeout: 200 * time.Millisecond})
	if err == nil || !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Prefill of a stalled transfer: %v, want ErrUnavailable", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Prefill took %v, past its 200ms transfer timeout", took)
	}
	wg.Wait()
	if decErr != nil {
		t.Fatalf("Decode: %v", decErr)
	}
	if decTook > 2*time.Second {
		t.Errorf("Decode waited %v", decTook)
	}
	want := collectOK(t)(cc.Generate(ctx, req))
	if dec.text != want.text || dec.final.CachedTokens != 0 {
		t.Errorf("Decode %q %+v, colocated %q", dec.text, dec.final, want.text)
	}
	waitFor(t, "prefill worker to release its blocks", func() bool { return p.Engine.Load().BlocksUsed == 0 })
}

func TestDisaggDecodeWorkerDies(t *testing.T) {
	ctx := context.Background()
	tr := closeTransport(t, transfer.NewGRPC(transfer.WithDelay(func(uint64) time.Duration { return 20 * time.Millisecond })))
	p, pc := startWorker(t, Config{Role: RolePrefill}, WithTransport(tr))
	d, _ := startWorker(t, Config{Role: RoleDecode})
	req := &engine.Request{Model: testModel, Prompt: longPrompt("dies", 40), MaxTokens: 12}

	time.AfterFunc(150*time.Millisecond, func() { d.Close() })
	res, err := pc.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "dies", DecodeAddr: d.GRPCAddr})
	if err == nil {
		t.Fatalf("Prefill to a dying decode worker = %+v, want an error", res)
	}
	if !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Prefill error %v, want ErrUnavailable", err)
	}
	waitFor(t, "prefill worker to release its blocks", func() bool { return p.Engine.Load().BlocksUsed == 0 })
}

func TestDisaggUnknownTransfer(t *testing.T) {
	_, dc := startWorker(t, Config{Role: RoleDecode})
	_, cc := startWorker(t, Config{})
	req := &engine.Request{Model: testModel, Prompt: longPrompt("unknown", 5), MaxTokens: 7}
	start := time.Now()
	got := collectOK(t)(dc.Decode(context.Background(), req, "never", 150*time.Millisecond))
	if took := time.Since(start); took < 150*time.Millisecond || took > 2*time.Second {
		t.Errorf("Decode of an unknown transfer took %v, want its 150ms timeout", took)
	}
	want := collectOK(t)(cc.Generate(context.Background(), req))
	if got.text != want.text {
		t.Errorf("Decode %q, colocated %q", got.text, want.text)
	}
	// A cancelled wait fails with the context's error.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := dc.Decode(ctx, req, "never2", 5*time.Second); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Decode past its deadline: %v", err)
	}
}

// Cancelling Prefill stops the push and frees the prefill worker's blocks
// (engine level, over the in-memory transport, so the release is checked
// the moment Prefill returns).
func TestDisaggPrefillCancel(t *testing.T) {
	net := transfer.NewInMem()
	stall := net.Transport(transfer.WithDelay(func(uint64) time.Duration { return time.Hour }))
	defer stall.Close()
	p := newEngine(t, Config{Role: RolePrefill})
	d := newEngine(t, Config{Role: RoleDecode})
	defer net.Listen("d", d)()
	req := &engine.Request{Model: testModel, Prompt: longPrompt("cancel", 20), MaxTokens: 5}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := p.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "x", DecodeAddr: "d"}, stall)
		done <- err
	}()
	waitFor(t, "the push to hold the prompt's blocks", func() bool { return p.Load().BlocksUsed == 20 && p.Load().Running == 0 })
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled Prefill: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("cancelled Prefill did not return")
	}
	if u := p.Load().BlocksUsed; u != 0 {
		t.Errorf("prefill engine still uses %d blocks", u)
	}
	// The push may not have begun when ctx was cancelled; if it did, the
	// decode side saw it end with an error.
	if st, ok := d.Transfer("x"); ok && (!st.Finished || st.Err == nil) {
		t.Errorf("decode side of the cancelled push: %+v %v", st, ok)
	}

	// Cancelled while queued behind a long prefill, too.
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := p.Prefill(ctx2, &engine.PrefillRequest{Request: req, TransferID: "y", DecodeAddr: "d"}, stall); !errors.Is(err, context.Canceled) {
		t.Errorf("Prefill with a cancelled context: %v", err)
	}
	if u := p.Load().BlocksUsed; u != 0 {
		t.Errorf("prefill engine uses %d blocks", u)
	}
}

// Prefill cancelled during its prefill (the sequence is dropped by the
// step loop, its blocks released).
func TestDisaggPrefillCancelComputing(t *testing.T) {
	net := transfer.NewInMem()
	tr := net.Transport()
	defer tr.Close()
	p := newEngine(t, Config{Role: RolePrefill, TimeScale: 0.25}) // slow: a step of about 0.4 s
	d := newEngine(t, Config{Role: RoleDecode})
	defer net.Listen("d", d)()
	req := &engine.Request{Model: testModel, Prompt: longPrompt("slow", 200), MaxTokens: 5}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := p.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "x", DecodeAddr: "d"}, tr)
		done <- err
	}()
	waitFor(t, "the prefill to run", func() bool { return p.Load().Running == 1 })
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Prefill: %v", err)
	}
	if u := p.Load().BlocksUsed; u != 0 {
		t.Errorf("prefill engine uses %d blocks", u)
	}
	if d.Cache().Cached() != 0 {
		t.Errorf("decode engine received blocks of a cancelled prefill")
	}
}

// The engine's receiving side on its own: size checks, transfer states,
// and a Finish arriving before the Decode that waits for it.
func TestDisaggReceiver(t *testing.T) {
	e := newEngine(t, Config{Role: RoleDecode, Tiers: Tiers{GPUBlocks: 4, CPUBlocks: -1}})
	buf := make([]byte, e.BlockBytes())
	e.Accept("a", 1, buf[:10]) // wrong size
	e.Accept("a", 2, buf)      // wrong contents (zeros)
	e.Finish("a", 2, 1, nil)
	if st, ok := e.Transfer("a"); !ok || !st.Finished || st.Accepted != 0 || st.Rejected != 3 {
		t.Errorf("Transfer(a) = %+v %v", st, ok)
	}
	if e.Cache().Cached() != 0 {
		t.Errorf("rejected blocks entered the cache")
	}
	// Capacity 4: a fifth block evicts the least recently used.
	for k := uint64(10); k < 15; k++ {
		kvblock.Fill(buf, k)
		e.Accept("b", k, buf)
	}
	e.Finish("b", 5, 0, nil)
	if got := e.Has([]uint64{10, 11, 14}); got[0] || !got[1] || !got[2] {
		t.Errorf("Has after eviction = %v", got)
	}
	// Decode after Finish does not wait.
	start := time.Now()
	r := collectOK(t)(e.Decode(context.Background(), &engine.Request{Model: testModel, Prompt: "hi", MaxTokens: 3}, "b", time.Hour))
	if time.Since(start) > time.Second || r.final == nil {
		t.Errorf("Decode after Finish took %v", time.Since(start))
	}
}

func TestLinkDelay(t *testing.T) {
	e := newEngine(t, Config{TimeScale: 1})
	// 16 tokens × 131,072 bytes = 2 MiB a Llama-3.1-8B block; 1,000 blocks
	// over 50 GB/s take 41.9 ms.
	if got, want := e.linkDelay(1000), time.Duration(1000*16*131072/50e9*float64(time.Second)); got != want {
		t.Errorf("linkDelay(1000) = %v, want %v", got, want)
	}
	if got := newEngine(t, Config{Disagg: Disagg{LinkBandwidth: -1}}).linkDelay(1000); got != 0 {
		t.Errorf("infinite link: %v", got)
	}
	if got := e.BlockBytes(); got != 2<<20/64 {
		t.Errorf("BlockBytes() = %d, want 32 KiB", got)
	}
}

// waitFor checks cond every millisecond until it holds, failing t after
// 5 s: for a state the engine's goroutines reach in their own time.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	timeout := time.After(5 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// holdTransport holds its first push until release is closed; entered is
// closed when that push arrives.
type holdTransport struct {
	transfer.Transport
	once             sync.Once
	entered, release chan struct{}
}

func (h *holdTransport) hold() {
	first := false
	h.once.Do(func() { first = true })
	if first {
		close(h.entered)
		<-h.release
	}
}

func (h *holdTransport) Push(ctx context.Context, addr, id string, blocks []transfer.Block) (transfer.PushStats, error) {
	h.hold()
	return h.Transport.Push(ctx, addr, id, blocks)
}

func (h *holdTransport) PushFill(ctx context.Context, addr, id string, keys []uint64, size int, fill transfer.FillFunc) (transfer.PushStats, error) {
	h.hold()
	return transfer.PushFill(ctx, h.Transport, addr, id, keys, size, fill)
}

// A prefill queued for blocks that a push holds runs as soon as the push
// releases them, with no other request to wake the step loop.
func TestDisaggPrefillWaitsForPushedBlocks(t *testing.T) {
	ctx := context.Background()
	p := newEngine(t, Config{Role: RolePrefill, Tiers: Tiers{GPUBlocks: 64}})
	d := newEngine(t, Config{Role: RoleDecode})
	n := transfer.NewInMem()
	t.Cleanup(n.Listen("d", d))
	tr := &holdTransport{Transport: closeTransport(t, n.Transport()), entered: make(chan struct{}), release: make(chan struct{})}

	prefill := func(tag string) chan error {
		done := make(chan error, 1)
		go func() {
			req := &engine.Request{Model: testModel, Prompt: longPrompt(tag, 40)}
			_, err := p.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: tag, DecodeAddr: "d"}, tr)
			done <- err
		}()
		return done
	}
	first := prefill("first")
	<-tr.entered // its 40 blocks are held by the push
	second := prefill("second")
	waitFor(t, "the second prefill to queue", func() bool { return p.Load().Waiting == 1 })
	close(tr.release)
	for _, done := range []chan error{first, second} {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Prefill: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("prefill still waiting: %+v", p.Load())
		}
	}
}
