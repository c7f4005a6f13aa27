package scheduler_test

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/sim"
)

// LoRA adapters with disaggregated prefill/decode between simulated
// workers over gRPC: the prefill and the decode of an adapter's request
// both run on workers holding it.

// loraFleet is a disaggregated fleet of simulated workers serving
// loraAdapters.
type loraFleet struct {
	*simfleet.Fleet
	prefill, decode map[string]*sim.Worker
}

// startLoRADisagg starts nPrefill prefill and nDecode decode workers with
// prefillSlots and decodeSlots adapter slots (0: that role serves no
// adapter), and a scheduler in front of them that knows their slots from
// their engines.
func startLoRADisagg(t *testing.T, nPrefill, nDecode, prefillSlots, decodeSlots int, edit func(*scheduler.Config)) *loraFleet {
	t.Helper()
	var list []engine.Adapter
	for _, a := range loraAdapters {
		list = append(list, engine.Adapter{Name: a.Name, Base: a.BaseModel, Bytes: a.Size})
	}
	cfg := scheduler.Config{Strategy: "prefix_aware", Pool: loraPool(), Adapters: loraAdapters}
	if edit != nil {
		edit(&cfg)
	}
	f := startFleetSpec(t, simfleet.Spec{
		Prefill: nPrefill, Decode: nDecode, Name: shortName,
		Config: func(_, role string) sim.Config {
			slots := decodeSlots
			if role == sim.RolePrefill {
				slots = prefillSlots
			}
			c := sim.Config{TimeScale: fastScale}
			if slots > 0 {
				c.LoRA = sim.LoRA{Adapters: list, MaxLoRAs: slots}
			}
			return c
		},
		Scheduler: cfg,
	})
	waitDescribed(t, f.Scheduler)
	lf := &loraFleet{Fleet: f, prefill: map[string]*sim.Worker{}, decode: map[string]*sim.Worker{}}
	for i, wc := range f.Configs {
		if wc.Role == scheduler.RolePrefill {
			lf.prefill[wc.Name] = f.Workers[i]
		} else {
			lf.decode[wc.Name] = f.Workers[i]
		}
	}
	return lf
}

// loads returns the adapter loads of workers' engines, in all.
func loads(workers map[string]*sim.Worker) int {
	n := 0
	for _, w := range workers {
		n += int(w.Engine.LoRAStats().Loads)
	}
	return n
}

// A burst of requests for an adapter no worker holds loads it once onto a
// prefill worker and once onto a decode worker; every request is
// prefilled on the prefill worker holding it and decoded on the decode
// worker holding it.
func TestAdapterDisaggregated(t *testing.T) {
	f := startLoRADisagg(t, 2, 2, 2, 2, func(c *scheduler.Config) {
		c.Params = paramsThreshold(64)
		// A loaded machine (-race) may take seconds over a burst's
		// pushes: each must reach its decode worker.
		c.Disaggregation.TransferTimeout = time.Minute
	})
	c := oaClient(t, f.Addr)

	results := concurrentChats(t, c, 12, func(i int) openai.ChatCompletionNewParams {
		// About 1,500 tokens of its own: prefilled remotely, whatever
		// the decode worker holds of the others.
		return adapterChat("sql", text(fmt.Sprint("sql question ", i), 6000))
	})
	for i, r := range results {
		pw, dw := f.prefill[r.prefill], f.decode[r.worker]
		if pw == nil || dw == nil || !strings.Contains(r.route, "prefill=remote") {
			t.Fatalf("request %d: prefill worker %q, decode worker %q, route %q; want a remote prefill", i, r.prefill, r.worker, r.route)
		}
		if !strings.Contains(r.route, "; adapter=") || !strings.Contains(r.route, "; prefill_adapter=") {
			t.Errorf("request %d: route %q does not say how either worker had the adapter", i, r.route)
		}
		for _, w := range []*sim.Worker{pw, dw} {
			if !strings.Contains(strings.Join(w.Engine.Adapters(), ","), "sql") {
				t.Errorf("request %d: worker %s served it without sql (holds %v)", i, w.Engine.Config().Name, w.Engine.Adapters())
			}
		}
	}
	if p, d := loads(f.prefill), loads(f.decode); p != 1 || d != 1 {
		t.Errorf("prefill engines loaded sql %d times, decode engines %d; want once each", p, d)
	}
	m := scrapeSettled(t, httpClient(t), f.Addr)
	if v, _ := metric(m, "baton_adapter_loads_total", `adapter="sql"`, `outcome="ok"`); v != 2 {
		t.Errorf("baton_adapter_loads_total{adapter=sql,outcome=ok} = %v, want 2 (a prefill and a decode worker)", v)
	}
	if v, _ := metric(m, "baton_disagg_decisions_total", `decision="remote"`); v != 12 {
		t.Errorf("remote prefills = %v, want 12", v)
	}
}

