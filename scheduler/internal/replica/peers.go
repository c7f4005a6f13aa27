package replica

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Straight from replica to replica: with Config.Listen, each replica also
// sends every decision it commits to every other replica over a TCP
// connection of its own, as the decision commits and on its goroutine,
// and reads the others' on the connections they opened to it, polled
// before each decision as the stream's follower is. One hop (sender to
// receiver) instead of two (sender to Redis, Redis to receiver), and no
// request/reply on the way: a decision reaches the others as soon as
// their next decision polls. Beside the stream it is loss-tolerant as the
// stream is (a write that would wait drops the entry for that peer,
// counted; a connection that breaks is dialled again); each entry comes
// both ways and is applied once (Entry.Seq). A replica that connects to
// another first sends it its own newest Replay decisions, so that a
// replica that starts learns what the others decided before it, without
// Redis too.
//
// The wire: the dialler sends peerMagic, then its id and the stream's
// name (uvarint length, bytes, each); the listener answers the same of
// its own, and from then on only the dialler writes, frames of a uvarint
// length, then the uvarint Unix nanoseconds of the entry's publication
// and a message's data (encode). A replica that finds its own id at the
// other end (its own address among the peers, as DNS gives it) stops
// dialling it; one with another stream's name is not sent to: it serves
// another fleet.
//
// With a shared secret (Config.Secret) the greetings begin with
// peerMagicSecret and carry a random nonce each; the listener follows its
// greeting with proof that it holds the secret (an HMAC-SHA256 over both
// nonces, both ids and the stream), the dialler checks it and sends its
// own proof before its first frame, and the listener checks that before
// it applies anything. A replica without the secret, or with another,
// neither sends to nor takes from one with it. Each frame's contents (all
// after its length) are then sealed with AES-256-GCM under a key of the
// connection's own (HKDF-SHA256 of the secret over both greetings), the
// nonce the frame's number on the connection, so that they travel
// encrypted, and a frame altered, dropped, repeated or moved in transit
// does not open: the listener closes the connection. (BATONRS\x02, a
// secret without sealing, is no longer spoken.)

const (
	peerMagic       = "BATONRS\x01"
	peerMagicSecret = "BATONRS\x03"
	// nonceLen is the bytes of a greeting's nonce, proofLen of a proof.
	nonceLen = 16
	proofLen = sha256.Size
	// maxFrame bounds one frame: a message of one decision of maxKeys
	// keys is 8 MB.
	maxFrame = 16 << 20
	// maxName bounds an id or a stream's name in a greeting.
	maxName = 1024
	// greetTimeout bounds the exchange of greetings.
	greetTimeout = 2 * time.Second
)

// peers is a Sharer's connections to and from the other replicas.
type peers struct {
	s  *Sharer
	ln net.Listener
	wg sync.WaitGroup

	mu  sync.Mutex          // guards out
	out map[string]*outPeer // by address
	// outList is out's values, for publish to read without a lock.
	outList   atomic.Pointer[[]*outPeer]
	connected int // out's connected peers; under mu

	inMu   sync.Mutex
	in     map[*inPeer]struct{}
	inList atomic.Pointer[[]*inPeer]

	bufs sync.Pool // *[]byte frames

	loads chan Load // relayed load reports waiting for relayLoads

	keep   int // Replay, or 0: how many frames hist holds at most
	histMu sync.Mutex
	hist   [][]byte // the newest keep frames published, a ring
	next   int      // where the next goes in hist
}

// outPeer is the connection to one other replica, which a goroutine
// (dial) keeps open.
type outPeer struct {
	addr   string
	cancel context.CancelFunc

	mu   sync.Mutex
	conn *net.TCPConn // nil while not connected
	seal *sealer      // conn's, with a shared secret
	out  []byte       // a sealed frame, reused
	up   int          // 0 not yet known, 1 up, -1 down: for one log line per change; under peers.mu
	// down: the peer could not be reached, or its connection broke, and
	// it has not been reached again; what is published meanwhile is
	// counted as dropped for it.
	down atomic.Bool
}

