package scheduler_test

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
)

// Disaggregated prefill/decode between vLLM engines (NixlConnector) and
// between SGLang engines (bootstrap), through fake engines that check
// every step of their protocol (e2e_pd_engines_test.go).

// startPDScheduler starts a scheduler over engines that disaggregates
// every prompt, whatever its length.
func startPDScheduler(t *testing.T, strategy string, engines []*pdEngine, edit func(*scheduler.Config)) string {
	t.Helper()
	cfg := scheduler.Config{Strategy: strategy, Pool: fastPool(), Disaggregation: scheduler.DisaggConfig{MinRemotePrefillTokens: 1}}
	for _, e := range engines {
		cfg.Workers = append(cfg.Workers, e.config())
	}
	if edit != nil {
		edit(&cfg)
	}
	_, addr := startScheduler(t, cfg)
	return addr
}

// pdChat sends a chat completion, streamed or not.
func pdChat(t *testing.T, addr, prompt string, stream bool) chatResult {
	t.Helper()
	p := chatParams(prompt, 12)
	if !stream {
		return chat(t, oaClient(t, addr), p)
	}
	r, err := streamChat(t, oaClient(t, addr), p)
	if err != nil {
		t.Fatalf("streamed chat: %v", err)
	}
	return r
}

// colocated returns a scheduler over one colocated engine of kind: the
// reference for the text.
func colocated(t *testing.T, hub *pdHub, kind string) string {
	return startPDScheduler(t, "random", []*pdEngine{startPDEngine(t, hub, "c0", kind, scheduler.RoleBoth)}, nil)
}

func last(reqs []pdRequest) pdRequest {
	if len(reqs) == 0 {
		return pdRequest{}
	}
	return reqs[len(reqs)-1]
}

func TestVLLMDisaggregated(t *testing.T) {
	hub := newPDHub(t)
	engines := map[string]*pdEngine{}
	for _, n := range []string{"p0", "p1"} {
		engines[n] = startPDEngine(t, hub, n, scheduler.KindVLLM, scheduler.RolePrefill)
	}
	d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
	addr := startPDScheduler(t, "prefix_aware", []*pdEngine{engines["p0"], engines["p1"], d0}, nil)
	ref := colocated(t, hub, scheduler.KindVLLM)

	first := "" // the first request's prefill worker
	for i, stream := range []bool{false, true, false} {
		prompt := text("nixl-"+strconv.Itoa(i%2), 3000) // the third repeats the first
		got := pdChat(t, addr, prompt, stream)
		want := pdChat(t, ref, prompt, stream)
		if got.content != want.content || got.content == "" {
			t.Errorf("request %d: text %q, colocated %q", i, got.content, want.content)
		}
		pe := engines[got.prefill]
		if pe == nil || got.worker != "d0" || !strings.Contains(got.route, "prefill=remote") {
			t.Fatalf("request %d: prefill worker %q, decode worker %q, route %q", i, got.prefill, got.worker, got.route)
		}
		pre, dec := last(pe.received()), last(d0.received())
		if pre.id == "" || dec.id != pre.id {
			t.Errorf("request %d: X-Request-Id %q to the prefill engine, %q to the decode engine; want one id", i, pre.id, dec.id)
		}
		hub.mu.Lock()
		issued := hub.issued[pre.id]
		hub.mu.Unlock()
		if p := dec.field("kv_transfer_params"); p != issued || !strings.Contains(p, `"x_future"`) {
			t.Errorf("request %d: decode kv_transfer_params %s, the prefill answered %s", i, p, issued)
		}
		if pre.field("stream") != "false" || pre.field("max_tokens") != "1" || pre.field("stream_options") != "" {
			t.Errorf("request %d: prefill request %s", i, pre.raw)
		}
		// The decode request is the client's own.
		if dec.field("max_tokens") != "12" || dec.field("messages") != pre.field("messages") {
			t.Errorf("request %d: decode request %s is not the client's", i, dec.raw)
		}
		if stream != (dec.field("stream") == "true") {
			t.Errorf("request %d: decode stream %s, the client's %v", i, dec.field("stream"), stream)
		}
		// Usage reports what the prefill engine found cached (nothing the
		// first time), not the blocks the decode engine pulled.
		wantCached := int64(0)
		if i == 0 {
			first = got.prefill
		} else if i == 2 && got.prefill == first {
			wantCached = want.prompt / pdBlock * pdBlock
		}
		if got.prompt != want.prompt || got.cached != wantCached {
			t.Errorf("request %d: usage %d prompt, %d cached tokens; want %d, %d", i, got.prompt, got.cached, want.prompt, wantCached)
		}
	}
}

