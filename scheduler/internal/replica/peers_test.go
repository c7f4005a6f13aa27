package replica

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// peerObs counts what a Sharer sees of its peers.
type peerObs struct {
	*peer
	mu        sync.Mutex
	peers     int
	reports   int // calls of Peers
	dups      int
	received  map[string]int // entries, by via
	sentPeers int
}

func (o *peerObs) Peers(n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.peers = n
	o.reports++
}

// refused is how many connections o's Sharer refused for reason.
func (o *peerObs) refused(reason string) int {
	o.peer.mu.Lock()
	defer o.peer.mu.Unlock()
	return o.peer.dropped["refused:"+reason]
}

func (o *peerObs) Duplicates(n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.dups += n
}

func (o *peerObs) Received(via string, entries, _ int, _ time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.received[via] += entries
}

func (o *peerObs) Sent(via string, entries, _ int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if via == ViaPeer {
		o.sentPeers += entries
	}
}

func (o *peerObs) get() (peers, dups int, received map[string]int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	r := make(map[string]int, len(o.received))
	for k, v := range o.received {
		r[k] = v
	}
	return o.peers, o.dups, r
}

// newListening is newPeer with a peer listener on a free loopback port,
// and Redis at redisAddr ("" for none).
func newListening(t *testing.T, redisAddr, id string, edit func(*Config)) (*peer, *peerObs) {
	t.Helper()
	var obs *peerObs
	p := newPeer(t, redisAddr, id, func(c *Config) {
		obs = &peerObs{peer: c.Observer.(*peer), received: map[string]int{}}
		c.Observer = obs
		c.Listen = "127.0.0.1:0"
		c.Stream = "test:" + t.Name()
		if redisAddr == "" {
			c.Client = nil
		}
		if edit != nil {
			edit(c)
		}
	})
	return p, obs
}

// connect gives every sharer every sharer's address, its own included,
// and waits until each sends to all the others.
func connect(t *testing.T, ps []*peer, obs []*peerObs) {
	t.Helper()
	var addrs []string
	for _, p := range ps {
		addrs = append(addrs, p.ListenAddr())
	}
	for _, p := range ps {
		p.SetPeers(addrs)
	}
	for i, o := range obs {
		waitFor(t, fmt.Sprintf("%s to reach its peers", ps[i].ID()), func() bool { n, _, _ := o.get(); return n == len(ps)-1 })
	}
}

// Three replicas without Redis: each decision reaches the two others
// straight from its sender, once, and not itself; a replica that finds its
// own address among the peers does not count it.
func TestPeersShare(t *testing.T) {
	a, ao := newListening(t, "", "a", nil)
	b, bo := newListening(t, "", "b", nil)
	c, co := newListening(t, "", "c", nil)
	connect(t, []*peer{a, b, c}, []*peerObs{ao, bo, co})
	e1 := Entry{Worker: "w1", Keys: []uint64{1, 2, 3}, Pending: 2, At: 42}
	e2 := Entry{Worker: "w2", Keys: []uint64{4}, Pending: -1}
	a.Publish(e1)
	b.Publish(e2)
	a.expect(t, e2)
	b.expect(t, e1)
	// From two senders, in either order.
	if w1, w2 := c.take(t, 2, func(e Entry) bool { return e.Worker == "w1" }); len(w1) != 1 || len(w2) != 1 {
		t.Errorf("c applied %v and %v, want e1 and e2", w1, w2)
	}
	a.none(t, c)
	b.none(t, c)
	_, _, r := co.get()
	if r[ViaPeer] != 2 || r[ViaRedis] != 0 {
		t.Errorf("c received %v, want 2 via peer", r)
	}
}

// With Redis and peers both, each entry comes both ways and is applied
// once; the second copy is counted as a duplicate.
func TestPeersAndStreamApplyOnce(t *testing.T) {
	srv := redistest.Start(t)
	a, ao := newListening(t, srv.Addr(), "a", nil)
	b, bo := newListening(t, srv.Addr(), "b", nil)
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	const n = 300
	var want []Entry
	for i := range n {
		e := Entry{Worker: fmt.Sprintf("w%d", i%7), Keys: []uint64{uint64(i), uint64(i) + 1}, Pending: 1, At: int64(i + 1)}
		want = append(want, e)
		a.Publish(e)
	}
	b.expect(t, want...)
	waitFor(t, "every entry's second copy", func() bool { _, d, _ := bo.get(); return d == n })
	b.none(t, a) // the marker, applied once too
	_, dups, r := bo.get()
	if r[ViaPeer]+r[ViaRedis] != n+1 {
		t.Errorf("received %v, want %d in all", r, n+1)
	}
	if dups < n {
		t.Errorf("%d duplicates, want %d", dups, n)
	}
}