// inPeer is a connection another replica opened to this one.
type inPeer struct {
	from string
	rc   syscall.RawConn
	conn *net.TCPConn

	mu    sync.Mutex // guards what follows, and reading the connection
	buf   []byte
	err   error
	open  *sealer // with a shared secret: opens each frame's contents
	plain []byte  // an opened frame's contents, reused
}

// listenPeers opens s's peer listener and starts accepting.
func listenPeers(s *Sharer) (*peers, error) {
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("replica: peer listener: %w", err)
	}
	p := &peers{s: s, ln: ln, out: make(map[string]*outPeer), in: make(map[*inPeer]struct{}), loads: make(chan Load, loadQueue)}
	if s.cfg.Replay > 0 {
		p.keep = int(s.cfg.Replay)
	}
	p.bufs.New = func() any { b := make([]byte, 0, 4096); return &b }
	p.wg.Add(2)
	go p.accept()
	go p.relayLoads()
	return p, nil
}

// close stops listening and waits for every connection's goroutine; s's
// context is done.
func (p *peers) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, op := range p.out {
		op.cancel()
	}
	p.mu.Unlock()
	p.inMu.Lock()
	for in := range p.in {
		in.conn.Close()
	}
	p.inMu.Unlock()
	p.wg.Wait()
}