func TestVLLMDisaggPrefillFails(t *testing.T) {
	t.Run("another prefill worker", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
		p1 := startPDEngine(t, hub, "p1", scheduler.KindVLLM, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
		p0.set(func(e *pdEngine) { e.fail = http.StatusInternalServerError })
		addr := startPDScheduler(t, "round_robin", []*pdEngine{p0, p1, d0}, nil)
		ref := colocated(t, hub, scheduler.KindVLLM)
		for i := range 3 {
			prompt := text(fmt.Sprintf("retry-%d", i), 2000)
			got, want := pdChat(t, addr, prompt, false), pdChat(t, ref, prompt, false)
			if got.content != want.content || got.prefill != "p1" || got.worker != "d0" {
				t.Errorf("request %d: %q from %s after prefill on %q; want %q after p1", i, got.content, got.worker, got.prefill, want.content)
			}
			if dec, pre := last(d0.received()), last(p1.received()); dec.id != pre.id || dec.field("kv_transfer_params") == "" {
				t.Errorf("request %d: decode id %q, p1's %q; decode params %s", i, dec.id, pre.id, dec.field("kv_transfer_params"))
			}
		}
		if len(p0.received()) == 0 {
			t.Error("the failing prefill worker was never tried")
		}
	})
	t.Run("every prefill worker: decode alone", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
		p1 := startPDEngine(t, hub, "p1", scheduler.KindVLLM, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
		for _, p := range []*pdEngine{p0, p1} {
			p.set(func(e *pdEngine) { e.fail = http.StatusServiceUnavailable })
		}
		addr := startPDScheduler(t, "round_robin", []*pdEngine{p0, p1, d0}, nil)
		ref := colocated(t, hub, scheduler.KindVLLM)
		prompt := text("alone", 2000)
		got, want := pdChat(t, addr, prompt, true), pdChat(t, ref, prompt, true)
		if got.content != want.content || got.worker != "d0" || got.prefill != "" || !strings.Contains(got.route, "prefill=local(prefill_failed)") {
			t.Errorf("got %q from %s (prefill %q, route %q), want %q from d0 alone", got.content, got.worker, got.prefill, got.route, want.content)
		}
		if n0, n1 := len(p0.received()), len(p1.received()); n0+n1 != 2 {
			t.Errorf("prefill workers got %d and %d requests, want one each", n0, n1)
		}
		if p := last(d0.received()).field("kv_transfer_params"); p != "" {
			t.Errorf("the decode engine, prefilling alone, got kv_transfer_params %s", p)
		}
	})
	t.Run("decode fails before its first token: a new pair", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
		d1 := startPDEngine(t, hub, "d1", scheduler.KindVLLM, scheduler.RoleDecode)
		d0.set(func(e *pdEngine) { e.fail = http.StatusServiceUnavailable })
		addr := startPDScheduler(t, "round_robin", []*pdEngine{p0, d0, d1}, func(c *scheduler.Config) {
			c.Disaggregation.DecodeStrategy = "round_robin"
		})
		ref := colocated(t, hub, scheduler.KindVLLM)
		for i := range 2 {
			prompt := text(fmt.Sprintf("pair-%d", i), 2000)
			got, want := pdChat(t, addr, prompt, i == 1), pdChat(t, ref, prompt, i == 1)
			if got.content != want.content || got.worker != "d1" {
				t.Errorf("request %d: %q from %s, want %q from d1", i, got.content, got.worker, want.content)
			}
		}
		failed, served, prefills := d0.received(), d1.received(), p0.received()
		if len(failed) == 0 {
			t.Fatal("the failing decode worker was never tried")
		}
		if len(prefills) != len(failed)+len(served) {
			t.Errorf("%d prefills for %d decode attempts: want one per pair", len(prefills), len(failed)+len(served))
		}
		ids := map[string]bool{}
		for _, p := range prefills {
			if ids[p.id] {
				t.Errorf("two prefills with id %q", p.id)
			}
			ids[p.id] = true
		}
		for _, d := range append(failed, served...) {
			hub.mu.Lock()
			issued := hub.issued[d.id]
			hub.mu.Unlock()
			if !ids[d.id] || d.field("kv_transfer_params") != issued {
				t.Errorf("decode request %q carries %s, not its own pair's prefill's", d.id, d.field("kv_transfer_params"))
			}
		}
	})
}