// Redis unreachable: the peers still carry every decision, and the
// stream's loss is counted.
func TestPeersWithoutRedis(t *testing.T) {
	dead := "127.0.0.1:1"
	a, ao := newListening(t, dead, "a", nil)
	b, bo := newListening(t, dead, "b", nil)
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	e := Entry{Worker: "w", Keys: []uint64{9}}
	a.Publish(e)
	b.expect(t, e)
	waitFor(t, "the stream's loss counted", func() bool { d, _, _ := a.stats(); return d["redis_error"] > 0 })
}

// A peer that goes away and comes back at its address is sent to again;
// meanwhile the stream carries what the sender commits.
func TestPeerComesBack(t *testing.T) {
	srv := redistest.Start(t)
	a, ao := newListening(t, srv.Addr(), "a", nil)
	b, bo := newListening(t, srv.Addr(), "b", nil)
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	addr := b.ListenAddr()
	b.Close()
	waitFor(t, "a to see b gone", func() bool { n, _, _ := ao.get(); return n == 0 })
	a.Publish(Entry{Worker: "w", Keys: []uint64{4}}) // not sent to b, and counted
	if d, _, _ := a.stats(); d["peer_error"] != 1 {
		t.Errorf("a dropped %v for its peer that went away, want peer_error 1", d)
	}
	b2, b2o := newListening(t, srv.Addr(), "b2", func(c *Config) { c.Listen = addr })
	b2.SetPeers([]string{a.ListenAddr()})
	waitFor(t, "a to reach b again", func() bool { n, _, _ := ao.get(); return n == 1 })
	e := Entry{Worker: "w", Keys: []uint64{5, 6}}
	a.Publish(e)
	// b2 replays the stream, which holds what b missed, and a's history
	// holds it too; b2 hears e both ways.
	if es, missed := b2.take(t, 2, func(x Entry) bool { return len(x.Keys) == 2 }); len(es) != 1 || len(missed) != 1 || missed[0].Keys[0] != 4 {
		t.Errorf("b2 applied %v and %v; want e, and what b missed", es, missed)
	}
	// Each came twice: what b missed from the stream's replay and from
	// a's history as it connected, e from a and from the stream.
	waitFor(t, "the second copies", func() bool { _, d, r := b2o.get(); return d == 2 && r[ViaPeer]+r[ViaRedis] == 2 })
}