// set makes addrs the peers sent to.
func (p *peers) set(addrs []string) {
	want := make(map[string]bool, len(addrs))
	for _, a := range addrs {
		want[a] = true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.s.ctx.Err() != nil {
		return
	}
	for a, op := range p.out {
		if !want[a] {
			op.cancel()
			delete(p.out, a)
		}
	}
	for a := range want {
		if p.out[a] != nil {
			continue
		}
		ctx, cancel := context.WithCancel(p.s.ctx)
		op := &outPeer{addr: a, cancel: cancel}
		p.out[a] = op
		p.wg.Add(1)
		go p.dial(ctx, op)
	}
	list := make([]*outPeer, 0, len(p.out))
	for _, op := range p.out {
		list = append(list, op)
	}
	p.outList.Store(&list)
}

// publish writes e, published at now, to every connected peer, on the
// caller's goroutine; a write that has not started within publishWait
// drops e for that peer (counted), and one cut short closes the
// connection, which dial then opens again.
func (p *peers) publish(e Entry, now int64) {
	list := p.outList.Load()
	if list == nil || len(*list) == 0 {
		return
	}
	bp := p.bufs.Get().(*[]byte)
	defer p.bufs.Put(bp)
	one := [1]Entry{e}
	frame := p.frame(bp, now, func(b []byte) []byte { return encode(b, one[:]) })
	p.remember(frame)
	for _, op := range *list {
		op.write(p.s, frame)
	}
}

// publishLoads writes a frame of relayed load reports, published at now,
// to every connected peer, in buf (returned, to be reused), as publish
// writes a decision; a frame not written is not counted as a decision
// dropped, nor remembered for a peer that connects later.
func (p *peers) publishLoads(buf []byte, ls []Load, now int64) []byte {
	list := p.outList.Load()
	if list == nil || len(*list) == 0 {
		return buf
	}
	frame := p.frame(&buf, now, func(b []byte) []byte { return encodeLoads(b, ls) })
	for _, op := range *list {
		if sent, _ := op.writeFrame(frame, p.s.cfg.publishWait); sent {
			p.s.cfg.Observer.Loads("sent", len(ls), len(frame))
		}
	}
	return buf
}

// frame returns a frame in *bp: its length, the uvarint now, and the data
// data appends.
func (p *peers) frame(bp *[]byte, now int64, data func([]byte) []byte) []byte {
	// The frame's length goes in front once the rest is written.
	const room = binary.MaxVarintLen64
	b := append((*bp)[:0], make([]byte, room)...)
	b = binary.AppendUvarint(b, uint64(now))
	b = data(b)
	var hdr [binary.MaxVarintLen64]byte
	h := binary.PutUvarint(hdr[:], uint64(len(b)-room))
	frame := b[room-h:]
	copy(frame, hdr[:h])
	*bp = b
	return frame
}

// remember keeps a copy of frame among the newest Replay.
func (p *peers) remember(frame []byte) {
	if p.keep == 0 {
		return
	}
	p.histMu.Lock()
	defer p.histMu.Unlock()
	if len(p.hist) < p.keep {
		p.hist = append(p.hist, append([]byte(nil), frame...))
		return
	}
	p.hist[p.next] = append(p.hist[p.next][:0], frame...)
	p.next = (p.next + 1) % len(p.hist)
}

// history returns copies of the frames remembered, oldest first.
func (p *peers) history() [][]byte {
	p.histMu.Lock()
	defer p.histMu.Unlock()
	out := make([][]byte, 0, len(p.hist))
	for i := range p.hist {
		out = append(out, append([]byte(nil), p.hist[(p.next+i)%len(p.hist)]...))
	}
	return out
}

// write writes one decision's frame to op's connection, if it has one,
// counting it sent or dropped.
func (op *outPeer) write(s *Sharer, frame []byte) {
	switch sent, failed := op.writeFrame(frame, s.cfg.publishWait); {
	case sent:
		s.cfg.Observer.Sent(ViaPeer, 1, len(frame))
	case failed:
		s.cfg.Observer.Dropped("peer_error", 1)
	}
}

// writeFrame writes frame to op's connection, if it has one, allowing
// the write wait from when it holds the connection (a write that has not
// started by then is given up), and reports whether it was sent, or else
// failed: the write failed, or the peer is down (not merely not connected
// yet, or closed under the write). A write cut short closes the
// connection, which dial then opens again.
func (op *outPeer) writeFrame(frame []byte, wait time.Duration) (sent, failed bool) {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.conn == nil {
		return false, op.down.Load()
	}
	n, err := op.send(frame, time.Now().Add(wait))
	switch {
	case err == nil:
		return true, false
	case n == 0 && errors.Is(err, net.ErrClosed):
		return false, false
	case n > 0 || !errors.Is(err, os.ErrDeadlineExceeded):
		// Cut short: what the peer reads next would not be a frame.
		op.conn.Close()
		op.conn = nil
	}
	return false, true
}

// replay writes one frame of the history to op's connection, if it has
// one, allowing it callTimeout.
func (op *outPeer) replay(frame []byte) {
	op.mu.Lock()
	defer op.mu.Unlock()
	if op.conn == nil {
		return
	}
	if _, err := op.send(frame, time.Now().Add(callTimeout)); err != nil {
		op.conn.Close()
		op.conn = nil
	}
}

// send writes frame to op's connection by deadline, its contents sealed
// with a shared secret. A frame not written at all leaves the sealer's
// count as it was, so that the next is the one the peer expects. op.mu
// is held, and op.conn is not nil.
func (op *outPeer) send(frame []byte, deadline time.Time) (int, error) {
	op.conn.SetWriteDeadline(deadline)
	if op.seal == nil {
		return op.conn.Write(frame)
	}
	_, k := binary.Uvarint(frame)
	body := frame[k:]
	op.out = binary.AppendUvarint(op.out[:0], uint64(len(body)+op.seal.aead.Overhead()))
	op.out = op.seal.seal(op.out, body)
	n, err := op.conn.Write(op.out)
	if n == 0 && err != nil {
		op.seal.n--
	}
	return n, err
}

// dial keeps a connection to op's peer open until ctx is done, or until
// the peer turns out to be this replica.
func (p *peers) dial(ctx context.Context, op *outPeer) {
	defer p.wg.Done()
	backoff := retryMin
	for ctx.Err() == nil {
		conn, seal, self, err := p.greet(ctx, op.addr)
		if self {
			p.s.cfg.Logger.Debug("replica sharing: peer address is this replica's own", "peer", op.addr)
			return
		}
		if err == nil {
			backoff = retryMin
			// What is published from now on goes to conn, whole frames
			// between those of the history, which the receiver applies
			// in any order and once.
			op.mu.Lock()
			op.conn, op.seal = conn, seal
			hist := p.history()
			op.mu.Unlock()
			p.changed(op, true, nil)
			for _, f := range hist {
				op.replay(f)
			}
			// The peer writes nothing more: a read returns when the
			// connection ends (or publish closed it).
			stop := context.AfterFunc(ctx, func() { conn.Close() })
			var b [1]byte
			_, err = conn.Read(b[:])
			if err == nil {
				err = errors.New("peer wrote after its greeting")
			}
			stop()
			op.mu.Lock()
			if op.conn == conn {
				op.conn, op.seal = nil, nil
			}
			op.mu.Unlock()
			conn.Close()
			if ctx.Err() != nil {
				p.changed(op, false, nil)
				return
			}
		}
		p.changed(op, false, err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, retryMax)
	}
}

// changed records that op's connection is up or down, logging a change
// and reporting the count of connected peers.
func (p *peers) changed(op *outPeer, up bool, err error) {
	state := -1
	if up {
		state = 1
	}
	op.down.Store(!up && err != nil)
	p.mu.Lock()
	was := op.up
	op.up = state
	switch {
	case was != 1 && up:
		p.connected++
	case was == 1 && !up:
		p.connected--
	}
	n := p.connected
	p.mu.Unlock()
	if was == state {
		return
	}
	p.s.cfg.Observer.Peers(n)
	switch {
	case up:
		p.s.cfg.Logger.Info("replica sharing: sending to peer", "peer", op.addr, "peers", n)
	case err != nil:
		p.s.cfg.Logger.Warn("replica sharing: peer unreachable; it hears of this replica's decisions through Redis if shared, or not at all", "peer", op.addr, "err", err, "peers", n)
	}
}

// greet connects to addr and exchanges greetings; self reports that the
// replica there is this one. With a shared secret, seal seals the frames
// for the connection.
func (p *peers) greet(ctx context.Context, addr string) (conn *net.TCPConn, seal *sealer, self bool, err error) {
	d := net.Dialer{Timeout: callTimeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, false, err
	}
	conn = c.(*net.TCPConn)
	conn.SetDeadline(time.Now().Add(greetTimeout))
	mine := greeting{id: p.s.cfg.ID, stream: p.s.cfg.Stream}
	if p.s.cfg.Secret != nil {
		mine.nonce = newNonce()
	}
	if _, err := conn.Write(appendGreeting(nil, mine)); err != nil {
		conn.Close()
		return nil, nil, false, err
	}
	var buf []byte
	g, err := readGreeting(conn, &buf)
	switch {
	case err != nil:
	case g.id == p.s.cfg.ID:
		conn.Close()
		return nil, nil, true, nil
	case g.stream != p.s.cfg.Stream:
		err = fmt.Errorf("the replica there shares stream %q, not %q: it serves another fleet", g.stream, p.s.cfg.Stream)
	case p.s.cfg.Secret == nil && g.nonce != "":
		err = errors.New("the replica there requires a shared secret (replicas.peers.secret_file), which this one has none of")
	case p.s.cfg.Secret != nil && g.nonce == "":
		err = errors.New("the replica there holds no shared secret (replicas.peers.secret_file), which this one requires")
	case p.s.cfg.Secret != nil:
		var proof []byte
		if proof, err = readN(conn, &buf, proofLen); err == nil {
			if !hmac.Equal(proof, p.proof("listener", mine, g)) {
				err = errors.New("the replica there holds another shared secret (replicas.peers.secret_file)")
			} else if _, err = conn.Write(p.proof("dialler", mine, g)); err == nil {
				seal, err = p.sealer(mine, g)
			}
		}
	}
	if err != nil {
		conn.Close()
		return nil, nil, false, err
	}
	conn.SetDeadline(time.Time{})
	return conn, seal, false, nil
}

// sealer returns the sealer of the frames the dialler of greeting d sends
// the listener of greeting l, under the shared secret.
func (p *peers) sealer(d, l greeting) (*sealer, error) {
	key, err := hkdf.Key(sha256.New, p.s.cfg.Secret, nil, string(appendFields(nil, "frames", d.nonce, l.nonce, d.id, l.id, d.stream)), 32)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &sealer{aead: aead}, nil
}

// sealer seals, or opens, one connection's frames in order: the n-th
// with n as its nonce, which neither end sends.
type sealer struct {
	aead  cipher.AEAD
	n     uint64
	nonce [12]byte
}

func (s *sealer) next() []byte {
	binary.BigEndian.PutUint64(s.nonce[4:], s.n)
	s.n++
	return s.nonce[:]
}

// seal appends the next frame's contents, body, sealed, to dst.
func (s *sealer) seal(dst, body []byte) []byte { return s.aead.Seal(dst, s.next(), body, nil) }

// open appends the next frame's contents, sealed, opened, to dst.
func (s *sealer) open(dst, sealed []byte) ([]byte, error) {
	return s.aead.Open(dst, s.next(), sealed, nil)
}

// proof is the HMAC-SHA256 under the shared secret that side ("dialler"
// or "listener") sends of the greetings d (the dialler's) and l.
func (p *peers) proof(side string, d, l greeting) []byte {
	m := hmac.New(sha256.New, p.s.cfg.Secret)
	m.Write(appendFields(nil, side, d.nonce, l.nonce, d.id, l.id, d.stream))
	return m.Sum(nil)
}

// appendFields appends each field to b as a uvarint length and its bytes.
func appendFields(b []byte, fields ...string) []byte {
	for _, s := range fields {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return b
}

func newNonce() string {
	var b [nonceLen]byte
	rand.Read(b[:])
	return string(b[:])
}

// greeting is what each end of a peer connection first says: its id, the
// stream's name, and with a shared secret a nonce.
type greeting struct{ id, stream, nonce string }

// appendGreeting appends g to b: peerMagic and two fields, or with a
// nonce peerMagicSecret and three.
func appendGreeting(b []byte, g greeting) []byte {
	if g.nonce != "" {
		return appendFields(append(b, peerMagicSecret...), g.id, g.stream, g.nonce)
	}
	return appendFields(append(b, peerMagic...), g.id, g.stream)
}

var errGreeting = errors.New("not a baton replica's greeting")

// parseGreeting parses a greeting off the front of b; n is 0 while b
// holds only part of one.
func parseGreeting(b []byte) (g greeting, n int, err error) {
	magic := peerMagic
	if len(b) >= len(peerMagicSecret) && string(b[:len(peerMagicSecret)]) == peerMagicSecret {
		magic = peerMagicSecret
	}
	if len(b) < len(magic) {
		if string(b) != magic[:len(b)] {
			return greeting{}, 0, errGreeting
		}
		return greeting{}, 0, nil
	}
	if string(b[:len(magic)]) != magic {
		return greeting{}, 0, errGreeting
	}
	n = len(magic)
	var out [3]string
	fields := 2
	if magic == peerMagicSecret {
		fields = 3
	}
	for i := range fields {
		l, k := binary.Uvarint(b[n:])
		switch {
		case k == 0:
			return greeting{}, 0, nil
		case k < 0 || l > maxName:
			return greeting{}, 0, errGreeting
		case uint64(len(b)-n-k) < l:
			return greeting{}, 0, nil
		}
		out[i] = string(b[n+k : n+k+int(l)])
		n += k + int(l)
	}
	g = greeting{id: out[0], stream: out[1], nonce: out[2]}
	if fields == 3 && len(g.nonce) != nonceLen {
		return greeting{}, 0, errGreeting
	}
	return g, n, nil
}

// readGreeting reads a greeting from r into *buf, leaving in *buf what
// came after it.
func readGreeting(r io.Reader, buf *[]byte) (g greeting, err error) {
	b := (*buf)[:0]
	var chunk [512]byte
	for {
		g, n, err := parseGreeting(b)
		if err != nil {
			return greeting{}, err
		}
		if n > 0 {
			*buf = append(b[:0], b[n:]...)
			return g, nil
		}
		k, err := r.Read(chunk[:])
		if k > 0 {
			b = append(b, chunk[:k]...)
			continue
		}
		if err == nil {
			err = io.ErrNoProgress
		}
		return greeting{}, err
	}
}

// readN returns the first n bytes of *buf, reading from r what it lacks,
// and leaves in *buf what came after them.
func readN(r io.Reader, buf *[]byte, n int) ([]byte, error) {
	if k := len(*buf); k < n {
		*buf = append(*buf, make([]byte, n-k)...)
		if _, err := io.ReadFull(r, (*buf)[k:]); err != nil {
			return nil, err
		}
	}
	out := slices.Clone((*buf)[:n])
	*buf = append((*buf)[:0], (*buf)[n:]...)
	return out, nil
}

// accept takes the other replicas' connections.
func (p *peers) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.s.ctx.Err() != nil {
				return
			}
			p.s.cfg.Logger.Debug("replica sharing: accept", "err", err)
			select {
			case <-p.s.ctx.Done():
				return
			case <-time.After(retryMin):
			}
			continue
		}
		p.wg.Add(1)
		go p.serve(c.(*net.TCPConn))
	}
}

