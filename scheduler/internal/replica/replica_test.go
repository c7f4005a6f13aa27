package replica

import (
	"encoding/binary"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"))
}

// ignoreSeq compares entries as published, before Publish numbers them.
var ignoreSeq = cmpopts.IgnoreFields(Entry{}, "Seq")

// peer is a Sharer with what it applied and observed.
type peer struct {
	*Sharer
	applied chan Entry
	mu      sync.Mutex
	dropped map[string]int
	gaps    int
	lost    int
	ups     []bool
}

func (p *peer) Sent(string, int, int)                    {}
func (p *peer) Received(string, int, int, time.Duration) {}
func (p *peer) Peers(int)                                {}
func (p *peer) Duplicates(int)                           {}
func (p *peer) Loads(string, int, int)                   {}
func (p *peer) Unseen(time.Duration)                     {}
func (p *peer) Dropped(reason string, n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropped[reason] += n
}
func (p *peer) Refused(reason string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropped["refused:"+reason]++
}
func (p *peer) Lost(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lost += n
}
func (p *peer) Gap(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gaps += n
}
func (p *peer) Up(up bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ups = append(p.ups, up)
}

func (p *peer) stats() (dropped map[string]int, gaps int, ups []bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := make(map[string]int, len(p.dropped))
	for k, v := range p.dropped {
		d[k] = v
	}
	return d, p.gaps, append([]bool(nil), p.ups...)
}