// A peer of another stream (another fleet's replica) is not sent to, nor
// is a connection that does not greet as a replica read from.
func TestPeerOtherStreamAndGarbage(t *testing.T) {
	a, ao := newListening(t, "", "a", nil)
	b, bo := newListening(t, "", "b", func(c *Config) { c.Stream = "other" })
	a.SetPeers([]string{b.ListenAddr()})
	b.SetPeers([]string{a.ListenAddr()})
	c, co := newListening(t, "", "c", nil)
	c.SetPeers([]string{a.ListenAddr()})
	waitFor(t, "c to reach a", func() bool { n, _, _ := co.get(); return n == 1 })
	conn, err := net.Dial("tcp", a.ListenAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := conn.Read(make([]byte, 64)); err == nil {
		t.Errorf("a answered %d bytes to a stranger", n)
	}
	// a's dial to b has failed once (and been reported) by then.
	waitFor(t, "a's attempt to reach b", func() bool { ao.mu.Lock(); defer ao.mu.Unlock(); return ao.reports > 0 })
	e := Entry{Worker: "w", Keys: []uint64{1}}
	a.Publish(e)
	c.Publish(e)
	a.expect(t, e)
	select {
	case got := <-b.applied:
		t.Errorf("b, of another stream, applied %v", got)
	default:
	}
	if n, _, _ := ao.get(); n != 0 {
		t.Errorf("a sends to %d peers, want none (b shares another stream)", n)
	}
	waitFor(t, "a to count the stranger's and b's connections refused", func() bool {
		return ao.refused(RefusedGreeting) > 0 && ao.refused(RefusedStream) > 0
	})
	if n, _, _ := bo.get(); n != 0 {
		t.Errorf("b sends to %d peers, want none", n)
	}
}

// A frame torn in any place is applied once whole, and a peer's
// connection reads frames back to back.
func TestFramesInPieces(t *testing.T) {
	var stream []byte
	var want []Entry
	for i := range 5 {
		e := Entry{Worker: fmt.Sprintf("w%d", i), Keys: []uint64{uint64(i)}, Pending: 0, At: int64(i + 1), Seq: uint64(i + 1)}
		want = append(want, e)
		body := binary.AppendUvarint(nil, uint64(100+i))
		body = encode(body, []Entry{e})
		stream = binary.AppendUvarint(stream, uint64(len(body)))
		stream = append(stream, body...)
	}
	for cut := range len(stream) {
		var got []Entry
		s := &Sharer{cfg: Config{ID: "me", Apply: func(e Entry) { got = append(got, e) }}.withDefaults(), origins: map[string]*origin{}}
		in := &inPeer{from: "them"}
		for _, part := range [][]byte{stream[:cut], stream[cut:]} {
			in.buf = append(in.buf, part...)
			in.frames(s)
		}
		if in.err != nil || len(got) != len(want) || len(in.buf) != 0 {
			t.Fatalf("cut at %d: %d entries, err %v, %d bytes left", cut, len(got), in.err, len(in.buf))
		}
	}
}

// TestLostOnlyWhatNeitherWayBrought: messages the stream missed but a
// peer brought count as the stream's gap, not as lost; the decisions
// neither brought are lost once the window has passed them.
func TestLostOnlyWhatNeitherWayBrought(t *testing.T) {
	obs := &peer{dropped: map[string]int{}}
	applied := 0
	s := &Sharer{cfg: Config{ID: "me", Observer: obs, Apply: func(Entry) { applied++ }}.withDefaults(), origins: map[string]*origin{}}
	const n = 3 * dedupWindow
	neither := map[uint64]bool{100: true, 101: true, 2000: true}
	streamSeq := uint64(0)
	for i := uint64(1); i <= n; i++ {
		data := encode(nil, []Entry{{Worker: "w", Keys: []uint64{i}, At: 1, Seq: i}})
		if neither[i] {
			streamSeq++ // added to the stream, trimmed before it was read
			continue
		}
		streamSeq++
		if i%10 != 0 { // every tenth, the stream misses and a peer brings
			s.applyMessage(ViaRedis, "", "them", streamSeq, 1, data, true)
		}
		if i%2 == 0 {
			s.applyMessage(ViaPeer, "", "them", 0, 1, data, false)
		}
	}
	wantGaps := n/10 + 1 // the tenths, and 101
	if applied != n-len(neither) || obs.lost != len(neither) || obs.gaps != wantGaps {
		t.Fatalf("applied %d, lost %d, stream gaps %d; want %d, %d, %d", applied, obs.lost, obs.gaps, n-len(neither), len(neither), wantGaps)
	}
}

func TestFresh(t *testing.T) {
	var o origin
	for _, c := range []struct {
		n     uint64
		fresh bool
		lost  int
	}{
		{5, true, 0}, {5, false, 0}, {3, true, 0}, {4, true, 0}, {3, false, 0}, {6, true, 0},
		// 7 and 8 never come: lost once the window has moved past them.
		{9, true, 0}, {6 + dedupWindow - 1, true, 0}, {6 + dedupWindow, true, 0}, {7 + dedupWindow, true, 1},
		{6, false, 0}, // out of the window: taken as applied
		// A jump past the window: of what it held, 8 and 10 …
		// 6+dedupWindow-2 never came; all between it and the new window
		// never did.
		{100_000, true, 1 + (6 + dedupWindow - 2 - 10 + 1) + (100_000 - dedupWindow - (7 + dedupWindow))},
		{100_000 - dedupWindow + 1, true, 0}, {100_000 - dedupWindow + 1, false, 0},
	} {
		if fresh, lost := o.fresh(c.n); fresh != c.fresh || lost != c.lost {
			t.Fatalf("fresh(%d) = %v, %d lost, want %v, %d", c.n, fresh, lost, c.fresh, c.lost)
		}
	}
}

// refOrigin is origin's bookkeeping with a map: what fresh must report.
type refOrigin struct {
	lo, hi  uint64
	applied map[uint64]bool
}

func (r *refOrigin) fresh(n uint64) (bool, int) {
	lost := 0
	switch {
	case r.hi == 0:
		r.lo, r.hi = n, n
	case n > r.hi:
		for m := r.hi + 1; m <= n; m++ { // entry m-dedupWindow leaves the window
			if m > dedupWindow && m-dedupWindow >= r.lo && !r.applied[m-dedupWindow] {
				lost++
			}
		}
		r.hi = n
	case r.hi-n >= dedupWindow || r.applied[n]:
		return false, 0
	}
	r.lo = min(r.lo, n)
	r.applied[n] = true
	return true, lost
}

// TestFreshAgainstMap feeds origin and refOrigin the same numbers, as two
// ways bring them: each entry by one way or both or neither, late or in
// order, now and then a stretch gone.
func TestFreshAgainstMap(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		var o origin
		ref := refOrigin{applied: map[uint64]bool{}}
		next := uint64(1 + rng.IntN(5000))
		var late []uint64
		total := 0
		for range 30_000 {
			var n uint64
			switch r := rng.IntN(100); {
			case r < 3 && len(late) > 0:
				i := rng.IntN(len(late))
				n, late[i] = late[i], late[len(late)-1]
				late = late[:len(late)-1]
			case r < 5:
				late = append(late, next)
				next++
				continue
			case r < 7:
				next++ // lost on both ways
				continue
			case r == 7:
				next += uint64(rng.IntN(3 * dedupWindow)) // a replica cut off a while
				continue
			case r < 20 && next > 1:
				n = next - 1 - uint64(rng.IntN(int(min(next-1, 2*dedupWindow)))) // a second copy
			default:
				n = next
				next++
			}
			f1, l1 := o.fresh(n)
			f2, l2 := ref.fresh(n)
			if f1 != f2 || l1 != l2 {
				t.Fatalf("seed %d: fresh(%d) = %v, %d lost; the map says %v, %d", seed, n, f1, l1, f2, l2)
			}
			total += l1
		}
		if total == 0 {
			t.Fatalf("seed %d: nothing lost", seed)
		}
	}
}