// serve reads another replica's frames from conn until it ends.
func (p *peers) serve(conn *net.TCPConn) {
	defer p.wg.Done()
	defer conn.Close()
	stop := context.AfterFunc(p.s.ctx, func() { conn.Close() })
	defer stop()
	conn.SetDeadline(time.Now().Add(greetTimeout))
	var buf []byte
	g, err := readGreeting(conn, &buf)
	if err != nil {
		p.s.cfg.Logger.Debug("replica sharing: peer's greeting", "remote", conn.RemoteAddr(), "err", err)
		p.s.cfg.Observer.Refused(RefusedGreeting)
		return
	}
	from := g.id
	mine := greeting{id: p.s.cfg.ID, stream: p.s.cfg.Stream}
	if p.s.cfg.Secret != nil {
		mine.nonce = newNonce()
	}
	answer := appendGreeting(nil, mine)
	if p.s.cfg.Secret != nil && g.nonce != "" {
		answer = append(answer, p.proof("listener", g, mine)...)
	}
	if _, err := conn.Write(answer); err != nil || from == p.s.cfg.ID || from == "" {
		return
	}
	if g.stream != p.s.cfg.Stream {
		p.s.cfg.Observer.Refused(RefusedStream)
		return
	}
	var open *sealer
	if p.s.cfg.Secret != nil {
		// Nothing is taken from a replica that has not shown it holds
		// the secret.
		proof, err := readN(conn, &buf, proofLen)
		if err != nil || g.nonce == "" || !hmac.Equal(proof, p.proof("dialler", g, mine)) {
			p.s.cfg.Logger.Debug("replica sharing: a replica without the shared secret refused", "remote", conn.RemoteAddr(), "peer", from)
			p.s.cfg.Observer.Refused(RefusedSecret)
			return
		}
		if open, err = p.sealer(g, mine); err != nil {
			return
		}
	}
	conn.SetDeadline(time.Time{})
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	in := &inPeer{from: from, rc: rc, conn: conn, buf: buf, open: open}
	p.inMu.Lock()
	if p.s.ctx.Err() != nil {
		p.inMu.Unlock()
		return
	}
	p.in[in] = struct{}{}
	p.storeIn()
	p.inMu.Unlock()
	defer func() {
		p.inMu.Lock()
		delete(p.in, in)
		p.storeIn()
		p.inMu.Unlock()
	}()
	in.mu.Lock()
	in.frames(p.s)
	in.mu.Unlock()
	if ownConnections {
		rc.Read(func(fd uintptr) bool {
			in.mu.Lock()
			defer in.mu.Unlock()
			return in.pump(p.s, fd, true)
		})
	} else {
		var chunk [64 << 10]byte
		for {
			n, err := conn.Read(chunk[:])
			in.mu.Lock()
			in.buf = append(in.buf, chunk[:n]...)
			if err != nil {
				in.err = err
			}
			in.frames(p.s)
			done := in.err != nil
			in.mu.Unlock()
			if done {
				break
			}
		}
	}
	in.mu.Lock()
	if in.err != nil && !errors.Is(in.err, net.ErrClosed) && p.s.ctx.Err() == nil {
		p.s.cfg.Logger.Debug("replica sharing: peer's connection ended", "peer", from, "err", in.err)
	}
	in.mu.Unlock()
}

