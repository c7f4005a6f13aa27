package sim

import (
	"context"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

func loraConfig(slots int) Config {
	return Config{Models: []string{testModel}, LoRA: LoRA{MaxLoRAs: slots, Adapters: []engine.Adapter{
		{Name: "sql", Base: testModel, Bytes: 64 << 20},
		{Name: "chat", Base: testModel, Bytes: 64 << 20},
		{Name: "math", Base: testModel, Bytes: 128 << 20},
	}}}
}

func genModel(t *testing.T, e *Engine, model, prompt string) (result, error) {
	t.Helper()
	st, err := e.Generate(context.Background(), &engine.Request{Model: model, Prompt: prompt, MaxTokens: 2})
	if err != nil {
		return result{}, err
	}
	return collect(t, st)
}

// Concurrent requests for an adapter not in a slot wait for one load.
func TestLoRALoadsOnceForABurst(t *testing.T) {
	e := newEngine(t, loraConfig(2))
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := genModel(t, e, "sql", strings.Repeat("q", 64+i))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("Generate: %v", err)
		}
	}
	st := e.LoRAStats()
	if st.Loads != 1 {
		t.Errorf("loads = %d, want 1", st.Loads)
	}
	// 64 MiB over the H100's PCIe link, as modelled.
	want, _ := e.loraLoadTime(engine.Adapter{Bytes: 64 << 20})
	if st.LoadSeconds != want || want <= 0 {
		t.Errorf("load seconds = %v, want %v (> 0)", st.LoadSeconds, want)
	}
	if got := e.Adapters(); len(got) != 1 || got[0] != "sql" {
		t.Errorf("Adapters() = %v, want [sql]", got)
	}
}

// With its slots full, a load evicts the adapter used least lately.
func TestLoRAEvictsLeastRecentlyUsed(t *testing.T) {
	e := newEngine(t, loraConfig(2))
	for _, m := range []string{"sql", "chat", "sql", "math"} {
		if _, err := genModel(t, e, m, strings.Repeat("p", 80)); err != nil {
			t.Fatalf("Generate(%s): %v", m, err)
		}
	}
	if got, want := strings.Join(e.Adapters(), ","), "math,sql"; got != want {
		t.Errorf("adapters held = %s, want %s (chat, least recently used, evicted)", got, want)
	}
	if st := e.LoRAStats(); st.Loads != 3 || st.Evictions != 1 {
		t.Errorf("loads, evictions = %d, %d; want 3, 1", st.Loads, st.Evictions)
	}
	if _, err := genModel(t, e, "tax", "x"); err == nil {
		t.Errorf("Generate(unknown adapter) succeeded")
	}
}

// A step pays for each distinct adapter its batch runs: a batch mixing
// two adapters with the base model costs two adapters' time, one whose
// sequences share an adapter costs one, and a sequence neither
// prefilling nor decoding this step costs nothing.
func TestLoRAMixedBatchCostsMore(t *testing.T) {
	// An engine value with a started engine's configuration but no step
	// loop: its run is this test's to set.
	e := &Engine{cfg: newEngine(t, loraConfig(3)).cfg, batch: &Batch[*seq]{}}
	step := e.cfg.LoRA.StepSeconds
	if step <= 0 {
		t.Fatalf("LoRA.StepSeconds = %v, want the default", step)
	}
	for _, tc := range []struct {
		name string
		run  []*seq
		want float64
	}{
		{"base only", []*seq{{Seq: Seq{Decode: true}}, {Seq: Seq{Decode: true}}, {Seq: Seq{Chunk: 64}}}, 0},
		{"one adapter", []*seq{{adapter: "sql", Seq: Seq{Decode: true}}, {adapter: "sql", Seq: Seq{Chunk: 64}}, {Seq: Seq{Decode: true}}}, step},
		{"mixed", []*seq{{Seq: Seq{Decode: true}}, {adapter: "sql", Seq: Seq{Decode: true}}, {adapter: "chat", Seq: Seq{Chunk: 64}}}, 2 * step},
		{"idle adapter", []*seq{{adapter: "sql", Seq: Seq{Decode: true}}, {adapter: "chat"}}, step},
	} {
		e.batch.Run = tc.run
		if got := e.loraStepSeconds(); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("%s: loraStepSeconds() = %v, want %v", tc.name, got, tc.want)
		}
	}
	// End to end, one request at a time so that batching cannot vary
	// with the machine's timing: the same prompts through two adapters
	// take longer than through the base model.
	run := func(models ...string) float64 {
		e := newEngine(t, loraConfig(3))
		before := e.Stats().ModelledSeconds
		for i, m := range models {
			if _, err := genModel(t, e, m, strings.Repeat(string(rune('a'+i)), 64)); err != nil {
				t.Fatal(err)
			}
		}
		return e.Stats().ModelledSeconds - before
	}
	base := run(testModel, testModel, testModel)
	mixed := run(testModel, "sql", "chat")
	if !(mixed > base) {
		t.Errorf("modelled seconds: through adapters %v, base only %v; want more through adapters", mixed, base)
	}
}

