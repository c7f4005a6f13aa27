package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/sim"
)

// startSlotBound starts one simulated worker in real time with one adapter
// slot, behind a scheduler with queue fc, and has a streaming request for
// sql hold that slot: its thousands of tokens outlast the test, until the
// returned function cancels it (its client goes away).
func startSlotBound(t *testing.T, fc frontend.Config) (addr string, release func()) {
	t.Helper()
	var list []engine.Adapter
	for _, a := range loraAdapters {
		list = append(list, engine.Adapter{Name: a.Name, Base: a.BaseModel, Bytes: a.Size})
	}
	f, err := simfleet.StartWorkers(simfleet.Spec{
		Workers: 1,
		Name:    shortName,
		Config: func(string, string) sim.Config {
			return sim.Config{TimeScale: 1, LoRA: sim.LoRA{Adapters: list, MaxLoRAs: 1}}
		},
	})
	if err != nil {
		t.Fatalf("start workers: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	f.Configs[0].MaxLoRAs = 1
	fc.Models = nil
	_, addr = startScheduler(t, scheduler.Config{Config: fc, Pool: loraPool(), Workers: f.Configs, Adapters: loraAdapters})

	ctx, cancel := context.WithCancel(ctxT(t, time.Minute))
	c := oaClient(t, addr)
	stream := c.Chat.Completions.NewStreaming(ctx, adapterChat("sql", "hold the slot"),
		option.WithJSONSet("max_tokens", 8000))
	t.Cleanup(func() { stream.Close() })
	if !stream.Next() {
		cancel()
		t.Fatalf("sql's stream: no first chunk: %v", stream.Err())
	}
	return addr, cancel
}

// pending is a request in flight from a goroutine.
type pending struct {
	resp *http.Response
	err  error
}

func sendAdapter(c openai.Client, ctx context.Context, adapter string) <-chan pending {
	done := make(chan pending, 1)
	go func() {
		var p pending
		_, p.err = c.Chat.Completions.New(ctx, adapterChat(adapter, "a question"), option.WithResponseInto(&p.resp))
		done <- p
	}()
	return done
}

// With the only slot's adapter serving a request, a request for another
// adapter waits in the queue, not answered at once; once the request
// holding the slot ends, the idle adapter is evicted and the other loaded
// and served.
func TestAdapterWaitsForBusySlot(t *testing.T) {
	addr, release := startSlotBound(t, frontend.Config{MaxQueue: 4, QueueTimeout: 30 * time.Second})
	hc := httpClient(t)
	chatDone := sendAdapter(oaClient(t, addr), ctxT(t, time.Minute), "chat")
	eventually(t, 20*time.Second, func() error {
		select {
		case p := <-chatDone:
			t.Fatalf("chat answered while sql's request holds the only slot: %v", p.err)
		default:
		}
		if v, _ := metric(scrape(t, hc, addr), "baton_queue_depth"); v != 1 {
			return fmt.Errorf("queue depth %v, want chat's request waiting", v)
		}
		return nil
	})
	release()
	p := <-chatDone
	if p.err != nil {
		t.Fatalf("chat after sql's request ended: %v", p.err)
	}
	if route := p.resp.Header.Get("X-Baton-Route"); !strings.HasSuffix(route, "adapter=loaded") {
		t.Errorf("chat's route %q, want adapter=loaded", route)
	}
	m := scrapeSettled(t, hc, addr)
	if v, _ := metric(m, "baton_adapter_evictions_total"); v != 1 {
		t.Errorf("baton_adapter_evictions_total = %v, want 1 (sql, once idle)", v)
	}
	if v, _ := metric(m, "baton_queue_depth"); v != 0 {
		t.Errorf("baton_queue_depth = %v after the wait, want 0", v)
	}
}

// A request waiting for a busy slot past queue_timeout is a 429, as for
// capacity; the request holding the slot is not disturbed.
func TestAdapterSlotWaitTimesOut(t *testing.T) {
	addr, release := startSlotBound(t, frontend.Config{MaxQueue: 4, QueueTimeout: 200 * time.Millisecond})
	defer release()
	start := time.Now()
	p := <-sendAdapter(oaClient(t, addr), ctxT(t, time.Minute), "chat")
	var e *openai.Error
	if !errors.As(p.err, &e) || e.StatusCode != http.StatusTooManyRequests || e.Code != "overloaded" || e.Response.Header.Get("Retry-After") == "" {
		t.Fatalf("chat while sql holds the only slot: %v, want 429 overloaded with Retry-After", p.err)
	}
	if d := time.Since(start); d < 200*time.Millisecond {
		t.Errorf("answered after %v, before the 200ms queue timeout", d)
	}
	if v, _ := metric(scrape(t, httpClient(t), addr), "baton_queue_rejections_total", `reason="timeout"`); v != 1 {
		t.Errorf("queue timeouts = %v, want 1", v)
	}
}