// adapterUserKeys returns the block keys of a one-message chat prompt for
// adapter (the base model's: adapter empty).
func adapterUserKeys(adapter, prompt string) []uint64 {
	if adapter == "" {
		adapter = model
	}
	return blockkey.Append(nil, blockkey.Seed(adapter, ""), "<|user|>\n"+prompt+"\n", blockkey.DefaultBlockChars)
}

// The blocks a prefill worker pushes for an adapter's request are the
// adapter's: the decode worker holding the base model's blocks of the
// same prompt receives them all, and reports none cached; it then holds
// the adapter's blocks, which a later request for the adapter reuses.
func TestAdapterDisaggKVIsolated(t *testing.T) {
	f := startLoRADisagg(t, 1, 1, 2, 2, func(c *scheduler.Config) { c.Disaggregation.MinRemotePrefillTokens = 1 })
	c := oaClient(t, f.Addr)
	hc := httpClient(t)
	prompt := text("shared document", 4000)
	var dw *sim.Worker
	for _, w := range f.decode {
		dw = w
	}

	if r := chat(t, c, chatParams(prompt, 4)); !strings.Contains(r.route, "prefill=remote") {
		t.Fatalf("base model: route %q, want a remote prefill", r.route)
	}
	base, keys := adapterUserKeys("", prompt), adapterUserKeys("sql", prompt)
	if n := dw.Engine.Cache().Lookup(base); n != len(base) {
		t.Fatalf("decode worker holds %d of the base model's %d blocks", n, len(base))
	}
	before := scrapeSettled(t, hc, f.Addr)
	r := chat(t, c, adapterChat("sql", prompt))
	if !strings.Contains(r.route, "prefill=remote") || r.prefill == "" {
		t.Fatalf("sql: route %q, prefill worker %q; want a remote prefill", r.route, r.prefill)
	}
	if r.cached != 0 {
		t.Errorf("sql after the base model: %d cached tokens, want 0", r.cached)
	}
	after := scrapeSettled(t, hc, f.Addr)
	for _, k := range []struct {
		kind string
		want float64
	}{{"held", 0}, {"sent", float64(len(keys))}} {
		b, _ := metric(before, "baton_transfer_blocks_total", `kind="`+k.kind+`"`)
		a, _ := metric(after, "baton_transfer_blocks_total", `kind="`+k.kind+`"`)
		if a-b != k.want {
			t.Errorf("sql's transfer: %v blocks %s, want %v", a-b, k.kind, k.want)
		}
	}
	if n := dw.Engine.Cache().Lookup(keys); n != len(keys) {
		t.Errorf("decode worker holds %d of sql's %d blocks", n, len(keys))
	}
	if r := chat(t, c, adapterChat("sql", prompt)); r.cached == 0 {
		t.Errorf("sql again: route %q, no cached tokens; want its own blocks reused", r.route)
	}
}

