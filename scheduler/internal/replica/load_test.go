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
	for _, batch := range [][]Load{loads, loads[:1], loads[1:2]} {
		var got []Load
		n, err := decodeLoads(encodeLoads(nil, batch), func(l Load) { got = append(got, l) })
		if err != nil || n != len(batch) {
			t.Fatalf("%d reports: decoded %d, err %v", len(batch), n, err)
		}
		if diff := cmp.Diff(batch, got, cmpopts.EquateEmpty()); diff != "" {
			t.Errorf("(-sent +decoded):\n%s", diff)
		}
	}
}

// A replica that reads only decisions skips a frame of load reports as a
// message of an unknown format, applying nothing.
func TestLoadIsNoDecision(t *testing.T) {
	n, err := decode(encodeLoads(nil, loads), func(e Entry) { t.Errorf("applied %v", e) })
	if err == nil || n != 0 {
		t.Errorf("decode of load reports: %d entries, err %v; want none and an error", n, err)
	}
}

func FuzzDecodeLoads(f *testing.F) {
	f.Add(encodeLoads(nil, loads))
	for _, l := range loads {
		f.Add(encodeLoads(nil, []Load{l}))
	}
	f.Add([]byte{formatLoad})
	f.Add([]byte{formatLoad, 1, 'w', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xf8, 0x7f})
	f.Fuzz(func(t *testing.T, b []byte) {
		var first []Load
		if _, err := decodeLoads(b, func(l Load) { first = append(first, l) }); err != nil {
			return
		}
		var again []Load
		if _, err := decodeLoads(encodeLoads(nil, first), func(l Load) { again = append(again, l) }); err != nil {
			t.Fatalf("%+v decoded, but not once encoded again: %v", first, err)
		}
		if diff := cmp.Diff(first, again, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("decoded, encoded and decoded again (-first +second):\n%s", diff)
		}
	})
}

// Three replicas: the load reports one relays reach the two others, in
// order, not itself, and decisions still arrive beside them, in the clear
// and sealed under a shared secret; a replica without Listen relays
// nothing and does not fail.
func TestPeersRelayLoad(t *testing.T) {
	t.Run("plain", func(t *testing.T) { testPeersRelayLoad(t, nil) })
	t.Run("sealed", func(t *testing.T) { testPeersRelayLoad(t, []byte("the replicas' shared secret")) })
}

func testPeersRelayLoad(t *testing.T, secret []byte) {
	got := map[string]chan Load{}
	edit := func(id string) func(*Config) {
		got[id] = make(chan Load, 16)
		return func(c *Config) { c.ApplyLoad = func(l Load) { got[id] <- l }; c.Secret = secret }
	}
	a, ao := newListening(t, "", "a", edit("a"))
	b, bo := newListening(t, "", "b", edit("b"))
	c, co := newListening(t, "", "c", edit("c"))
	connect(t, []*peer{a, b, c}, []*peerObs{ao, bo, co})
	e := Entry{Worker: "w1", Keys: []uint64{1, 2}, Pending: 1, At: 42}
	a.Publish(e)
	for _, l := range loads {
		a.PublishLoad(l)
	}
	a.Publish(e)
	for _, p := range []*peer{b, c} {
		p.expect(t, e, e)
		for i, want := range loads {
			select {
			case l := <-got[p.ID()]:
				if diff := cmp.Diff(want, l, cmpopts.EquateEmpty()); diff != "" {
					t.Errorf("%s's report %d (-relayed +applied):\n%s", p.ID(), i, diff)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: load report %d never applied", p.ID(), i)
			}
		}
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

// unseenObs records what Unseen hears.
type unseenObs struct {
	*peerObs
	got chan time.Duration
}

func (u *unseenObs) Unseen(d time.Duration) { u.got <- d }

// A decision made before the receiver's latest pick (its Poll) and
// applied after it is counted unseen, by how long before that pick it
// was made; one made after the pick is not.
func TestUnseenByPick(t *testing.T) {
	a, ao := newListening(t, "", "a", nil)
	var u *unseenObs
	b, bo := newListening(t, "", "b", func(c *Config) {
		u = &unseenObs{peerObs: c.Observer.(*peerObs), got: make(chan time.Duration, 8)}
		c.Observer = u
	})
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	before := Entry{Worker: "w1", Keys: []uint64{1}, Pending: 0, At: time.Now().Add(-time.Second).UnixNano()}
	b.Poll()
	polled := time.Now()
	a.Publish(before)
	b.expect(t, before)
	select {
	case d := <-u.got:
		if d < time.Second || d > time.Second+time.Since(polled) {
			t.Errorf("unseen by %v, want a second", d)
		}
	default:
		t.Error("a decision made before b's pick and applied after it was not counted unseen")
	}
	b.Poll()
	after := Entry{Worker: "w1", Keys: []uint64{2}, Pending: 0, At: time.Now().Add(time.Second).UnixNano()}
	a.Publish(after)
	b.expect(t, after)
	select {
	case d := <-u.got:
		t.Errorf("a decision made after b's latest pick counted unseen by %v", d)
	default:
	}
}