func newPeer(t *testing.T, addr, id string, edit func(*Config)) *peer {
	t.Helper()
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { client.Close() })
	p := &peer{applied: make(chan Entry, 1024), dropped: map[string]int{}}
	cfg := Config{Client: client, ID: id, Stream: "test:" + t.Name(), Observer: p,
		Apply: func(e Entry) { p.applied <- e }, throughClient: throughClient}
	if edit != nil {
		edit(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	p.Sharer = s
	return p
}

// expect waits for want, in order, on p, past the markers of earlier
// calls of none.
func (p *peer) expect(t *testing.T, want ...Entry) {
	t.Helper()
	for i, w := range want {
		for done := false; !done; {
			select {
			case got := <-p.applied:
				if got.Worker == "marker" && w.Worker != "marker" {
					continue // an earlier none's, seen by every peer
				}
				if diff := cmp.Diff(w, got, ignoreSeq); diff != "" {
					t.Fatalf("%s's entry %d (-want +got):\n%s", p.ID(), i, diff)
				}
				done = true
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: entry %d (%v) never applied", p.ID(), i, w)
			}
		}
	}
}

// take waits for n entries on p, past the markers of earlier calls of
// none, and splits them, in order, by whether they are in.
func (p *peer) take(t *testing.T, n int, in func(Entry) bool) (yes, no []Entry) {
	t.Helper()
	for len(yes)+len(no) < n {
		select {
		case e := <-p.applied:
			if e.Worker == "marker" {
				continue
			}
			if in(e) {
				yes = append(yes, e)
			} else {
				no = append(no, e)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: %d entries of %d never applied", p.ID(), n-len(yes)-len(no), n)
		}
	}
	return yes, no
}

// none checks that p applied nothing more, once a marker sent after
// everything else came through.
func (p *peer) none(t *testing.T, from *peer) {
	t.Helper()
	marker := Entry{Worker: "marker", Keys: []uint64{0xfeed}}
	from.Publish(marker)
	p.expect(t, marker)
}

func TestShare(t *testing.T) {
	addr := redistest.Start(t).Addr()
	a := newPeer(t, addr, "a", nil)
	b := newPeer(t, addr, "b", nil)
	c := newPeer(t, addr, "c", nil)
	// Every peer follows the stream once its replay is done: wait for
	// b's and c's by a message each.
	b.none(t, a)
	c.none(t, a)
	a.expect(t) // a skips its own

	e1 := Entry{Worker: "w0", Keys: []uint64{1, 2, 3}}
	e2 := Entry{Worker: "w1", Keys: []uint64{1<<63 | 5}}
	keys := []uint64{7, 8}
	a.Publish(e1)
	a.Publish(Entry{Worker: "w2", Keys: keys})
	keys[0] = 99 // Publish copied them
	b.Publish(e2)
	a.Publish(Entry{Worker: "w3"}) // no keys: not shared
	b.expect(t, e1, Entry{Worker: "w2", Keys: []uint64{7, 8}})
	a.expect(t, e2)
	// c hears each sender's entries in order; a's second may go after
	// b's, in a message of its own.
	fromA, fromB := c.take(t, 3, func(e Entry) bool { return e.Worker != "w1" })
	if diff := cmp.Diff([]Entry{e1, {Worker: "w2", Keys: []uint64{7, 8}}}, fromA, ignoreSeq); diff != "" {
		t.Errorf("c's entries from a (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]Entry{e2}, fromB, ignoreSeq); diff != "" {
		t.Errorf("c's entries from b (-want +got):\n%s", diff)
	}
	a.none(t, b)
	b.none(t, a)
}

// A replica that joins applies the newest messages first.
func TestJoinReplays(t *testing.T) {
	addr := redistest.Start(t).Addr()
	a := newPeer(t, addr, "a", func(c *Config) { c.MaxBatch = 1 })
	watcher := newPeer(t, addr, "watcher", nil)
	watcher.none(t, a)
	var sent []Entry
	for i := range 5 {
		e := Entry{Worker: "w", Keys: []uint64{uint64(i)}}
		sent = append(sent, e)
		a.Publish(e)
	}
	watcher.expect(t, sent...) // all five are in the stream
	late := newPeer(t, addr, "late", func(c *Config) { c.Replay = 3 })
	// The newest three messages: one each, the marker's among them
	// only if it is newer, which it is not.
	late.expect(t, sent[2:]...)
	late.none(t, a)
}

// Redis lost: entries are dropped and counted, never an error; back, the
// replicas share again and count the messages they missed.
func TestRedisLost(t *testing.T) {
	srv := redistest.Start(t)
	a := newPeer(t, srv.Addr(), "a", func(c *Config) { c.MaxBatch = 1 })
	b := newPeer(t, srv.Addr(), "b", nil)
	b.none(t, a)
	srv.Stop()
	lost := 3
	for i := range lost {
		a.Publish(Entry{Worker: "w", Keys: []uint64{uint64(i)}})
	}
	waitFor(t, "the lost entries counted", func() bool {
		d, _, _ := a.stats()
		return d["redis_error"] == lost
	})
	srv.Restart()
	e := Entry{Worker: "w", Keys: []uint64{42}}
	// b follows the new stream from where it was: the first message
	// after the restart may come before b reads again, and is kept.
	waitFor(t, "sharing again", func() bool {
		a.Publish(e)
		select {
		case got := <-b.applied:
			return cmp.Equal(got, e, ignoreSeq)
		case <-time.After(100 * time.Millisecond):
			return false
		}
	})
	_, gaps, _ := b.stats()
	t.Logf("b counted %d missed messages; %d were lost", gaps, lost)
	if gaps == 0 {
		t.Errorf("b counted no missed messages, %d were lost", lost)
	}
	// a reports itself up once its send has returned, which may be after
	// b has read what it sent.
	waitFor(t, "each replica reporting down then up", func() bool {
		_, _, aUps := a.stats()
		_, _, bUps := b.stats()
		return len(aUps) >= 2 && !aUps[0] && aUps[1] && len(bUps) >= 2 && !bUps[0]
	})
}

// A full queue drops, never blocks.
func TestPublishNeverBlocks(t *testing.T) {
	// Nothing listens here: every send fails, slowly.
	p := &peer{applied: make(chan Entry, 1), dropped: map[string]int{}}
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { client.Close() })
	s, err := New(Config{Client: client, Queue: 4, MaxBatch: 1, Observer: p, Apply: func(Entry) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for range 1000 {
		s.Publish(Entry{Worker: "w", Keys: []uint64{1}})
	}
	if d, _, _ := p.stats(); d["queue_full"] == 0 {
		t.Errorf("dropped %v, want some queue_full", d)
	}
}

func TestConfigRequired(t *testing.T) {
	if _, err := New(Config{Apply: func(Entry) {}}); err == nil {
		t.Error("no client accepted")
	}
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer client.Close()
	if _, err := New(Config{Client: client}); err == nil {
		t.Error("no Apply accepted")
	}
}

func TestCodec(t *testing.T) {
	in := []Entry{
		{Worker: "a", Keys: []uint64{0, 1<<64 - 1}, Pending: 2, At: 1_700_000_000_123_456_789, Seq: 1},
		{Worker: "prefill/dp3", Keys: []uint64{5}, Pending: 0, At: 1, Seq: 1<<64 - 1},
		{Worker: "b", Keys: []uint64{7, 8}, Pending: -1}, // pending unknown
		{Worker: "", Keys: nil, Pending: -1},
	}
	var out []Entry
	n, err := decode(encode(nil, in), func(e Entry) { out = append(out, e) })
	if err != nil || n != len(in) {
		t.Fatalf("decode: %d, %v", n, err)
	}
	if diff := cmp.Diff(in, out, cmp.Comparer(func(a, b []uint64) bool { return len(a) == len(b) && (len(a) == 0 || cmp.Equal(a, b)) })); diff != "" {
		t.Errorf("round trip (-in +out):\n%s", diff)
	}
	// Per entry: name length, name, key count, 8 bytes a key, pending plus
	// one, the time (a uvarint of 1 here), the number (one byte here).
	if got, want := len(encode(nil, []Entry{{Worker: "a", Keys: []uint64{1, 2}, Pending: 1, At: 1, Seq: 7}})), 1+1+1+1+16+1+1+1; got != want {
		t.Errorf("encoded size %d, want %d", got, want)
	}
}

// A message of the first format (decisions only: a worker and its keys)
// decodes with the pending blocks unknown, as older replicas send it.
func TestDecodeFirstFormat(t *testing.T) {
	b := []byte{formatKeys, 1, 'w', 2}
	b = binary.LittleEndian.AppendUint64(b, 10)
	b = binary.LittleEndian.AppendUint64(b, 11)
	b = append(b, 1, 'v', 1)
	b = binary.LittleEndian.AppendUint64(b, 12)
	var out []Entry
	n, err := decode(b, func(e Entry) { out = append(out, e) })
	if err != nil || n != 2 {
		t.Fatalf("decode: %d, %v", n, err)
	}
	want := []Entry{{Worker: "w", Keys: []uint64{10, 11}, Pending: -1}, {Worker: "v", Keys: []uint64{12}, Pending: -1}}
	if diff := cmp.Diff(want, out); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// An unknown format is an error, not a guess.
	if _, err := decode([]byte{4, 1, 'w', 0}, func(Entry) {}); err == nil {
		t.Error("format 4 decoded")
	}
	// Pending beyond the keys is malformed.
	b = append([]byte{formatPending, 1, 'w', 1}, make([]byte, 8)...)
	if _, err := decode(append(b, 3, 0), func(Entry) {}); err == nil {
		t.Error("2 pending blocks of 1 key decoded")
	}
}

// A message of the second format (a decision's prefill and time, no
// number) decodes with Seq 0, which is never taken for a duplicate.
func TestDecodeSecondFormat(t *testing.T) {
	b := []byte{formatPending, 1, 'w', 1}
	b = binary.LittleEndian.AppendUint64(b, 10)
	b = append(b, 2, 5)      // pending 1, at 5
	b = append(b, 1, 'v', 0) // no keys
	b = append(b, 0, 9)      // pending unknown
	var out []Entry
	n, err := decode(b, func(e Entry) { out = append(out, e) })
	if err != nil || n != 2 {
		t.Fatalf("decode: %d, %v", n, err)
	}
	want := []Entry{{Worker: "w", Keys: []uint64{10}, Pending: 1, At: 5}, {Worker: "v", Keys: []uint64{}, Pending: -1}}
	if diff := cmp.Diff(want, out); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	o := &origin{}
	for range 2 {
		if fresh, _ := o.fresh(0); !fresh {
			t.Error("an entry without a number taken for a duplicate")
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(encode(nil, []Entry{{Worker: "w", Keys: []uint64{1, 2}, Pending: 1, At: 99}, {Worker: "v", Keys: []uint64{3}, Pending: -1}}))
	f.Add([]byte{formatPending, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{formatPending, 1, 'w', 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{formatPending, 1, 'w', 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0})
	f.Add([]byte{formatKeys, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{formatKeys, 1, 'w', 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{formatPending, 1, 'w', 0, 1, 7})
	f.Add([]byte{formatSeq, 1, 'w', 0, 1, 7, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := decode(b, func(e Entry) {
			if len(e.Keys) > maxKeys {
				t.Fatalf("%d keys", len(e.Keys))
			}
		})
		if err == nil && n > 0 {
			// What decodes encodes to bytes that decode the same.
			var es, again []Entry
			decode(b, func(e Entry) { es = append(es, e) })
			if _, err := decode(encode(nil, es), func(e Entry) { again = append(again, e) }); err != nil || !cmp.Equal(es, again) {
				t.Fatalf("%x decoded to %v, re-encoded to %v (%v)", b, es, again, err)
			}
		}
	})
}

// waitFor checks cond every few milliseconds until it holds (what crosses
// a real Redis), failing t after 20 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	timeout := time.After(20 * time.Second)
	for !cond() {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}