func FuzzParseGreeting(f *testing.F) {
	f.Add(appendGreeting(nil, greeting{id: "a", stream: "baton:replica:commits"}))
	f.Add(appendGreeting(nil, greeting{id: "a", stream: "s", nonce: "0123456789abcdef"}))
	f.Add([]byte(peerMagic))
	f.Add([]byte(peerMagicSecret))
	f.Add(append([]byte(peerMagic), 0xff, 0xff, 0xff, 0xff, 0x0f))
	f.Add(append([]byte(peerMagicSecret), 1, 'a', 1, 's', 3, 'a', 'b', 'c'))
	f.Add([]byte("BATON"))
	f.Add([]byte("BATONRS\x02\x01a\x01s\x100123456789abcdef")) // a secret without sealing: no longer spoken
	f.Fuzz(func(t *testing.T, b []byte) {
		g, n, err := parseGreeting(b)
		if err == nil && n > 0 {
			if n > len(b) || len(g.id) > maxName || len(g.stream) > maxName || g.nonce != "" && len(g.nonce) != nonceLen {
				t.Fatalf("%q: n %d, id %d bytes, stream %d, nonce %d", b, n, len(g.id), len(g.stream), len(g.nonce))
			}
			again := appendGreeting(nil, g)
			if g2, n2, err := parseGreeting(again); err != nil || g2 != g || n2 != len(again) {
				t.Fatalf("%q parsed to %+v, which greets as %q, parsed to %+v (%v)", b, g, again, g2, err)
			}
		}
	})
}

