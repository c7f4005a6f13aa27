package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2/hpack"
	"google.golang.org/protobuf/encoding/protowire"
)

// The gRPC methods a link tells apart (the :path of their HTTP/2 streams).
const (
	pathPush  = "/baton.worker.v1.KVTransfer/Push"
	pathWatch = "/baton.worker.v1.Worker/Watch"
)

// linkProxy stands between a baton worker and everything that dials it:
// the fleet's configuration gives its address as the worker's, so the
// schedulers' calls and the KV blocks prefill workers push to a decode
// worker (to the address the scheduler gives them, the configured one)
// all pass through it. It forwards HTTP/2 (plaintext gRPC) frame by frame
// and reads the request headers, so it knows which stream is which call,
// and, when told, damages what passes without breaking the connection:
//
//   - corrupt: it flips one byte in the middle of the payload of every
//     nth KV block pushed (KVTransfer.Push messages of 4 KiB or more; a
//     block travels as one message below 1 MiB), after the sender
//     computed its checksum, as a faulty link or NIC would;
//   - dropWatch: each Watch stream then open loses its next cache event,
//     whose sequence number the subscriber never sees (the stream's flow
//     control window is given back to the worker for the dropped bytes,
//     so the stream goes on);
//   - holdPush: one push's frame (and its connection's behind it) waits
//     on the link a moment once some of its blocks have passed, so that
//     a decode worker killed then dies with the push in flight.
//
// Everything else passes unchanged.
type linkProxy struct {
	proxyBase

	corruptEvery atomic.Int64             // 0: off
	hold         atomic.Pointer[pushHold] // armed by holdPush, taken by the push it holds
	dropGen      atomic.Int64             // incremented by dropWatch
	dropArmed    atomic.Bool              // set by dropWatch, cleared by stopDrops

	// Counters since start.
	pushed, flipped  atomic.Int64 // blocks seen in pushes while corrupting, and corrupted
	watches, dropped atomic.Int64 // Watch streams opened, events dropped
	lastErr          atomic.Value // string: the last error that broke a connection (not EOF)

	mu     sync.Mutex
	opened []time.Time // when each Watch stream was opened
}

func newLinkProxy(target string) (*linkProxy, error) {
	p := &linkProxy{}
	if err := p.start(target, p.serve); err != nil {
		return nil, err
	}
	return p, nil
}

// corrupt flips a byte in every nth block pushed through the link from
// now on; 0 stops.
func (p *linkProxy) corrupt(n int) { p.corruptEvery.Store(int64(n)) }

// pushHold is one push's frame held by the link: held is closed once a
// push's frame is held (its earlier frames forwarded), and the frame goes
// on when release is called or after the hold's bound, whichever comes
// first.
type pushHold struct {
	after   int64 // bytes of the push to let pass first
	bound   time.Duration
	held    chan struct{}
	release func()
	gone    chan struct{} // closed by release
	// Set before held is closed: the push's bytes the link had forwarded
	// before the held frame, and the Push streams open on the held
	// frame's connection (the held one included).
	before  int64
	pending int
	at      time.Time // when the frame was held
}

// holdPush arms the link: the first DATA frame of at least corruptMin
// bytes (a block's) of a KVTransfer.Push through it that comes after at
// least after bytes of the push have passed is held, with every frame
// behind it on its connection, until the hold is released or bound has
// passed. A kill while it is held lands with the push in flight, the
// decode worker having had some of its blocks.
func (p *linkProxy) holdPush(after int64, bound time.Duration) *pushHold {
	gone := make(chan struct{})
	h := &pushHold{after: after, bound: bound, held: make(chan struct{}), gone: gone}
	var once sync.Once
	h.release = func() { once.Do(func() { close(gone) }) }
	p.hold.Store(h)
	return h
}

// disarm cancels a hold not yet taken, and releases one taken.
func (p *linkProxy) disarm(h *pushHold) {
	p.hold.CompareAndSwap(h, nil)
	h.release()
}

// dropWatch makes every Watch stream open now drop its next cache event
// (unless stopDrops comes first).
func (p *linkProxy) dropWatch() {
	p.dropGen.Add(1)
	p.dropArmed.Store(true)
}

// stopDrops cancels the drops dropWatch asked for and not yet done.
func (p *linkProxy) stopDrops() { p.dropArmed.Store(false) }

