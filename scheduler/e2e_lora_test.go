package scheduler_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/openai/openaitest"
	"github.com/batonllm/baton/workers/sim"
)

// loraAdapters are the adapters of the LoRA tests, 64 MiB each.
var loraAdapters = []scheduler.AdapterConfig{
	{Name: "sql", BaseModel: model, Source: "/adapters/sql", Size: 64 << 20},
	{Name: "chat", BaseModel: model, Source: "/adapters/chat", Size: 64 << 20},
	{Name: "math", BaseModel: model, Source: "/adapters/math", Size: 64 << 20},
}

// startLoRAWorkers starts n simulated workers that can load loraAdapters
// into slots adapter slots, and returns them with their configuration.
func startLoRAWorkers(t *testing.T, n, slots int) ([]*sim.Worker, []scheduler.WorkerConfig) {
	t.Helper()
	var list []engine.Adapter
	for _, a := range loraAdapters {
		list = append(list, engine.Adapter{Name: a.Name, Base: a.BaseModel, Bytes: a.Size})
	}
	f, err := simfleet.StartWorkers(simfleet.Spec{
		Workers: n,
		Name:    shortName,
		Config: func(string, string) sim.Config {
			return sim.Config{TimeScale: fastScale, LoRA: sim.LoRA{Adapters: list, MaxLoRAs: slots}}
		},
	})
	if err != nil {
		t.Fatalf("start workers: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	for i := range f.Configs {
		f.Configs[i].MaxLoRAs = slots
	}
	return f.Workers, f.Configs
}

// loraPool waits for slow answers to health checks:
// a health check that times out on a loaded machine would make the holder
// unavailable, and the adapter rightly loaded elsewhere.
func loraPool() pool.Config {
	return pool.Config{HealthInterval: 2 * time.Second, HealthTimeout: 2 * time.Second}
}

func adapterChat(adapter, prompt string) openai.ChatCompletionNewParams {
	p := chatParams(prompt, 4)
	p.Model = adapter
	return p
}

// A burst of requests for an adapter no worker holds loads it once, onto
// one worker, and every request runs there; later ones find it held.
func TestAdapterBurstLoadsOnce(t *testing.T) {
	workers, cfgs := startLoRAWorkers(t, 4, 2)
	_, addr := startScheduler(t, scheduler.Config{
		Strategy: "least_outstanding", Pool: loraPool(), Workers: cfgs, Adapters: loraAdapters,
		Params: paramsThreshold(64),
	})
	c := oaClient(t, addr)

	where := map[string]int{}
	routes := map[string]int{}
	for _, r := range concurrentChats(t, c, 50, func(i int) openai.ChatCompletionNewParams {
		return adapterChat("sql", text(fmt.Sprint("burst", i), 200))
	}) {
		where[r.worker]++
		routes[r.route[strings.LastIndex(r.route, ";")+2:]]++
	}
	if len(where) != 1 {
		t.Fatalf("the burst ran on %v, want one worker", where)
	}
	holder := ""
	for w := range where {
		holder = w
	}
	if routes["adapter=loaded"]+routes["adapter=held"] != 50 || routes["adapter=loaded"] == 0 {
		t.Errorf("routes %v, want 50 with adapter=loaded or held, some loaded", routes)
	}
	loads := 0
	for _, w := range workers {
		n := w.Engine.LoRAStats().Loads
		loads += int(n)
		if name := w.Engine.Config().Name; name != holder && n != 0 {
			t.Errorf("worker %s loaded the adapter %d times; only %s serves it", name, n, holder)
		}
	}
	if loads != 1 {
		t.Errorf("engines loaded the adapter %d times, want 1", loads)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_adapter_loads_total", `adapter="sql"`, `outcome="ok"`); v != 1 {
		t.Errorf("baton_adapter_loads_total{adapter=sql,outcome=ok} = %v, want 1", v)
	}

	// Later requests find it held, on the same worker; base-model ones
	// go anywhere.
	for i := range 8 {
		r := chat(t, c, adapterChat("sql", text(fmt.Sprint("later", i), 200)))
		if r.worker != holder || !strings.HasSuffix(r.route, "adapter=held") {
			t.Errorf("later request: worker %s route %q, want %s and adapter=held", r.worker, r.route, holder)
		}
	}
	base := map[string]bool{}
	for i := range 8 {
		r := chat(t, c, chatParams(text(fmt.Sprint("base", i), 200), 4))
		base[r.worker] = true
		if strings.Contains(r.route, "adapter=") {
			t.Errorf("base-model route %q names an adapter", r.route)
		}
	}
	if len(base) < 2 {
		t.Errorf("base-model requests all went to %v, want several workers", base)
	}
}

// paramsThreshold is strategy parameters with a concurrency threshold.
func paramsThreshold(n int) routing.Params { return routing.Params{ConcurrencyThreshold: n} }

// With a worker's slots full, loading another adapter unloads the one
// used least lately.
func TestAdapterEvictsLeastRecentlyUsed(t *testing.T) {
	workers, cfgs := startLoRAWorkers(t, 1, 2)
	_, addr := startScheduler(t, scheduler.Config{Pool: loraPool(), Workers: cfgs, Adapters: loraAdapters})
	c := oaClient(t, addr)
	for i, a := range []string{"sql", "chat", "sql", "math"} {
		chat(t, c, adapterChat(a, text(fmt.Sprint("lru", i), 200)))
	}
	if got, want := strings.Join(workers[0].Engine.Adapters(), ","), "math,sql"; got != want {
		t.Errorf("engine holds %s, want %s", got, want)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_adapter_evictions_total"); v != 1 {
		t.Errorf("baton_adapter_evictions_total = %v, want 1", v)
	}
	// chat was evicted: it loads again, and evicts sql, now the least
	// recently used.
	r := chat(t, c, adapterChat("chat", text("again", 200)))
	if !strings.HasSuffix(r.route, "adapter=loaded") {
		t.Errorf("route %q, want adapter=loaded", r.route)
	}
	if got, want := strings.Join(workers[0].Engine.Adapters(), ","), "chat,math"; got != want {
		t.Errorf("engine holds %s, want %s", got, want)
	}
}

// A prompt the base model cached is not cached for an adapter of it, and
// kv_aware predicts no hit for it; the adapter's own prefix is cached.
func TestAdapterKVIsolated(t *testing.T) {
	_, cfgs := startLoRAWorkers(t, 1, 2)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "kv_aware", Pool: loraPool(), Workers: cfgs, Adapters: loraAdapters})
	c := oaClient(t, addr)
	prompt := text("shared system prompt", 2000)
	chat(t, c, chatParams(prompt, 4))
	eventually(t, 10*time.Second, func() error {
		if r := chat(t, c, chatParams(prompt, 4)); r.cached == 0 {
			return fmt.Errorf("base model: cached %d of %d", r.cached, r.prompt)
		}
		return nil
	})
	r := chat(t, c, adapterChat("sql", prompt))
	if r.cached != 0 || !strings.Contains(r.route, "predicted_hit=0.00") {
		t.Errorf("adapter request after the base model's: cached %d, route %q; want 0 cached, predicted_hit=0.00", r.cached, r.route)
	}
	eventually(t, 10*time.Second, func() error {
		if r := chat(t, c, adapterChat("sql", prompt)); r.cached == 0 {
			return fmt.Errorf("adapter: cached %d of %d", r.cached, r.prompt)
		}
		return nil
	})
}

