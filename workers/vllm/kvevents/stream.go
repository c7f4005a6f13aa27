package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/batonllm/baton/workers/rawio"
)

// source is one subscription's messages: a connection the subscriber
// reads itself (stream), or a zmq4 socket (socketSource).
type source interface {
	// next returns the next message's frames, valid until the next call.
	next() ([][]byte, error)
	close()
}

// stream is a SUB connection to one publisher that the subscriber reads
// on its own goroutine: zmq4's handshake, then the frames parsed in place
// from a buffer of the stream's own. zmq4's socket would read them on a
// goroutine of its own, allocate each frame and hand each message over a
// channel: at a thousand engines that is most of what following them
// costs.
type stream struct {
	conn net.Conn
	rio  rawio.Conn  // conn's reads after the handshake, out of the runtime's sight
	stop func() bool // ends closing conn when the subscription's ctx ends

	buf    []byte // buf[r:w] is read and not yet parsed
	r, w   int
	frames [][]byte // the last message's, into buf
	offs   [][2]int // their bounds, from the message's start
}

const (
	// maxMessage bounds a message's frames together: a batch of a long
	// prompt's blocks is a few hundred kB.
	maxMessage = 256 << 20
)

// errTooLarge ends a stream whose publisher sent a message over maxMessage.
var errTooLarge = errors.New("message over 256 MiB")

// streamNetwork returns the network of an endpoint the subscriber can
// dial itself (tcp and ipc), and its address.
func streamNetwork(ep string) (network, addr string, ok bool) {
	scheme, addr, _ := strings.Cut(ep, "://")
	switch scheme {
	case "tcp":
		return "tcp", addr, true
	case "ipc":
		return "unix", addr, true
	}
	return "", "", false
}

// dialStream dials a publisher and subscribes to topic. ctx bounds the
// dial and the handshake, and closes the stream when it ends.
func dialStream(ctx context.Context, network, addr, topic string) (*stream, error) {
	d := net.Dialer{Timeout: dialTimeout}
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return openStream(ctx, c, topic, false)
}

// openStream does the ZMTP handshake on c, dialled or (server) accepted,
// and subscribes to topic. ctx closes the stream when it ends.
func openStream(ctx context.Context, c net.Conn, topic string, server bool) (*stream, error) {
	// A publisher that says nothing must not hold the subscriber: the
	// handshake has the dial's time.
	_ = c.SetDeadline(time.Now().Add(dialTimeout))
	s := &stream{conn: c, stop: context.AfterFunc(ctx, func() { c.Close() })}
	zc, err := zmq4.Open(c, null.Security(), zmq4.Sub, nil, server, nil)
	if err == nil {
		// ZMTP 3.0's subscription: a message of 1 then the topic.
		err = zc.SendMsg(zmq4.NewMsg(append([]byte{1}, topic...)))
	}
	if err == nil {
		err = c.SetDeadline(time.Time{})
	}
	if err != nil {
		s.close()
		return nil, err
	}
	s.rio.Init(c)
	s.buf = make([]byte, readBuffer) // it grows to the largest message
	return s, nil
}

func (s *stream) close() {
	s.stop()
	s.conn.Close()
}

// ZMTP frame flags.
const (
	flagMore    = 1 << 0
	flagLong    = 1 << 1
	flagCommand = 1 << 2
)

// next returns the next message's frames, answering the publisher's
// commands (heartbeats) on the way.
func (s *stream) next() ([][]byte, error) {
	for {
		cmd, err := s.read()
		if err != nil {
			return nil, err
		}
		if !cmd {
			return s.frames, nil
		}
		if err := s.command(s.frames[0]); err != nil {
			return nil, err
		}
	}
}

// read reads one message, or one command, into s.frames.
func (s *stream) read() (cmd bool, err error) {
	start := s.r // the message's start; compacting moves it to 0
	s.offs = s.offs[:0]
	for {
		if err := s.fill(&start, 2); err != nil {
			return false, err
		}
		flags, n, hdr := s.buf[s.r], uint64(s.buf[s.r+1]), 2
		if flags&flagLong != 0 {
			if err := s.fill(&start, 9); err != nil {
				return false, err
			}
			n, hdr = binary.BigEndian.Uint64(s.buf[s.r+1:]), 9
		}
		if n > maxMessage || uint64(s.r-start+hdr)+n > maxMessage {
			return false, errTooLarge
		}
		if err := s.fill(&start, hdr+int(n)); err != nil {
			return false, err
		}
		from := s.r + hdr - start
		s.offs = append(s.offs, [2]int{from, from + int(n)})
		s.r += hdr + int(n)
		if flags&flagCommand != 0 {
			cmd = true
		}
		if flags&flagMore == 0 || cmd {
			break
		}
	}
	s.frames = s.frames[:0]
	for _, o := range s.offs {
		s.frames = append(s.frames, s.buf[start+o[0]:start+o[1]:start+o[1]])
	}
	return cmd, nil
}

