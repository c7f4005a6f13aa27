package replica

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/batonllm/baton/workers/engine"
)

// loads are reports as scrapes give them: every field set, none (an
// engine whose page had no load, only its block size), LoRA read with no
// adapter running, a fraction that is no round number.
var loads = []Load{
	{Worker: "vllm-0", At: time.Date(2026, 12, 4, 22, 0, 0, 1, time.UTC).UnixNano(), Report: engine.Load{
		Running: 7, Waiting: 3, HasLoad: true, KVUsage: 0.4375, HasKVUsage: true, BlockSize: 16, GPUBlocks: 52_000,
		KVTokens: 832_000, Slots: 4, Adapters: []string{"fr", "sql-lora"}, MaxLoRAs: 8, HasLoRA: true}},
	{Worker: "w", Report: engine.Load{BlockSize: 32}},
	{Worker: "sglang-3:dp1", At: 1, Report: engine.Load{HasLoad: true, HasLoRA: true, MaxLoRAs: 2, KVUsage: 1.0 / 3, HasKVUsage: true}},
}

func TestLoadRoundTrip(t *testing.T) {
	for _, l := range loads {
		got, err := decodeLoad(encodeLoad(nil, l))
		if err != nil {
			t.Fatalf("%s: %v", l.Worker, err)
		}
		if diff := cmp.Diff(l, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("%s (-sent +decoded):\n%s", l.Worker, diff)
		}
	}
}

// A replica that reads only decisions skips a load report as a message
// of an unknown format, applying nothing.
func TestLoadIsNoDecision(t *testing.T) {
	n, err := decode(encodeLoad(nil, loads[0]), func(e Entry) { t.Errorf("applied %v", e) })
	if err == nil || n != 0 {
		t.Errorf("decode of a load report: %d entries, err %v; want none and an error", n, err)
	}
}

func FuzzDecodeLoad(f *testing.F) {
	for _, l := range loads {
		f.Add(encodeLoad(nil, l))
	}
	f.Add([]byte{formatLoad})
	f.Add([]byte{formatLoad, 1, 'w', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xf8, 0x7f})
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := decodeLoad(b)
		if err != nil {
			return
		}
		again, err := decodeLoad(encodeLoad(nil, l))
		if err != nil {
			t.Fatalf("%+v decoded, but not once encoded again: %v", l, err)
		}
		if diff := cmp.Diff(l, again, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("decoded, encoded and decoded again (-first +second):\n%s", diff)
		}
	})
}

// Three replicas: a load report one relays reaches the two others, not
// itself, between decisions that still arrive; a replica without Listen
// relays nothing and does not fail.
func TestPeersRelayLoad(t *testing.T) {
	got := map[string]chan Load{}
	edit := func(id string) func(*Config) {
		got[id] = make(chan Load, 16)
		return func(c *Config) { c.ApplyLoad = func(l Load) { got[id] <- l } }
	}
	a, ao := newListening(t, "", "a", edit("a"))
	b, bo := newListening(t, "", "b", edit("b"))
	c, co := newListening(t, "", "c", edit("c"))
	connect(t, []*peer{a, b, c}, []*peerObs{ao, bo, co})
	e := Entry{Worker: "w1", Keys: []uint64{1, 2}, Pending: 1, At: 42}
	a.Publish(e)
	a.PublishLoad(loads[0])
	a.Publish(e)
	for _, p := range []*peer{b, c} {
		p.expect(t, e)
		select {
		case l := <-got[p.ID()]:
			if diff := cmp.Diff(loads[0], l, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("%s applied (-relayed +applied):\n%s", p.ID(), diff)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the load report never applied", p.ID())
		}
		p.expect(t, e)
	}
	select {
	case l := <-got["a"]:
		t.Errorf("a applied its own report %+v", l)
	default:
	}
	if _, _, r := bo.get(); r[ViaPeer] != 2 {
		t.Errorf("b received %d decisions straight, want 2 (the report is none)", r[ViaPeer])
	}
	alone := newPeer(t, "", "alone", func(c *Config) { c.Client = nil; c.Listen = "127.0.0.1:0" })
	alone.PublishLoad(loads[1])
}