// /v1/models lists the adapters with their parent.
func TestAdapterModelsList(t *testing.T) {
	_, cfgs := startLoRAWorkers(t, 1, 1)
	_, addr := startScheduler(t, scheduler.Config{Pool: loraPool(), Workers: cfgs, Adapters: loraAdapters})
	res := do(t, httpClient(t), http.MethodGet, "http://"+addr+"/v1/models", "", nil)
	var list struct {
		Data []struct{ ID, Parent string }
	}
	if err := json.Unmarshal(res.body, &list); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, m := range list.Data {
		got[m.ID] = m.Parent
	}
	want := map[string]string{model: "", "sql": model, "chat": model, "math": model}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("/v1/models = %v, want %v", got, want)
	}
	r := do(t, httpClient(t), http.MethodPost, "http://"+addr+"/v1/chat/completions",
		`{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, map[string]string{"Content-Type": "application/json"})
	if _, _, code, _ := decodeError(t, r.body); r.status != http.StatusNotFound || code != "model_not_found" {
		t.Errorf("unknown adapter: %d %s, want 404 model_not_found", r.status, r.body)
	}
}

// loraEngine is a vLLM-like engine with runtime LoRA updating: it serves
// the adapters loaded through /v1/load_lora_adapter, lists them in
// /v1/models with their parent, and records the load and unload bodies.
type loraEngine struct {
	srv      *httptest.Server
	failLoad bool
	// gate, when set, holds every load until it is closed; hold every
	// completion.
	gate, hold chan struct{}

	mu      sync.Mutex
	loaded  []string
	bodies  []string // "load {...}" or "unload {...}", as received
	served  map[string]int
	missing int // completions for a model it did not hold
}

func startLoRAEngine(t *testing.T, failLoad bool) *loraEngine {
	t.Helper()
	e := &loraEngine{failLoad: failLoad, served: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		e.mu.Lock()
		defer e.mu.Unlock()
		data := []map[string]any{{"id": model, "object": "model", "root": model, "parent": nil}}
		for _, a := range e.loaded {
			data = append(data, map[string]any{"id": a, "object": "model", "root": "/adapters/" + a, "parent": model})
		}
		openaitest.Models(w, "application/json", data...)
	})
	lora := func(unload bool) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			if e.gate != nil && !unload {
				<-e.gate
			}
			var req struct {
				Name string `json:"lora_name"`
				Path string `json:"lora_path"`
			}
			e.mu.Lock()
			defer e.mu.Unlock()
			verb := "load"
			if unload {
				verb = "unload"
			}
			e.bodies = append(e.bodies, verb+" "+string(b))
			if err := json.Unmarshal(b, &req); err != nil || req.Name == "" || (!unload && req.Path == "") {
				http.Error(w, `{"object":"error","message":"bad body","type":"BadRequestError","code":400}`, http.StatusBadRequest)
				return
			}
			switch {
			case unload && !slices.Contains(e.loaded, req.Name):
				http.Error(w, `{"object":"error","message":"not found","type":"NotFoundError","code":404}`, http.StatusNotFound)
			case unload:
				e.loaded = slices.DeleteFunc(e.loaded, func(s string) bool { return s == req.Name })
				fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", req.Name)
			case e.failLoad:
				http.Error(w, `{"object":"error","message":"no such adapter path","type":"InternalServerError","code":500}`, http.StatusInternalServerError)
			default:
				e.loaded = append(e.loaded, req.Name)
				fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
			}
		}
	}
	mux.HandleFunc("POST /v1/load_lora_adapter", lora(false))
	mux.HandleFunc("POST /v1/unload_lora_adapter", lora(true))
	mux.HandleFunc("GET /metrics", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Model string }
		json.NewDecoder(r.Body).Decode(&req)
		if e.hold != nil {
			<-e.hold
		}
		e.mu.Lock()
		ok := req.Model == model || slices.Contains(e.loaded, req.Model)
		if ok {
			e.served[req.Model]++
		} else {
			e.missing++
		}
		e.mu.Unlock()
		if !ok {
			http.Error(w, `{"object":"error","message":"The model does not exist.","type":"NotFoundError","code":404}`, http.StatusNotFound)
			return
		}
		c := openaitest.Completion{ID: "chatcmpl-1", Model: req.Model, Created: 1, Chat: true}
		openaitest.WriteJSON(w, http.StatusOK, "application/json", c.Body(c.Choice("ok", "stop", nil), openaitest.Usage(5, 1, nil, false), nil))
	})
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *loraEngine) calls() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.bodies)
}

// Against vLLM-like engines: a load that fails is tried on the next
// worker; a full worker unloads its least recently used adapter first;
// when every load fails the request is a 503, and never hangs.
func TestAdapterVLLMLoadAndUnload(t *testing.T) {
	bad, good := startLoRAEngine(t, true), startLoRAEngine(t, false)
	_, addr := startScheduler(t, scheduler.Config{Pool: loraPool(), Adapters: loraAdapters, Workers: []scheduler.WorkerConfig{
		{Name: "bad", Kind: scheduler.KindVLLM, Address: bad.srv.URL, MaxLoRAs: 1},
		{Name: "good", Kind: scheduler.KindVLLM, Address: good.srv.URL, MaxLoRAs: 1},
	}})
	c := oaClient(t, addr)

	for i, a := range []string{"sql", "sql", "chat"} {
		r := chat(t, c, adapterChat(a, fmt.Sprint("question ", i)))
		if r.worker != "good" {
			t.Errorf("%s: served by %q, want good", a, r.worker)
		}
	}
	want := []string{
		`load {"lora_name":"sql","lora_path":"/adapters/sql"}`,
		`unload {"lora_name":"sql"}`,
		`load {"lora_name":"chat","lora_path":"/adapters/chat"}`,
	}
	if got := good.calls(); !slices.Equal(got, want) {
		t.Errorf("good engine's adapter calls:\n got %q\nwant %q", got, want)
	}
	if got := bad.calls(); len(got) != 2 || got[0] != `load {"lora_name":"sql","lora_path":"/adapters/sql"}` {
		t.Errorf("failing engine's adapter calls: %q, want a load of sql, then of chat", got)
	}
	if bad.missing+good.missing != 0 {
		t.Errorf("%d completions reached an engine without their adapter", bad.missing+good.missing)
	}

	// With every load failing, a request for an adapter nobody holds is
	// a 503.
	good.mu.Lock()
	good.failLoad = true
	good.mu.Unlock()
	r := do(t, httpClient(t), http.MethodPost, "http://"+addr+"/v1/chat/completions",
		`{"model":"math","messages":[{"role":"user","content":"hi"}]}`, map[string]string{"Content-Type": "application/json"})
	if _, _, code, _ := decodeError(t, r.body); r.status != http.StatusServiceUnavailable || code != "no_worker_available" {
		t.Errorf("math with every load failing: %d %s, want 503 no_worker_available", r.status, r.body)
	}
	m := scrapeSettled(t, httpClient(t), addr)
	if v, _ := metric(m, "baton_adapter_loads_total", `worker="bad"`, `outcome="failed"`); v != 3 {
		t.Errorf("failed loads on bad = %v, want 3", v)
	}
}

// A burst of requests for a cold adapter, all arriving while its load is
// under way, waits for that one load.
func TestAdapterBurstWaitsForOneLoad(t *testing.T) {
	gate := make(chan struct{})
	var engines []*loraEngine
	var cfgs []scheduler.WorkerConfig
	for i := range 3 {
		e := startLoRAEngine(t, false)
		e.gate = gate
		engines = append(engines, e)
		cfgs = append(cfgs, scheduler.WorkerConfig{Name: fmt.Sprint("v", i), Kind: scheduler.KindVLLM, Address: e.srv.URL, MaxLoRAs: 1})
	}
	_, addr := startScheduler(t, scheduler.Config{Pool: loraPool(), Adapters: loraAdapters, Workers: cfgs, Params: paramsThreshold(64)})
	c := oaClient(t, addr)
	hc := httpClient(t)

	var wg sync.WaitGroup
	var mu sync.Mutex
	where := map[string]int{}
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := chat(t, c, adapterChat("sql", fmt.Sprint("burst ", i)))
			mu.Lock()
			where[r.worker]++
			mu.Unlock()
		}()
	}
	eventually(t, 20*time.Second, func() error {
		if v, _ := metric(scrape(t, hc, addr), "baton_adapter_load_waiting"); v != 50 {
			return fmt.Errorf("%v requests waiting for the load, want 50", v)
		}
		return nil
	})
	close(gate)
	wg.Wait()
	loads := 0
	for _, e := range engines {
		loads += len(e.calls())
		if e.missing != 0 {
			t.Errorf("%d completions reached an engine without the adapter", e.missing)
		}
	}
	if loads != 1 || len(where) != 1 {
		t.Errorf("%d load calls, requests served by %v; want 1 load, one worker", loads, where)
	}
}

// When every holder of an adapter is at the concurrency threshold, the
// adapter is loaded onto another worker, which takes the request.
func TestAdapterLoadedPastThreshold(t *testing.T) {
	hold := make(chan struct{})
	v0, v1 := startLoRAEngine(t, false), startLoRAEngine(t, false)
	v0.hold, v1.hold = hold, hold
	_, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Pool: loraPool(), Adapters: loraAdapters, Params: paramsThreshold(2),
		Workers: []scheduler.WorkerConfig{
			{Name: "v0", Kind: scheduler.KindVLLM, Address: v0.srv.URL, MaxLoRAs: 1},
			{Name: "v1", Kind: scheduler.KindVLLM, Address: v1.srv.URL, MaxLoRAs: 1},
		}})
	c := oaClient(t, addr)
	hc := httpClient(t)
	type res struct{ worker, route string }
	results := make(chan res, 3)
	send := func(i int) {
		go func() {
			r := chat(t, c, adapterChat("sql", fmt.Sprint("question ", i)))
			results <- res{r.worker, r.route}
		}()
	}
	send(0)
	send(1)
	eventually(t, 20*time.Second, func() error {
		m := scrape(t, hc, addr)
		if v, _ := metric(m, "baton_worker_in_flight", `worker="v0"`); v < 2 {
			if w, _ := metric(m, "baton_worker_in_flight", `worker="v1"`); w < 2 {
				return fmt.Errorf("in flight: v0 %v, v1 %v; want 2 on the holder", v, w)
			}
		}
		return nil
	})
	send(2)
	eventually(t, 20*time.Second, func() error {
		if n := len(v0.calls()) + len(v1.calls()); n != 2 {
			return fmt.Errorf("%d loads, want 2", n)
		}
		return nil
	})
	close(hold)
	got := map[string]int{}
	for range 3 {
		r := <-results
		got[r.worker+" "+r.route[strings.LastIndex(r.route, ";")+2:]]++
	}
	if len(v0.calls()) != 1 || len(v1.calls()) != 1 {
		t.Errorf("loads: v0 %q, v1 %q; want one each", v0.calls(), v1.calls())
	}
	holders := 0
	for k, n := range got {
		if strings.HasSuffix(k, "adapter=loaded") {
			holders += n
		}
	}
	if len(got) < 2 || holders < 2 {
		t.Errorf("requests by worker and route %v: want both workers, each with one adapter=loaded", got)
	}
}

// An adapter serving a request is never unloaded: with the only slot's
// adapter in use, a request for another waits in the queue while the
// request in flight completes; once it has, the slot is freed for the
// other adapter.
func TestAdapterInUseNeverUnloaded(t *testing.T) {
	e := startLoRAEngine(t, false)
	e.hold = make(chan struct{})
	s, addr := startScheduler(t, scheduler.Config{Pool: loraPool(), Adapters: loraAdapters, Workers: []scheduler.WorkerConfig{
		{Name: "e0", Kind: scheduler.KindVLLM, Address: e.srv.URL, MaxLoRAs: 1},
	}})
	c := oaClient(t, addr)
	inFlight := make(chan chatResult, 1)
	go func() { inFlight <- chat(t, c, adapterChat("sql", "a long question")) }()
	eventually(t, 20*time.Second, func() error {
		if n := s.Pool.Snapshot().Worker("e0").InFlight(); n != 1 {
			return fmt.Errorf("%d requests in flight on e0, want sql's", n)
		}
		return nil
	})
	waiting := make(chan chatResult, 1)
	go func() { waiting <- chat(t, c, adapterChat("chat", "hi")) }()
	eventually(t, 20*time.Second, func() error {
		if v, _ := metric(scrape(t, httpClient(t), addr), "baton_queue_depth"); v != 1 {
			return fmt.Errorf("queue depth %v, want chat's request waiting for the slot", v)
		}
		return nil
	})
	if got := e.calls(); len(got) != 1 {
		t.Errorf("adapter calls while sql serves its request: %q, want sql's load alone", got)
	}
	close(e.hold)
	if got := <-inFlight; got.content == "" {
		t.Errorf("sql's request in flight: empty answer")
	}
	if r := <-waiting; !strings.HasSuffix(r.route, "adapter=loaded") {
		t.Errorf("chat after sql's request ended: route %q, want adapter=loaded", r.route)
	}
	want := []string{
		`load {"lora_name":"sql","lora_path":"/adapters/sql"}`,
		`unload {"lora_name":"sql"}`,
		`load {"lora_name":"chat","lora_path":"/adapters/chat"}`,
	}
	if got := e.calls(); !slices.Equal(got, want) {
		t.Errorf("adapter calls:\n got %q\nwant %q", got, want)
	}
	if e.missing != 0 {
		t.Errorf("%d completions reached the engine without their adapter", e.missing)
	}
}

// A request for an adapter when no worker of its base model is available
// at all is told so, as a base-model request is, not that the adapter
// cannot be loaded; while a worker is up, the adapter is loaded and served.
func TestAdapterNoWorkerAvailable(t *testing.T) {
	workers, cfgs := startLoRAWorkers(t, 2, 1)
	s, addr := startScheduler(t, scheduler.Config{Strategy: "least_outstanding", Pool: fastPool(), Adapters: loraAdapters, Workers: cfgs})
	c := oaClient(t, addr)
	if r := chat(t, c, adapterChat("sql", text("up", 100))); !strings.Contains(r.route, "adapter=loaded") {
		t.Errorf("route %q, want adapter=loaded", r.route)
	}
	for _, w := range workers {
		w.Close()
	}
	eventually(t, 20*time.Second, func() error {
		for _, w := range s.Pool.Snapshot().Workers {
			if w.Available() {
				return fmt.Errorf("%s still available", w.Name)
			}
		}
		return nil
	})
	hc := httpClient(t)
	for _, adapter := range []string{"sql", "math"} { // held before, and never loaded
		body := `{"model":"` + adapter + `","messages":[{"role":"user","content":"hi"}]}`
		got := do(t, hc, http.MethodPost, "http://"+addr+"/v1/chat/completions", body, nil)
		if got.status != http.StatusServiceUnavailable {
			t.Fatalf("%s: status %d, want 503 (body %s)", adapter, got.status, got.body)
		}
		_, _, code, msg := decodeError(t, got.body)
		if code != "no_worker_available" || !strings.Contains(msg, "no worker is available") || strings.Contains(msg, "load") {
			t.Errorf("%s: code %q message %q, want no_worker_available saying no worker is available", adapter, code, msg)
		}
	}
}