// watchesSince returns, for each Watch stream opened since t, how long
// after t it was.
func (p *linkProxy) watchesSince(t time.Time) []time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Duration
	for _, o := range p.opened {
		if o.After(t) {
			out = append(out, o.Sub(t))
		}
	}
	return out
}

func (p *linkProxy) serve(c, u net.Conn) {
	lc := &linkConn{p: p, up: bufio.NewWriterSize(u, 64<<10), streams: map[uint32]*h2stream{},
		credits: map[uint32]uint32{}, creditSig: make(chan struct{}, 1)}
	done := make(chan struct{}, 3)
	quit := make(chan struct{})
	go func() { lc.note(lc.upstream(bufio.NewReaderSize(c, 64<<10))); done <- struct{}{} }()
	go func() { lc.note(lc.downstream(bufio.NewReaderSize(u, 64<<10), c)); done <- struct{}{} }()
	go func() { lc.note(lc.giveBack(quit)); done <- struct{}{} }()
	<-done
	c.Close()
	u.Close()
	close(quit)
	<-done
	<-done
}

// HTTP/2 frame types and flags the link reads (RFC 9113, section 6).
const (
	frameData         = 0x0
	frameHeaders      = 0x1
	frameRSTStream    = 0x3
	frameWindowUpdate = 0x8
	frameContinuation = 0x9

	flagEndStream  = 0x1
	flagEndHeaders = 0x4
	flagPadded     = 0x8
	flagPriority   = 0x20

	maxFrameBytes = 16384 // SETTINGS_MAX_FRAME_SIZE's initial value
)

const clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// corruptMin is the smallest Push message taken for a block: the other
// messages of a push are none, and a block of the fleet's workers is
// 32 KiB.
const corruptMin = 4 << 10

// linkConn is one proxied connection.
type linkConn struct {
	p *linkProxy

	upMu sync.Mutex // guards up: frames from the client and window updates
	up   *bufio.Writer

	// Flow control window to give back to the worker, by stream (0: the
	// connection), for giveBack to send: downstream never waits for up,
	// which waits for the worker to read, which may wait for downstream to
	// take what it writes (a gRPC server stops reading while its replies
	// to the peer's resets and pings are queued).
	creditMu  sync.Mutex
	credits   map[uint32]uint32
	creditSig chan struct{} // cap 1

	mu      sync.Mutex // guards streams
	streams map[uint32]*h2stream

	// The client's header blocks, decoded in order (HPACK's dynamic table
	// is per connection); used by upstream only.
	dec       *hpack.Decoder
	hdrStream uint32
	hdrBlock  []byte
}

// h2stream is what the link knows of one HTTP/2 stream.
type h2stream struct {
	path string
	// Push: the client's gRPC message framing, and blocks seen.
	up grpcFraming
	// Push: DATA bytes forwarded to the worker.
	sent int64
	// Watch: the worker's messages, told apart as they pass (down), how
	// many began, and the drop generation served.
	down watchFraming
	msgs int
	gen  int64
}

// watchFraming follows a Watch stream's messages from the worker. It
// holds back the first bytes of each (its 5-byte prefix and the start of
// its body, at most watchHead bytes) until it can tell what event the
// message carries, then forwards or drops the whole message as it
// passes: it never holds a message whole, which would stall one larger
// than the stream's flow control window (a snapshot), the subscriber
// never seeing the bytes it must acknowledge.
type watchFraming struct {
	head []byte // held: the prefix and the body's first bytes
	size int    // the body's length, once the prefix is read
	off  int    // body bytes read
	drop bool   // the message in progress is dropped
	told bool   // whether it is was decided
}

// watchHead bounds the bytes held of a message: the prefix, the seq
// field (tag and varint) and the event's tag.
const watchHead = 5 + 1 + 10 + 1

func (lc *linkConn) note(err error) {
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, io.ErrUnexpectedEOF) {
		lc.p.lastErr.Store(err.Error())
	}
}

func (lc *linkConn) stream(id uint32) *h2stream {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.streams[id]
}

func (lc *linkConn) forget(id uint32) {
	lc.mu.Lock()
	delete(lc.streams, id)
	lc.mu.Unlock()
}

type frameHeader struct {
	length uint32
	typ    byte
	flags  byte
	stream uint32
}