// storeIn publishes in's members for poll. p.inMu is held.
func (p *peers) storeIn() {
	list := make([]*inPeer, 0, len(p.in))
	for in := range p.in {
		list = append(list, in)
	}
	p.inList.Store(&list)
}

// poll applies, on the calling goroutine, the frames that have reached
// the connections from the other replicas, without waiting.
func (p *peers) poll() {
	if !ownConnections {
		return
	}
	list := p.inList.Load()
	if list == nil {
		return
	}
	for _, in := range *list {
		if !in.mu.TryLock() {
			continue
		}
		if in.err == nil {
			in.rc.Control(func(fd uintptr) { in.pump(p.s, fd, false) })
		}
		in.mu.Unlock()
	}
}

// pump reads what the socket holds (all of it when all, else one read)
// and applies the whole frames; it reports whether the connection is
// done with. in.mu is held.
func (in *inPeer) pump(s *Sharer, fd uintptr, all bool) (done bool) {
	return readSocket(fd, &in.buf, &in.err, all, io.EOF, func() { in.frames(s) })
}

// readSocket reads from fd, a non-blocking socket, into *buf (all it
// holds when all, else one read), calling parse after each read; a read
// error or the end of the stream (as eof) goes to *errp. It reports
// whether the connection is done with.
func readSocket(fd uintptr, buf *[]byte, errp *error, all bool, eof error, parse func()) (done bool) {
	for *errp == nil {
		b := *buf
		if len(b) == cap(b) {
			b = append(b, make([]byte, max(64<<10, cap(b)))...)[:len(b)]
		}
		n, err := readFD(fd, b[len(b):cap(b)])
		switch {
		case errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR):
			*buf = b
			return false
		case err != nil:
			*errp = err
		case n == 0:
			*errp = eof
		}
		*buf = b[:len(b)+max(n, 0)]
		if n > 0 {
			parse()
		}
		if !all {
			break
		}
	}
	return *errp != nil
}