func TestVLLMDisaggClientCancels(t *testing.T) {
	t.Run("during the prefill", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
		p0.set(func(e *pdEngine) { e.hold = true })
		addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		c := oaClient(t, addr)
		go func() {
			_, err := c.Chat.Completions.New(ctx, chatParams(text("cancel-prefill", 2000), 12))
			done <- err
		}()
		eventually(t, 10*time.Second, func() error {
			if len(p0.received()) == 0 {
				return fmt.Errorf("no prefill yet")
			}
			return nil
		})
		cancel()
		if err := <-done; err == nil {
			t.Fatal("a cancelled request succeeded")
		}
		eventually(t, 10*time.Second, func() error {
			if p0.cancels() != 1 {
				return fmt.Errorf("the prefill engine saw %d cancels, want 1", p0.cancels())
			}
			return nil
		})
		if n := len(d0.received()); n != 0 {
			t.Errorf("the decode engine got %d requests after the client left", n)
		}
	})
	t.Run("mid-stream", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
		d0.set(func(e *pdEngine) { e.hold = true })
		addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, nil)
		cancelMidStream(t, addr, "cancel-decode")
		eventually(t, 10*time.Second, func() error {
			if d0.cancels() != 1 {
				return fmt.Errorf("the decode engine saw %d cancels, want 1", d0.cancels())
			}
			return nil
		})
	})
}

// cancelMidStream streams a chat completion from addr and goes away after
// its first token.
func cancelMidStream(t *testing.T, addr, seed string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := oaClient(t, addr)
	stream := c.Chat.Completions.NewStreaming(ctx, chatParams(text(seed, 2000), 12))
	defer stream.Close()
	for stream.Next() {
		if ch := stream.Current().Choices; len(ch) > 0 && ch[0].Delta.Content != "" {
			cancel()
			return
		}
	}
	t.Fatalf("the stream ended before its first token: %v", stream.Err())
}

func TestSGLangDisaggregated(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
	addr := startPDScheduler(t, "prefix_aware", []*pdEngine{p0, d0}, nil)
	ref := colocated(t, hub, scheduler.KindSGLang)
	rooms := map[string]bool{}
	for i, stream := range []bool{false, true} {
		prompt := text("bootstrap-"+strconv.Itoa(i), 3000)
		got, want := pdChat(t, addr, prompt, stream), pdChat(t, ref, prompt, stream)
		if got.content != want.content || got.content == "" || got.worker != "d0" || got.prefill != "p0" {
			t.Errorf("request %d: %q from %s after %q, want %q from d0 after p0", i, got.content, got.worker, got.prefill, want.content)
		}
		// Both engines got the very same request, with p0's bootstrap
		// address and one room; each answered only once the other came
		// (the fakes wait for each other), so they were sent at once.
		pre, dec := last(p0.received()), last(d0.received())
		if string(pre.raw) != string(dec.raw) {
			t.Errorf("request %d: prefill got %s, decode %s; want the same", i, pre.raw, dec.raw)
		}
		if pre.field("bootstrap_host") != `"127.0.0.1"` || pre.field("bootstrap_port") != strconv.Itoa(p0.bootstrapPort) {
			t.Errorf("request %d: bootstrap %s:%s, want p0's 127.0.0.1:%d", i, pre.field("bootstrap_host"), pre.field("bootstrap_port"), p0.bootstrapPort)
		}
		room := pre.field("bootstrap_room")
		if n, err := strconv.ParseUint(room, 10, 64); err != nil || n >= 1<<63 || rooms[room] {
			t.Errorf("request %d: room %s, want a new 63-bit integer", i, room)
		}
		rooms[room] = true
	}
}