func readFrame(r *bufio.Reader, buf []byte) (frameHeader, []byte, error) {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return frameHeader{}, nil, err
	}
	fh := frameHeader{
		length: uint32(h[0])<<16 | uint32(h[1])<<8 | uint32(h[2]),
		typ:    h[3], flags: h[4],
		stream: binary.BigEndian.Uint32(h[5:]) & 0x7fffffff,
	}
	if cap(buf) < int(fh.length) {
		buf = make([]byte, fh.length)
	}
	buf = buf[:fh.length]
	if _, err := io.ReadFull(r, buf); err != nil {
		return fh, nil, err
	}
	return fh, buf, nil
}

func writeFrame(w *bufio.Writer, fh frameHeader, payload []byte) error {
	h := [9]byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), fh.typ, fh.flags}
	binary.BigEndian.PutUint32(h[5:], fh.stream)
	if _, err := w.Write(h[:]); err != nil {
		return err
	}
	_, err := w.Write(payload)
	return err
}

// dataOf returns a DATA or HEADERS frame's content without its padding
// (and, for HEADERS, its priority fields).
func dataOf(fh frameHeader, payload []byte) ([]byte, error) {
	if fh.flags&flagPadded != 0 {
		if len(payload) < 1 || int(payload[0]) > len(payload)-1 {
			return nil, fmt.Errorf("bad padding in frame type %d", fh.typ)
		}
		payload = payload[1 : len(payload)-int(payload[0])]
	}
	if fh.typ == frameHeaders && fh.flags&flagPriority != 0 {
		if len(payload) < 5 {
			return nil, errors.New("short HEADERS priority")
		}
		payload = payload[5:]
	}
	return payload, nil
}

// upstream forwards the client's frames to the worker, learning each
// stream's call from its headers and corrupting pushed blocks when told.
func (lc *linkConn) upstream(r *bufio.Reader) error {
	pre := make([]byte, len(clientPreface))
	if _, err := io.ReadFull(r, pre); err != nil {
		return err
	}
	if string(pre) != clientPreface {
		return errors.New("not an HTTP/2 client preface (a TLS link cannot be inspected)")
	}
	lc.dec = hpack.NewDecoder(4096, nil)
	lc.upMu.Lock()
	_, err := lc.up.Write(pre)
	lc.upMu.Unlock()
	if err != nil {
		return err
	}
	var buf []byte
	for {
		fh, payload, err := readFrame(r, buf)
		if err != nil {
			return err
		}
		buf = payload
		switch fh.typ {
		case frameHeaders, frameContinuation:
			if err := lc.headers(fh, payload); err != nil {
				return err
			}
		case frameData:
			if s := lc.stream(fh.stream); s != nil && s.path == pathPush {
				data, err := dataOf(fh, payload)
				if err != nil {
					return err
				}
				if every := lc.p.corruptEvery.Load(); every > 0 {
					lc.corrupt(s, data, every)
				}
				if h := lc.p.hold.Load(); h != nil && len(data) >= corruptMin && s.sent >= h.after && lc.p.hold.CompareAndSwap(h, nil) {
					if err := lc.holdFrame(h, s); err != nil {
						return err
					}
				}
				s.sent += int64(len(data))
			}
		case frameRSTStream:
			lc.forget(fh.stream)
		}
		lc.upMu.Lock()
		err = writeFrame(lc.up, fh, payload)
		if err == nil && !frameBuffered(r) {
			err = lc.up.Flush()
		}
		lc.upMu.Unlock()
		if err != nil {
			return err
		}
	}
}

// holdFrame forwards what the worker has not yet been sent, says that s
// is held, and waits for the hold to end.
func (lc *linkConn) holdFrame(h *pushHold, s *h2stream) error {
	lc.upMu.Lock()
	err := lc.up.Flush()
	lc.upMu.Unlock()
	if err != nil {
		return err
	}
	h.before = s.sent
	lc.mu.Lock()
	for _, o := range lc.streams {
		if o.path == pathPush {
			h.pending++
		}
	}
	lc.mu.Unlock()
	h.at = time.Now()
	close(h.held)
	t := time.NewTimer(h.bound)
	defer t.Stop()
	select {
	case <-h.gone:
	case <-t.C:
	}
	return nil
}