// With a shared secret, the replicas that hold it share; one with another
// secret, or none, is neither sent to nor read from, either way round.
func TestPeersSecret(t *testing.T) {
	secret := func(s string) func(*Config) {
		return func(c *Config) {
			if s != "" {
				c.Secret = []byte(s)
			}
		}
	}
	a, ao := newListening(t, "", "a", secret("first secret"))
	b, bo := newListening(t, "", "b", secret("first secret"))
	c, co := newListening(t, "", "c", secret("second secret"))
	d, do := newListening(t, "", "d", secret(""))
	ps, obs := []*peer{a, b, c, d}, []*peerObs{ao, bo, co, do}
	var addrs []string
	for _, p := range ps {
		addrs = append(addrs, p.ListenAddr())
	}
	for _, p := range ps {
		p.SetPeers(addrs)
	}
	waitFor(t, "a and b to reach each other", func() bool {
		na, _, _ := ao.get()
		nb, _, _ := bo.get()
		return na == 1 && nb == 1
	})
	// c and d have each tried every other (reported down) and reach none.
	for i, o := range obs[2:] {
		waitFor(t, ps[2+i].ID()+"'s attempts", func() bool { o.mu.Lock(); defer o.mu.Unlock(); return o.reports > 0 })
		if n, _, _ := o.get(); n != 0 {
			t.Errorf("%s sends to %d peers, want none", ps[2+i].ID(), n)
		}
	}
	e := Entry{Worker: "w", Keys: []uint64{1}}
	c.Publish(Entry{Worker: "from-c", Keys: []uint64{2}})
	d.Publish(Entry{Worker: "from-d", Keys: []uint64{3}})
	a.Publish(e)
	b.expect(t, e)
	a.none(t, b)
	for _, p := range ps {
		select {
		case got := <-p.applied:
			t.Errorf("%s applied %v", p.ID(), got)
		default:
		}
	}
	for i, o := range obs[:3] {
		if o.refused(RefusedSecret) == 0 {
			t.Errorf("%s counted no connection refused for want of the secret", ps[i].ID())
		}
	}
}

// A connection that greets with a nonce but cannot prove the secret has
// nothing it sends applied.
func TestPeersSecretForged(t *testing.T) {
	a, ao := newListening(t, "", "a", func(c *Config) { c.Secret = []byte("s") })
	for i, forged := range []struct {
		name  string
		nonce string
		proof []byte
	}{
		{"no secret", "", nil},
		{"wrong proof", "0123456789abcdef", make([]byte, proofLen)},
	} {
		t.Run(forged.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", a.ListenAddr())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			conn.Write(appendGreeting(nil, greeting{id: "mallory", stream: "test:" + t.Name()[:len("TestPeersSecretForged")], nonce: forged.nonce}))
			var buf []byte
			if g, err := readGreeting(conn, &buf); err != nil || g.nonce == "" {
				t.Fatalf("a's greeting %+v (%v), want one with a nonce", g, err)
			}
			body := binary.AppendUvarint(nil, 1)
			body = encode(body, []Entry{{Worker: "forged", Keys: []uint64{9}, Seq: 1}})
			msg := append(forged.proof, binary.AppendUvarint(nil, uint64(len(body)))...)
			conn.Write(append(msg, body...))
			// Closed (EOF, or reset over the unread frame), not timed out.
			if _, err := io.ReadAll(conn); errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("a did not close the connection: %v", err)
			}
			select {
			case got := <-a.applied:
				t.Errorf("a applied %v from a replica without the secret", got)
			default:
			}
			if n := ao.refused(RefusedSecret); n != i+1 {
				t.Errorf("a counted %d connections refused for want of the secret, want %d", n, i+1)
			}
		})
	}
}

func FuzzParseFrame(f *testing.F) {
	body := binary.AppendUvarint(nil, 77)
	body = encode(body, []Entry{{Worker: "w", Keys: []uint64{1}, Seq: 3}})
	f.Add(append(binary.AppendUvarint(nil, uint64(len(body))), body...))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Add([]byte{1, 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		body, n, err := cutFrame(b)
		if err != nil || n == 0 {
			return
		}
		at, data, err := parseBody(body)
		if err != nil {
			return
		}
		if n > len(b) || at < 0 || len(data) > n {
			t.Fatalf("%x: n %d at %d data %d", b, n, at, len(data))
		}
		decode(data, func(Entry) {})
	})
}

