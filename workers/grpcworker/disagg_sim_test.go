package grpcworker_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/sim"
)

func startSim(t *testing.T, role string) (*sim.Worker, *grpcworker.Client) {
	t.Helper()
	w, err := sim.Start(sim.Config{Role: role, TimeScale: 1000}, "127.0.0.1:0", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	c, err := grpcworker.Dial(w.GRPCAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return w, c
}

// readAll returns a function reading a stream to its Final event:
// readAll(t)(c.Generate(ctx, req)).
func readAll(t *testing.T) func(engine.Stream, error) (string, *engine.Final) {
	return func(st engine.Stream, err error) (string, *engine.Final) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var text strings.Builder
		for {
			ev, err := st.Recv()
			if errors.Is(err, io.EOF) {
				t.Fatal("EOF before Final")
			}
			if err != nil {
				t.Fatal(err)
			}
			text.WriteString(ev.Text)
			if ev.Final != nil {
				return text.String(), ev.Final
			}
		}
	}
}

// A simulated fleet driven through engine.Disaggregator: prefill on one
// worker, decode on another, the same text as colocated.
func TestDisaggregatorWithSimWorkers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, pc := startSim(t, sim.RolePrefill)
	d, dc := startSim(t, sim.RoleDecode)
	_, cc := startSim(t, sim.RoleBoth)
	var p, dd engine.Disaggregator = pc, dc

	req := &engine.Request{ID: "r", Model: "llama-3.1-8b", Prompt: strings.Repeat("0123456789abcdef", 4*25) + "?", MaxTokens: 16}
	res, err := p.Prefill(ctx, &engine.PrefillRequest{Request: req, TransferID: "x1", DecodeAddr: d.GRPCAddr, TransferTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if res.Skipped || res.BlocksSent != 25 || res.BytesSent != int64(25*d.Engine.BlockBytes()) {
		t.Errorf("Prefill = %+v", res)
	}
	text, final := readAll(t)(dd.Decode(ctx, req, "x1", time.Second))
	want, wantFinal := readAll(t)(cc.Generate(ctx, req))
	if text != want || final.CachedTokens != 25*16 || final.CompletionTokens != wantFinal.CompletionTokens {
		t.Errorf("Decode %q %+v, colocated %q %+v", text, final, want, wantFinal)
	}
}