// fill reads until buf holds n bytes from s.r on, keeping those of the
// message that starts at *start, which it moves to the buffer's start
// when the buffer's end is near.
func (s *stream) fill(start *int, n int) error {
	if s.w-s.r >= n {
		return nil
	}
	need := s.r - *start + n // the message's bytes so far, and n more
	if need > len(s.buf)-*start {
		if need > len(s.buf) {
			grown := make([]byte, max(need, 2*len(s.buf)))
			copy(grown, s.buf[*start:s.w])
			s.buf = grown
		} else {
			copy(s.buf, s.buf[*start:s.w])
		}
		s.r, s.w = s.r-*start, s.w-*start
		*start = 0
	}
	for s.w-s.r < n {
		k, err := s.rio.Read(s.buf[s.w:])
		s.w += k
		if err != nil && s.w-s.r < n {
			if err == io.EOF && (s.w > s.r || s.r > *start) {
				err = io.ErrUnexpectedEOF // within a message
			}
			return err
		}
	}
	return nil
}

// command handles a command the publisher sent: a heartbeat's PING is
// answered, an ERROR ends the stream, others are ignored.
func (s *stream) command(body []byte) error {
	if len(body) == 0 || int(body[0]) > len(body)-1 {
		return errors.New("malformed ZMTP command")
	}
	name, data := string(body[1:1+body[0]]), body[1+body[0]:]
	switch name {
	case zmq4.CmdPing:
		// PING is a TTL of 2 bytes, then a context PONG sends back.
		var ctx []byte
		if len(data) > 2 {
			ctx = data[2:]
		}
		return s.send(zmq4.CmdPong, ctx)
	case zmq4.CmdError:
		return fmt.Errorf("publisher: %q", data)
	}
	return nil
}

// send sends the command name with data, a short one.
func (s *stream) send(name string, data []byte) error {
	body := append([]byte{byte(len(name))}, name...)
	body = append(body, data...)
	if len(body) > 255 {
		return errors.New("ZMTP command too long")
	}
	_, err := s.conn.Write(append([]byte{flagCommand, byte(len(body))}, body...))
	return err
}

// socketSource is a zmq4 socket's messages.
type socketSource struct{ sock zmq4.Socket }

func (s socketSource) next() ([][]byte, error) {
	msg, err := s.sock.Recv()
	return msg.Frames, err
}

func (s socketSource) close() { closeSocket(s.sock) }

var (
	_ source = (*stream)(nil)
	_ source = socketSource{}
)

// listenSource is a bind subscription over tcp read by baton's own
// streams: each publisher that connects is handshaken and read on a
// goroutine of its own (answering its heartbeats), which hands each
// message to next and waits until the subscriber is done with it, since
// its frames point into the stream's buffer.
type listenSource struct {
	l      net.Listener
	topic  string
	ctx    context.Context
	cancel context.CancelFunc
	msgs   chan listenMsg
	held   chan struct{} // the ack of the message next returned last
	wg     sync.WaitGroup
}

type listenMsg struct {
	frames [][]byte
	err    error
	ack    chan struct{}
}

// listenStream listens on addr (a tcp address; a host of * is every
// interface) for publishers of topic.
func listenStream(ctx context.Context, addr, topic string) (*listenSource, error) {
	if host, port, err := net.SplitHostPort(addr); err == nil && host == "*" {
		addr = net.JoinHostPort("", port)
	}
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	ls := &listenSource{l: l, topic: topic, ctx: ctx, cancel: cancel, msgs: make(chan listenMsg)}
	ls.wg.Add(1)
	go ls.accept()
	return ls, nil
}

func (ls *listenSource) accept() {
	defer ls.wg.Done()
	for {
		c, err := ls.l.Accept()
		if err != nil {
			if ls.ctx.Err() != nil {
				return
			}
			// Out of descriptors, say: report it and try again shortly.
			ls.report(err)
			select {
			case <-time.After(50 * time.Millisecond):
			case <-ls.ctx.Done():
				return
			}
			continue
		}
		ls.wg.Add(1)
		go ls.read(c)
	}
}

// read reads one publisher's messages until its connection ends, which
// it reports to next as an error.
func (ls *listenSource) read(c net.Conn) {
	defer ls.wg.Done()
	st, err := openStream(ls.ctx, c, ls.topic, true)
	if err != nil {
		c.Close()
		ls.report(err)
		return
	}
	defer st.close()
	ack := make(chan struct{}, 1)
	for {
		frames, err := st.next()
		if err != nil {
			ls.report(err)
			return
		}
		if !ls.send(listenMsg{frames: frames, ack: ack}) {
			return
		}
		select {
		case <-ack:
		case <-ls.ctx.Done():
			return
		}
	}
}

func (ls *listenSource) report(err error) { ls.send(listenMsg{err: err}) }

// send hands m to next, and reports false if the source closed first.
func (ls *listenSource) send(m listenMsg) bool {
	select {
	case ls.msgs <- m:
		return true
	case <-ls.ctx.Done():
		return false
	}
}

// next returns the next message of any publisher, or the error that
// ended one publisher's connection (others go on).
func (ls *listenSource) next() ([][]byte, error) {
	if ls.held != nil {
		ls.held <- struct{}{}
		ls.held = nil
	}
	select {
	case m := <-ls.msgs:
		if m.err != nil {
			return nil, m.err
		}
		ls.held = m.ack
		return m.frames, nil
	case <-ls.ctx.Done():
		return nil, ls.ctx.Err()
	}
}

func (ls *listenSource) close() {
	ls.cancel()
	ls.l.Close()
	ls.wg.Wait()
}