func TestSGLangPrefillFailsNewRoom(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
	p1 := startPDEngine(t, hub, "p1", scheduler.KindSGLang, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
	p0.set(func(e *pdEngine) { e.fail = http.StatusInternalServerError })
	addr := startPDScheduler(t, "round_robin", []*pdEngine{p0, p1, d0}, nil)
	ref := colocated(t, hub, scheduler.KindSGLang)
	for i := range 3 {
		prompt := text(fmt.Sprintf("room-%d", i), 2000)
		got, want := pdChat(t, addr, prompt, i == 1), pdChat(t, ref, prompt, i == 1)
		if got.content != want.content || got.prefill != "p1" || got.worker != "d0" {
			t.Errorf("request %d: %q from %s after %q, want %q from d0 after p1", i, got.content, got.worker, got.prefill, want.content)
		}
	}
	failed := p0.received()
	if len(failed) == 0 {
		t.Fatal("the failing prefill worker was never tried")
	}
	// Each failed pair's decode request waited for blocks that never
	// came, until the scheduler cancelled it and paired again, in a new
	// room.
	rooms := map[string]int{}
	for _, d := range d0.received() {
		rooms[d.field("bootstrap_room")]++
	}
	for _, p := range append(failed, p1.received()...) {
		if rooms[p.field("bootstrap_room")] != 1 {
			t.Errorf("room %s: %d decode requests, want 1", p.field("bootstrap_room"), rooms[p.field("bootstrap_room")])
		}
	}
	if len(rooms) != len(failed)+3 {
		t.Errorf("%d rooms for %d pairs: want a new room for each", len(rooms), len(failed)+3)
	}
	eventually(t, 10*time.Second, func() error {
		if n := d0.cancels(); n != len(failed) {
			return fmt.Errorf("the decode engine saw %d cancels, want one per failed pair (%d)", n, len(failed))
		}
		return nil
	})

	// SGLang decode engines cannot prefill alone: with every prefill
	// worker failing, the client gets a 503.
	p1.set(func(e *pdEngine) { e.fail = http.StatusInternalServerError })
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"` + text("none", 500) + `"}]}`
	r := do(t, httpClient(t), http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil)
	if _, _, code, _ := decodeError(t, r.body); r.status != http.StatusServiceUnavailable || code != "no_worker_available" {
		t.Errorf("every prefill failing: status %d code %q, want 503 no_worker_available", r.status, code)
	}
}

func TestSGLangClientCancelsMidStream(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
	for _, e := range []*pdEngine{p0, d0} {
		e.set(func(e *pdEngine) { e.hold = true })
	}
	addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, nil)
	cancelMidStream(t, addr, "cancel-both")
	eventually(t, 10*time.Second, func() error {
		if p, d := p0.cancels(), d0.cancels(); p != 1 || d != 1 {
			return fmt.Errorf("cancels seen: prefill %d, decode %d; want 1 each (requests: %d, %d)", p, d, len(p0.received()), len(d0.received()))
		}
		return nil
	})
}

func TestSGLangDecodeFailsNewPair(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
	d1 := startPDEngine(t, hub, "d1", scheduler.KindSGLang, scheduler.RoleDecode)
	d0.set(func(e *pdEngine) { e.fail = http.StatusServiceUnavailable })
	addr := startPDScheduler(t, "random", []*pdEngine{p0, d0, d1}, func(c *scheduler.Config) {
		c.Disaggregation.DecodeStrategy = "round_robin"
	})
	ref := colocated(t, hub, scheduler.KindSGLang)
	for i := range 2 {
		prompt := text(fmt.Sprintf("sglang-pair-%d", i), 2000)
		got, want := pdChat(t, addr, prompt, i == 0), pdChat(t, ref, prompt, i == 0)
		if got.content != want.content || got.worker != "d1" || got.prefill != "p0" {
			t.Errorf("request %d: %q from %s after %q, want %q from d1 after p0", i, got.content, got.worker, got.prefill, want.content)
		}
	}
	failed, served := d0.received(), d1.received()
	if len(failed) == 0 {
		t.Fatal("the failing decode worker was never tried")
	}
	// Each pair had its own room.
	rooms := map[string]bool{}
	for _, d := range append(failed, served...) {
		rooms[d.field("bootstrap_room")] = true
	}
	if len(rooms) != len(failed)+len(served) {
		t.Errorf("%d rooms for %d pairs: want a new room for each", len(rooms), len(failed)+len(served))
	}
	// The prefill of a failed pair, if it reached its engine before the
	// scheduler cancelled it, waited for its decode partner in vain.
	eventually(t, 10*time.Second, func() error {
		prefills := p0.received()
		if n := p0.cancels(); n != len(prefills)-len(served) {
			return fmt.Errorf("the prefill engine saw %d cancels of %d prefills, %d of which succeeded", n, len(prefills), len(served))
		}
		return nil
	})
}

// The usage of a disaggregated SGLang request reports the prompt tokens the
// prefill engine found cached, as vLLM's does, whether the decode engine
// reports them (SGLang sends the count with the blocks) or not (older
// SGLang).
func TestSGLangDisaggCachedTokens(t *testing.T) {
	for _, old := range []bool{false, true} {
		t.Run(fmt.Sprintf("oldSGLang=%v", old), func(t *testing.T) {
			hub := newPDHub(t)
			p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
			d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
			d0.set(func(e *pdEngine) { e.oldSGLang = old })
			addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, nil)
			prompt := text("sglang-cached", 3000)
			for i, stream := range []bool{false, true, false} {
				got := pdChat(t, addr, prompt, stream)
				want := int64(0) // the prefill engine's cache is cold
				if i > 0 {
					want = got.prompt / pdBlock * pdBlock
				}
				if got.prefill != "p0" || got.prompt == 0 || got.cached != want {
					t.Errorf("request %d (stream %v): prefill worker %q, usage %d prompt, %d cached tokens; want p0, %d cached",
						i, stream, got.prefill, got.prompt, got.cached, want)
				}
			}
		})
	}
}

// min_remote_prefill_tokens with SGLang: a short prompt goes to a worker
// that serves it alone (a unified SGLang engine), with no bootstrap fields
// and no prefill, never to a decode engine, which cannot prefill; a long
// one pairs. Without a worker that serves alone, a short prompt pairs.
func TestSGLangMinRemotePrefillTokens(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
	c0 := startPDEngine(t, hub, "c0", scheduler.KindSGLang, scheduler.RoleBoth)
	threshold := func(c *scheduler.Config) {
		c.Disaggregation.MinRemotePrefillTokens = 500 // about 2,000 characters
		c.Disaggregation.DecodeStrategy = "round_robin"
	}
	addr := startPDScheduler(t, "random", []*pdEngine{p0, d0, c0}, threshold)
	for i := range 4 {
		got := pdChat(t, addr, text(fmt.Sprintf("short-%d", i), 400), i%2 == 1)
		if got.worker != "c0" || got.prefill != "" || got.content == "" {
			t.Errorf("short prompt %d: %q from %s after %q, want an answer from c0 alone", i, got.content, got.worker, got.prefill)
		}
	}
	if n := len(p0.received()) + len(d0.received()); n != 0 {
		t.Errorf("short prompts sent %d requests to the prefill and decode engines, want none", n)
	}
	for _, r := range c0.received() {
		if r.field("bootstrap_room") != "" || r.field("bootstrap_host") != "" {
			t.Errorf("c0 got bootstrap fields: %s", r.raw)
		}
	}
	// Long prompts pair whenever they land on the decode engine, which
	// round_robin makes them do.
	paired := 0
	for i := range 4 {
		got := pdChat(t, addr, text(fmt.Sprintf("long-%d", i), 4000), false)
		switch {
		case got.worker == "d0" && got.prefill == "p0":
			paired++
		case got.worker == "c0" && got.prefill == "":
		default:
			t.Errorf("long prompt %d: served by %s after %q, want d0 after p0, or c0 alone", i, got.worker, got.prefill)
		}
	}
	if paired == 0 || len(p0.received()) != paired {
		t.Errorf("%d long prompts paired, %d prefills; want some, one each", paired, len(p0.received()))
	}

	p1 := startPDEngine(t, hub, "p1", scheduler.KindSGLang, scheduler.RolePrefill)
	d1 := startPDEngine(t, hub, "d1", scheduler.KindSGLang, scheduler.RoleDecode)
	addr = startPDScheduler(t, "random", []*pdEngine{p1, d1}, threshold)
	if got := pdChat(t, addr, text("short-alone", 400), false); got.worker != "d1" || got.prefill != "p1" || got.content == "" {
		t.Errorf("short prompt without a unified engine: %q from %s after %q, want an answer from d1 after p1", got.content, got.worker, got.prefill)
	}
}

// A prefill worker's failure is counted as SGLang's as it is as vLLM's: a
// prefill the engine refused as invalid is the request's fault, not a
// transfer failure, and a request no prefill worker was available for
// falls back for that reason alone, not also as one whose prefills
// failed.
func TestSGLangPrefillFailureCounts(t *testing.T) {
	t.Run("request refused", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
		p0.set(func(e *pdEngine) { e.fail = http.StatusBadRequest })
		addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, nil)
		hc := httpClient(t)
		body := `{"model":"` + model + `","messages":[{"role":"user","content":"` + text("refused", 500) + `"}]}`
		if r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil); r.status != http.StatusBadRequest {
			t.Errorf("prefill refused as invalid: status %d, want 400", r.status)
		}
		m := scrapeSettled(t, hc, addr)
		if v, _ := metric(m, "baton_transfer_failures_total"); v != 0 {
			t.Errorf("transfer failures = %v, want 0: the request was at fault", v)
		}
	})
	t.Run("no prefill worker", func(t *testing.T) {
		hub := newPDHub(t)
		p0 := startPDEngine(t, hub, "p0", scheduler.KindSGLang, scheduler.RolePrefill)
		d0 := startPDEngine(t, hub, "d0", scheduler.KindSGLang, scheduler.RoleDecode)
		p0.set(func(e *pdEngine) { e.fail = http.StatusInternalServerError })
		addr := startPDScheduler(t, "random", []*pdEngine{p0, d0}, func(c *scheduler.Config) {
			c.Pool.BreakerOpenTimeout = time.Minute // open for the test's length
		})
		hc := httpClient(t)
		body := `{"model":"` + model + `","messages":[{"role":"user","content":"` + text("none", 500) + `"}]}`
		// Two failed prefills open p0's breaker (fastPool: 2 failures);
		// the third request finds no prefill worker.
		for i := range 3 {
			if r := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil); r.status != http.StatusServiceUnavailable {
				t.Fatalf("request %d: status %d, want 503", i, r.status)
			}
		}
		m := scrapeSettled(t, hc, addr)
		failed, _ := metric(m, "baton_fallbacks_total", `reason="prefill_failed"`)
		none, _ := metric(m, "baton_fallbacks_total", `reason="no_prefill_worker"`)
		if failed != 2 || none != 1 {
			t.Errorf("fallbacks: %v prefill_failed, %v no_prefill_worker; want 2 and 1", failed, none)
		}
	})
}