func TestLoRAConfigErrors(t *testing.T) {
	for _, tt := range []struct {
		lora LoRA
		want string
	}{
		{LoRA{Adapters: []engine.Adapter{{Base: testModel}}}, "lora.adapters[0].name: required"},
		{LoRA{Adapters: []engine.Adapter{{Name: "a", Base: "other"}}}, "lora.adapters[0].base:"},
		{LoRA{Adapters: []engine.Adapter{{Name: testModel, Base: testModel}}}, "lora.adapters[0].name:"},
		{LoRA{Adapters: []engine.Adapter{{Name: "a", Base: testModel}, {Name: "a", Base: testModel}}}, "lora.adapters[1].name:"},
		{LoRA{MaxLoRAs: -1}, "lora.max_loras:"},
	} {
		err := Config{Models: []string{testModel}, LoRA: tt.lora}.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
			t.Errorf("Validate(%+v) = %v, want %q…", tt.lora, err, tt.want)
		}
	}
}

func TestLoRAMetrics(t *testing.T) {
	e := newEngine(t, loraConfig(1))
	m := NewMetrics(nil)
	m.Engine(e)
	for _, a := range []string{"sql", "chat"} {
		if _, err := genModel(t, e, a, strings.Repeat("m", 70)); err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]float64{}
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, mm := range mf.GetMetric() {
			if c := mm.GetCounter(); c != nil {
				got[mf.GetName()] = c.GetValue()
			} else if g := mm.GetGauge(); g != nil {
				got[mf.GetName()] = g.GetValue()
			}
		}
	}
	want, _ := e.loraLoadTime(engine.Adapter{Bytes: 64 << 20})
	for name, v := range map[string]float64{
		"baton_worker_adapter_loads_total": 2, "baton_worker_adapter_evictions_total": 1,
		"baton_worker_adapters_held": 1, "baton_worker_adapter_load_modelled_seconds_total": 2 * want,
	} {
		if got[name] != v {
			t.Errorf("%s = %v, want %v", name, got[name], v)
		}
	}
}

// The worker tells the adapters it holds, and its slots, in Info and in
// its load reports: a load and an eviction it did itself show in the next
// report; a worker that serves no adapter says nothing of them.
func TestLoRAReportedOverGRPC(t *testing.T) {
	cfg := loraConfig(1)
	cfg.LoadInterval = time.Millisecond
	e := newEngine(t, cfg)
	c := workerpb.NewWorkerClient(serve(t, e))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := c.Info(ctx, &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetAdapters() == nil || len(info.GetAdapters().GetNames()) != 0 || info.GetMaxLoras() != 1 {
		t.Errorf("Info adapters %v, max_loras %d; want an empty set and 1", info.GetAdapters(), info.GetMaxLoras())
	}
	w, err := c.Watch(ctx, &workerpb.WatchRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if a := first.GetSnapshot().GetLoad().GetAdapters(); a == nil || len(a.GetNames()) != 0 {
		t.Errorf("snapshot adapters %v, want an empty set", a)
	}
	// held waits for a load report naming exactly want.
	held := func(want string) {
		t.Helper()
		for {
			ev, err := w.Recv()
			if err != nil {
				t.Fatalf("watch: %v (waiting for adapters %s)", err, want)
			}
			if l := ev.GetLoad(); l != nil && strings.Join(l.GetAdapters().GetNames(), ",") == want {
				return
			}
		}
	}
	for _, a := range []string{"sql", "chat"} {
		if _, err := genModel(t, e, a, strings.Repeat("r", 200)); err != nil {
			t.Fatal(err)
		}
		held(a) // one slot: chat evicted sql
	}
	info, err = c.Info(ctx, &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(info.GetAdapters().GetNames(), ","); got != "chat" {
		t.Errorf("Info adapters %q, want chat", got)
	}

	plain := workerpb.NewWorkerClient(serve(t, newEngine(t, Config{Models: []string{testModel}})))
	info, err = plain.Info(ctx, &workerpb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetAdapters() != nil || info.GetMaxLoras() != 0 {
		t.Errorf("a worker without adapters reports %v, max_loras %d", info.GetAdapters(), info.GetMaxLoras())
	}
}