// When only one side can hold the adapter: without prefill workers that
// take adapters, the decode worker holding it prefills the request itself;
// without decode workers that take adapters, the request is a 503
// no_worker_available saying so, not a 404 (the adapter exists).
func TestAdapterDisaggOneSide(t *testing.T) {
	t.Run("prefill workers without adapter slots", func(t *testing.T) {
		f := startLoRADisagg(t, 1, 1, 0, 2, nil)
		r := chat(t, oaClient(t, f.Addr), adapterChat("sql", text("no prefill slot", 6000)))
		if !strings.Contains(r.route, "prefill=local(adapter_unavailable)") || f.decode[r.worker] == nil || r.prefill != "" {
			t.Errorf("route %q, decode worker %q, prefill worker %q; want prefill=local(adapter_unavailable) on the decode worker", r.route, r.worker, r.prefill)
		}
		for _, w := range f.prefill {
			if n := w.Engine.Stats().Pushes; n != 0 {
				t.Errorf("a prefill worker without sql prefilled %d requests", n)
			}
		}
		if v, _ := metric(scrapeSettled(t, httpClient(t), f.Addr), "baton_fallbacks_total", `reason="adapter_unavailable"`); v != 1 {
			t.Errorf("baton_fallbacks_total{reason=adapter_unavailable} = %v, want 1", v)
		}
	})
	t.Run("decode workers without adapter slots", func(t *testing.T) {
		f := startLoRADisagg(t, 1, 1, 2, 0, nil)
		c := oaClient(t, f.Addr)
		_, err := c.Chat.Completions.New(ctxT(t, time.Minute), adapterChat("sql", text("no decode slot", 6000)))
		var e *openai.Error
		if !errors.As(err, &e) || e.StatusCode != http.StatusServiceUnavailable || e.Code != "no_worker_available" ||
			!strings.Contains(e.Message, "no decode worker") {
			t.Fatalf("got %v; want a 503 no_worker_available naming the decode workers", err)
		}
		if n := loads(f.prefill); n != 0 {
			t.Errorf("prefill workers loaded sql %d times for a request no decode worker could take", n)
		}
	})
}

// Between vLLM engines (NixlConnector), an adapter's request is prefilled
// on a prefill engine the adapter was loaded onto and decoded on a decode
// engine it was loaded onto, once each, both requests naming it; the
// prefill engine's blocks for it are its own, not the base model's.
func TestVLLMDisaggAdapter(t *testing.T) {
	hub := newPDHub(t)
	p0 := startPDEngine(t, hub, "p0", scheduler.KindVLLM, scheduler.RolePrefill)
	d0 := startPDEngine(t, hub, "d0", scheduler.KindVLLM, scheduler.RoleDecode)
	addr := startPDScheduler(t, "prefix_aware", []*pdEngine{p0, d0}, func(c *scheduler.Config) {
		c.Adapters = loraAdapters
		for i := range c.Workers {
			c.Workers[i].MaxLoRAs = 2
		}
	})
	prompt := text("nixl-lora", 3000)
	if r := pdChat(t, addr, prompt, false); r.prefill != "p0" || r.cached != 0 {
		t.Fatalf("base model: prefill worker %q, %d cached", r.prefill, r.cached)
	}
	c := oaClient(t, addr)
	for i, wantCached := range []bool{false, true} {
		r := chat(t, c, adapterChat("sql", prompt))
		if r.prefill != "p0" || r.worker != "d0" || !strings.Contains(r.route, "prefill=remote") {
			t.Fatalf("sql %d: prefill worker %q, decode worker %q, route %q; want p0 then d0", i, r.prefill, r.worker, r.route)
		}
		if wantCached != (r.cached > 0) {
			t.Errorf("sql %d: %d cached tokens; want some: %t (the base model's blocks are not sql's)", i, r.cached, wantCached)
		}
		if i == 0 && (!strings.Contains(r.route, "adapter=loaded") || !strings.Contains(r.route, "prefill_adapter=loaded")) {
			t.Errorf("sql %d: route %q, want adapter=loaded and prefill_adapter=loaded", i, r.route)
		}
		pre, dec := last(p0.received()), last(d0.received())
		if pre.field("model") != `"sql"` || dec.field("model") != `"sql"` || dec.id != pre.id {
			t.Errorf("sql %d: prefill asked for %s, decode for %s (ids %q, %q)", i, pre.field("model"), dec.field("model"), pre.id, dec.id)
		}
	}
	for _, e := range []*pdEngine{p0, d0} {
		e.mu.Lock()
		n := e.loads["sql"]
		e.mu.Unlock()
		if n != 1 {
			t.Errorf("%s: sql loaded %d times, want once", e.name, n)
		}
	}
}