// headers collects a header block and, once whole, decodes it for the
// stream's :path.
func (lc *linkConn) headers(fh frameHeader, payload []byte) error {
	if fh.typ == frameHeaders {
		frag, err := dataOf(fh, payload)
		if err != nil {
			return err
		}
		lc.hdrStream, lc.hdrBlock = fh.stream, append(lc.hdrBlock[:0], frag...)
	} else {
		if fh.stream != lc.hdrStream {
			return errors.New("CONTINUATION of another stream")
		}
		lc.hdrBlock = append(lc.hdrBlock, payload...)
	}
	if fh.flags&flagEndHeaders == 0 {
		return nil
	}
	fields, err := lc.dec.DecodeFull(lc.hdrBlock)
	if err != nil {
		return fmt.Errorf("hpack: %w", err)
	}
	var path string
	for _, f := range fields {
		if f.Name == ":path" {
			path = f.Value
		}
	}
	if path == "" {
		return nil // trailers
	}
	s := &h2stream{path: path}
	if path == pathWatch {
		s.gen = lc.p.dropGen.Load()
		lc.p.watches.Add(1)
		lc.p.mu.Lock()
		lc.p.opened = append(lc.p.opened, time.Now())
		lc.p.mu.Unlock()
	}
	if path == pathPush || path == pathWatch {
		lc.mu.Lock()
		lc.streams[fh.stream] = s
		lc.mu.Unlock()
	}
	return nil
}

// grpcFraming follows the length-prefixed messages of one direction of a
// gRPC stream across DATA frames.
type grpcFraming struct {
	hdr   [5]byte
	hn    int    // bytes of hdr read
	size  uint32 // the current message's length
	off   uint32 // bytes of it read
	index int64  // messages begun of corruptMin bytes or more
}

// corrupt walks the gRPC messages in data (a push's bytes, in order) and
// flips the middle byte of every nth large one.
func (lc *linkConn) corrupt(s *h2stream, data []byte, every int64) {
	f := &s.up
	for len(data) > 0 {
		if f.hn < 5 {
			n := copy(f.hdr[f.hn:], data)
			f.hn += n
			data = data[n:]
			if f.hn == 5 {
				f.size, f.off = binary.BigEndian.Uint32(f.hdr[1:]), 0
				if f.size >= corruptMin {
					f.index++
					lc.p.pushed.Add(1)
				}
				if f.size == 0 {
					f.hn = 0
				}
			}
			continue
		}
		n := min(uint32(len(data)), f.size-f.off)
		if target := f.size / 2; f.size >= corruptMin && f.index%every == 0 && target >= f.off && target < f.off+n {
			data[target-f.off] ^= 0x55
			lc.p.flipped.Add(1)
		}
		f.off += n
		data = data[n:]
		if f.off == f.size {
			f.hn = 0
		}
	}
}

// downstream forwards the worker's frames to the client, dropping Watch
// events when told.
func (lc *linkConn) downstream(r *bufio.Reader, c net.Conn) error {
	w := bufio.NewWriterSize(c, 64<<10)
	var buf []byte
	for {
		fh, payload, err := readFrame(r, buf)
		if err != nil {
			return err
		}
		buf = payload
		s := (*h2stream)(nil)
		if fh.typ == frameData || fh.typ == frameHeaders || fh.typ == frameRSTStream {
			s = lc.stream(fh.stream)
		}
		if fh.typ == frameData && s != nil && s.path == pathWatch {
			if err := lc.watchData(w, s, fh, payload); err != nil {
				return err
			}
		} else if err := writeFrame(w, fh, payload); err != nil {
			return err
		}
		if s != nil && (fh.typ == frameRSTStream || fh.flags&flagEndStream != 0 && fh.typ != frameData) {
			lc.forget(fh.stream) // trailers or reset: the stream is over
		}
		if !frameBuffered(r) {
			if err := w.Flush(); err != nil {
				return err
			}
		}
	}
}