// A replica that joins later learns, from each peer that connects to it,
// that peer's newest decisions, without Redis; a peer connecting again
// resends them, and they are applied once.
func TestPeersCatchUp(t *testing.T) {
	a, ao := newListening(t, "", "a", func(c *Config) { c.Replay = 3 })
	b, bo := newListening(t, "", "b", nil)
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	var sent []Entry
	for i := range 5 {
		e := Entry{Worker: "w", Keys: []uint64{uint64(i)}, Pending: -1}
		sent = append(sent, e)
		a.Publish(e)
	}
	b.expect(t, sent...)
	c, co := newListening(t, "", "c", nil)
	addrs := []string{a.ListenAddr(), b.ListenAddr(), c.ListenAddr()}
	a.SetPeers(addrs)
	c.expect(t, sent[2:]...) // a's newest three, oldest first
	c.SetPeers(addrs)
	b.SetPeers(addrs)
	waitFor(t, "c to reach both", func() bool { n, _, _ := co.get(); return n == 2 })
	// b, reconnected to by c only, got nothing again; a's history went to
	// c alone (b's connection from a stayed).
	b.none(t, c)
	c.none(t, b)
	if _, d, _ := bo.get(); d != 0 {
		t.Errorf("b skipped %d second copies, want none", d)
	}
}

// Decisions committed on many goroutines at once each reach the peer
// once (run with -race: Publish's frames, history and connections are
// shared).
func TestPeersConcurrentPublish(t *testing.T) {
	a, ao := newListening(t, "", "a", func(c *Config) { c.Replay = 100 })
	b, bo := newListening(t, "", "b", nil)
	connect(t, []*peer{a, b}, []*peerObs{ao, bo})
	const goroutines, each = 8, 50
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				a.Publish(Entry{Worker: fmt.Sprintf("w%d", g), Keys: []uint64{uint64(g*each + i)}})
			}
		})
	}
	wg.Wait()
	seen := map[uint64]bool{}
	yes, _ := b.take(t, goroutines*each, func(Entry) bool { return true })
	for _, e := range yes {
		if seen[e.Keys[0]] {
			t.Fatalf("entry %d applied twice", e.Keys[0])
		}
		seen[e.Keys[0]] = true
	}
	b.none(t, a)
}

// A replica with the secret sends nothing, not even its own proof, to a
// listener that cannot prove it holds the secret too.
func TestPeersSecretImpostor(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, ao := newListening(t, "", "a", func(c *Config) { c.Secret = []byte("s") })
	a.SetPeers([]string{ln.Addr().String()})
	conn, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	var buf []byte
	g, err := readGreeting(conn, &buf)
	if err != nil || g.nonce == "" {
		t.Fatalf("a's greeting %+v (%v), want one with a nonce", g, err)
	}
	conn.Write(append(appendGreeting(nil, greeting{id: "mallory", stream: g.stream, nonce: "0123456789abcdef"}), make([]byte, proofLen)...))
	a.Publish(Entry{Worker: "w", Keys: []uint64{1}})
	rest, err := io.ReadAll(conn)
	if errors.Is(err, os.ErrDeadlineExceeded) || len(buf)+len(rest) > 0 {
		t.Errorf("a wrote %d bytes after its greeting to a listener without the secret (%v)", len(buf)+len(rest), err)
	}
	if n, _, _ := ao.get(); n != 0 {
		t.Errorf("a sends to %d peers, want none", n)
	}
}

// recordingProxy forwards connections to target, keeping what the
// dialling side sent.
type recordingProxy struct {
	ln   net.Listener
	mu   sync.Mutex
	sent []byte
}

func startRecordingProxy(t *testing.T, target string) *recordingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	px := &recordingProxy{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			t.Cleanup(func() { c.Close(); u.Close() })
			go io.Copy(c, u)
			go func() {
				var b [4096]byte
				for {
					n, err := c.Read(b[:])
					px.mu.Lock()
					px.sent = append(px.sent, b[:n]...)
					px.mu.Unlock()
					if _, werr := u.Write(b[:n]); err != nil || werr != nil {
						return
					}
				}
			}()
		}
	}()
	return px
}

func (px *recordingProxy) seen() []byte {
	px.mu.Lock()
	defer px.mu.Unlock()
	return slices.Clone(px.sent)
}