// errSealed: a frame's contents did not open under the shared secret.
var errSealed = errors.New("a frame that does not open under the shared secret: altered, or not the next one sent")

// frames applies the whole frames in.buf holds. in.mu is held.
func (in *inPeer) frames(s *Sharer) {
	for in.err == nil {
		body, n, err := cutFrame(in.buf)
		if err != nil || n == 0 {
			in.err = err
			return
		}
		if in.open != nil {
			if in.plain, err = in.open.open(in.plain[:0], body); err != nil {
				in.err = errSealed
				return
			}
			body = in.plain
		}
		at, data, err := parseBody(body)
		if err != nil {
			in.err = err
			return
		}
		if len(data) > 0 && data[0] == formatLoad {
			s.applyLoads(in.from, data)
		} else {
			s.applyMessage(ViaPeer, "", in.from, 0, at, data, false)
		}
		in.buf = in.buf[:copy(in.buf, in.buf[n:])]
	}
}

// cutFrame returns the contents of the frame at the front of b and the
// frame's length; n is 0 while b holds only part of one.
func cutFrame(b []byte) (body []byte, n int, err error) {
	l, k := binary.Uvarint(b)
	switch {
	case k == 0:
		return nil, 0, nil
	case k < 0 || l > maxFrame:
		return nil, 0, errors.New("bad frame length")
	case uint64(len(b)-k) < l:
		return nil, 0, nil
	}
	return b[k : k+int(l)], k + int(l), nil
}

// parseBody parses a frame's contents: its publication time and data.
func parseBody(body []byte) (at int64, data []byte, err error) {
	t, j := binary.Uvarint(body)
	if j <= 0 || t > 1<<63-1 {
		return 0, nil, errors.New("bad frame time")
	}
	return int64(t), body[j:], nil
}