// watchData forwards a Watch stream's DATA frame, but the cache event a
// dropWatch asked to lose, and gives the worker back the flow control
// window of the bytes the client will never see.
func (lc *linkConn) watchData(w *bufio.Writer, s *h2stream, fh frameHeader, payload []byte) error {
	data, err := dataOf(fh, payload)
	if err != nil {
		return err
	}
	lost := len(payload) - len(data) // padding is not forwarded
	f := &s.down
	var out []byte
	for len(data) > 0 {
		if len(f.head) < 5 { // the prefix
			n := min(5-len(f.head), len(data))
			f.head, data = append(f.head, data[:n]...), data[n:]
			if len(f.head) == 5 {
				f.size, f.off, f.told, f.drop = int(binary.BigEndian.Uint32(f.head[1:5])), 0, false, false
				s.msgs++
			}
		}
		if len(f.head) < 5 {
			break
		}
		if !f.told { // the body's first bytes, until the event is known
			n := min(watchHead-len(f.head), f.size-f.off, len(data))
			f.head, data = append(f.head, data[:n]...), data[n:]
			f.off += n
			kind, known := watchEventKind(f.head[5:])
			if !known && f.off < f.size && len(f.head) < watchHead {
				break // more to come
			}
			f.told = true
			if gen := lc.p.dropGen.Load(); s.msgs > 1 && s.gen < gen && lc.p.dropArmed.Load() && f.head[0] == 0 && kind == watchCache {
				s.gen, f.drop = gen, true
				lc.p.dropped.Add(1)
				lost += len(f.head)
			} else {
				out = append(out, f.head...)
			}
		}
		n := min(f.size-f.off, len(data))
		if f.drop {
			lost += n
		} else {
			out = append(out, data[:n]...)
		}
		data, f.off = data[n:], f.off+n
		if f.told && f.off == f.size {
			f.head = f.head[:0] // the next message
		}
	}
	for first := true; first || len(out) > 0; first = false {
		n := min(len(out), maxFrameBytes)
		f := frameHeader{typ: frameData, stream: fh.stream}
		if n == len(out) {
			f.flags = fh.flags & flagEndStream
			if n == 0 && f.flags == 0 {
				break // nothing to forward yet
			}
		}
		if err := writeFrame(w, f, out[:n]); err != nil {
			return err
		}
		out = out[n:]
	}
	if lost > 0 {
		lc.credit(fh.stream, uint32(lost))
	}
	return nil
}

// The events a Watch message may carry (WatchEvent's oneof field
// numbers).
const (
	watchSnapshot = 2
	watchLoad     = 3
	watchCache    = 4
)

// watchEventKind reads, from the first bytes of a WatchEvent message, the
// field number of its event, if they hold it: the seq field (1, a varint)
// comes first, as every encoder writes fields in order.
func watchEventKind(b []byte) (kind int, known bool) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, false
	}
	if num == 1 && typ == protowire.VarintType {
		_, m := protowire.ConsumeVarint(b[n:])
		if m < 0 {
			return 0, false
		}
		if num, _, n = protowire.ConsumeTag(b[n+m:]); n < 0 {
			return 0, false
		}
	}
	return int(num), true
}

// credit has giveBack return n bytes of the stream's and the connection's
// flow control windows to the worker.
func (lc *linkConn) credit(stream, n uint32) {
	lc.creditMu.Lock()
	lc.credits[0] += n
	lc.credits[stream] += n
	lc.creditMu.Unlock()
	select {
	case lc.creditSig <- struct{}{}:
	default:
	}
}

// giveBack sends the worker the window updates credit asked for, until
// quit.
func (lc *linkConn) giveBack(quit <-chan struct{}) error {
	for {
		select {
		case <-quit:
			return nil
		case <-lc.creditSig:
		}
		lc.creditMu.Lock()
		credits := lc.credits
		lc.credits = map[uint32]uint32{}
		lc.creditMu.Unlock()
		lc.upMu.Lock()
		var err error
		for id, n := range credits {
			var inc [4]byte
			binary.BigEndian.PutUint32(inc[:], n)
			if err = writeFrame(lc.up, frameHeader{typ: frameWindowUpdate, stream: id}, inc[:]); err != nil {
				break
			}
		}
		if err == nil {
			err = lc.up.Flush()
		}
		lc.upMu.Unlock()
		if err != nil {
			return err
		}
	}
}

// frameBuffered reports whether r holds a whole frame: reading it will
// not wait, so what was written before may wait to be flushed with it.
func frameBuffered(r *bufio.Reader) bool {
	if r.Buffered() < 9 {
		return false
	}
	h, _ := r.Peek(9)
	return r.Buffered() >= 9+(int(h[0])<<16|int(h[1])<<8|int(h[2]))
}