// With a shared secret the decisions travel sealed: what crosses the
// wire holds neither the worker's name nor the block keys, and the
// receiver applies them as without. Without a secret both are there to
// read (so the check can fail).
func TestPeersSecretSeals(t *testing.T) {
	const name = "worker-whose-name-must-not-show"
	key := uint64(0x0123456789abcdef)
	for _, secret := range []string{"", "the test's shared secret"} {
		t.Run(fmt.Sprintf("secret=%v", secret != ""), func(t *testing.T) {
			edit := func(c *Config) {
				if secret != "" {
					c.Secret = []byte(secret)
				}
			}
			a, _ := newListening(t, "", "a", edit)
			b, bo := newListening(t, "", "b", edit)
			px := startRecordingProxy(t, a.ListenAddr())
			b.SetPeers([]string{px.ln.Addr().String()})
			waitFor(t, "b to reach a", func() bool { n, _, _ := bo.get(); return n == 1 })
			e := Entry{Worker: name, Keys: []uint64{key, key + 1}, Pending: -1}
			for range 3 {
				b.Publish(e)
				a.expect(t, e)
			}
			wire := px.seen()
			var k [8]byte
			binary.LittleEndian.PutUint64(k[:], key)
			plain := bytes.Contains(wire, []byte(name)) || bytes.Contains(wire, k[:]) ||
				bytes.Contains(wire, binary.BigEndian.AppendUint64(nil, key))
			if secret != "" && plain {
				t.Errorf("with a secret, the %d bytes sent hold the worker's name or a key in the clear", len(wire))
			}
			if secret == "" && !bytes.Contains(wire, []byte(name)) {
				t.Errorf("without a secret, the %d bytes sent do not hold the worker's name", len(wire))
			}
		})
	}
}

// A frame altered, or sent again, in transit does not open: the listener
// applies nothing of it, nor anything after it, and closes the
// connection. The dialler here is the test, holding the secret.
func TestPeersSecretTampered(t *testing.T) {
	secret := []byte("the test's shared secret")
	for _, fault := range []string{"flipped", "repeated"} {
		t.Run(fault, func(t *testing.T) {
			a, _ := newListening(t, "", "a", func(c *Config) { c.Secret = secret })
			conn, err := net.Dial("tcp", a.ListenAddr())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			mine := greeting{id: "mallory", stream: "test:" + t.Name(), nonce: newNonce()}
			conn.Write(appendGreeting(nil, mine))
			var buf []byte
			g, err := readGreeting(conn, &buf)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := readN(conn, &buf, proofLen); err != nil {
				t.Fatal(err)
			}
			me := &peers{s: &Sharer{cfg: Config{Secret: secret}}}
			seal, err := me.sealer(mine, g)
			if err != nil {
				t.Fatal(err)
			}
			frame := func(e Entry) []byte {
				body := encode(binary.AppendUvarint(nil, 1), []Entry{e})
				return seal.seal(binary.AppendUvarint(nil, uint64(len(body)+seal.aead.Overhead())), body)
			}
			good := Entry{Worker: "w", Keys: []uint64{1}, Seq: 1, Pending: -1}
			first := frame(good)
			conn.Write(append(me.proof("dialler", mine, g), first...))
			a.expect(t, good)
			var bad []byte
			switch fault {
			case "flipped":
				bad = frame(Entry{Worker: "w", Keys: []uint64{2}, Seq: 2, Pending: -1})
				bad[len(bad)/2] ^= 1
			case "repeated":
				bad = first
			}
			after := frame(Entry{Worker: "w", Keys: []uint64{3}, Seq: 3, Pending: -1})
			conn.Write(append(bad, after...))
			if _, err := io.ReadAll(conn); errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("a did not close the connection: %v", err)
			}
			select {
			case got := <-a.applied:
				t.Errorf("a applied %v after a frame %s in transit", got, fault)
			default:
			}
		})
	}
}

// BenchmarkSealFrame: what a shared secret adds to a decision on its
// goroutine, for each peer: sealing an 8,000-token prompt's frame.
func BenchmarkSealFrame(b *testing.B) {
	me := &peers{s: &Sharer{cfg: Config{Secret: []byte("a benchmark's shared secret")}}}
	d := greeting{id: "d", stream: "s", nonce: newNonce()}
	l := greeting{id: "l", stream: "s", nonce: newNonce()}
	seal, err := me.sealer(d, l)
	if err != nil {
		b.Fatal(err)
	}
	keys := make([]uint64, 500)
	for i := range keys {
		keys[i] = rand.Uint64()
	}
	body := encode(binary.AppendUvarint(nil, 1), []Entry{{Worker: "worker-17", Keys: keys, Pending: 100, At: 1, Seq: 1}})
	var out []byte
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		out = seal.seal(out[:0], body)
	}
}
