package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// frame encodes one ZMTP frame.
func frame(flags byte, body []byte) []byte {
	if len(body) > 255 {
		var hdr [9]byte
		hdr[0] = flags | flagLong
		binary.BigEndian.PutUint64(hdr[1:], uint64(len(body)))
		return append(hdr[:], body...)
	}
	return append([]byte{flags, byte(len(body))}, body...)
}

// message encodes a message of frames.
func message(frames ...[]byte) []byte {
	var b []byte
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		b = append(b, frame(flags, f)...)
	}
	return b
}

// TestStreamFrames: a stream returns each message's frames whatever the
// reads cut them into, short and long frames alike, messages larger than
// its buffer included, and answers the heartbeats in between.
func TestStreamFrames(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789"), 3000) // past the buffer: it grows
	want := [][][]byte{
		{[]byte("kv"), []byte{0, 0, 0, 0, 0, 0, 0, 1}, []byte("payload")},
		{[]byte("kv"), []byte{0, 0, 0, 0, 0, 0, 0, 2}, bytes.Repeat([]byte{7}, 300)},
		{[]byte("kv"), []byte{0, 0, 0, 0, 0, 0, 0, 3}, big},
		{[]byte("kv"), []byte{0, 0, 0, 0, 0, 0, 0, 4}, {}},
		{[]byte("one frame")},
	}
	var wire []byte
	for i, m := range want {
		wire = append(wire, message(m...)...)
		if i == 1 {
			// A heartbeat: PING, TTL 10, context "ctx".
			wire = append(wire, frame(flagCommand, []byte("\x04PING\x00\x0actx"))...)
		}
	}
	for _, tr := range []string{"pipe", "tcp"} {
		for _, chunk := range []int{1, 7, 1000, len(wire)} {
			t.Run(fmt.Sprintf("%s/chunk=%d", tr, chunk), func(t *testing.T) {
				ours, theirs := connPair(t, tr)
				defer theirs.Close()
				s := &stream{conn: ours, stop: func() bool { return true }, buf: make([]byte, 64)}
				s.rio.Init(ours)
				defer s.close()
				pong := make(chan []byte, 1)
				go func() {
					for b := wire; len(b) > 0; b = b[min(chunk, len(b)):] {
						if _, err := theirs.Write(b[:min(chunk, len(b))]); err != nil {
							return
						}
					}
				}()
				go func() {
					b := make([]byte, 64)
					n, _ := io.ReadAtLeast(theirs, b, 2)
					pong <- b[:n]
				}()
				for i, w := range want {
					got, err := s.next()
					if err != nil {
						t.Fatalf("message %d: %v", i, err)
					}
					if diff := cmp.Diff(w, got); diff != "" {
						t.Fatalf("message %d (-want +got):\n%s", i, diff)
					}
				}
				if got, want := <-pong, frame(flagCommand, []byte("\x04PONGctx")); !bytes.Equal(got, want) {
					t.Errorf("answer to PING %q, want %q", got, want)
				}
				theirs.Close()
				if _, err := s.next(); !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrClosedPipe) {
					t.Errorf("after the publisher went: %v, want EOF", err)
				}
			})
		}
	}
}

// connPair returns the two ends of a connection: a net.Pipe, or a TCP
// connection over loopback.
func connPair(t *testing.T, transport string) (ours, theirs net.Conn) {
	if transport == "pipe" {
		ours, theirs = net.Pipe()
		return ours, theirs
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ours, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if theirs, err = l.Accept(); err != nil {
		t.Fatal(err)
	}
	return ours, theirs
}

// TestStreamRefuses: what no publisher sends ends the stream.
func TestStreamRefuses(t *testing.T) {
	huge := []byte{flagLong, 0, 0, 0, 0x10, 0, 0, 0, 0} // 64 GiB
	for _, tc := range []struct {
		name string
		wire []byte
	}{
		{"huge frame", huge},
		{"empty command", frame(flagCommand, nil)},
		{"command name past its body", frame(flagCommand, []byte("\x09PING"))},
		{"error command", frame(flagCommand, []byte("\x05ERROR\x03bad"))},
		{"truncated", frame(0, []byte("payload"))[:5]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ours, theirs := net.Pipe()
			s := &stream{conn: ours, stop: func() bool { return true }, buf: make([]byte, 64)}
			s.rio.Init(ours)
			defer s.close()
			go func() {
				theirs.Write(tc.wire)
				theirs.Close()
			}()
			if got, err := s.next(); err == nil {
				t.Errorf("frames %q, want an error", got)
			}
		})
	}
}

// byteConn is a connection that reads a fixed input, cut into reads of at
// most cut bytes, and discards what is written to it.
type byteConn struct {
	net.Conn
	in  []byte
	cut int
}

func (c *byteConn) Read(p []byte) (int, error) {
	if len(c.in) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.cut)], c.in)
	c.in = c.in[n:]
	return n, nil
}

func (c *byteConn) Write(p []byte) (int, error) { return len(p), nil }
func (c *byteConn) Close() error                { return nil }

// FuzzStream: whatever a publisher sends, a stream returns messages whose
// frames are the wire's, or an error, and never panics.
func FuzzStream(f *testing.F) {
	f.Add(message([]byte("kv"), []byte{0, 0, 0, 0, 0, 0, 0, 1}, []byte("payload")), 3)
	f.Add(append(frame(flagCommand, []byte("\x04PING\x00\x0actx")), message(bytes.Repeat([]byte{1}, 300))...), 1)
	f.Add([]byte{flagLong | flagMore, 0, 0, 0, 0, 0, 0, 1, 0}, 9)
	f.Fuzz(func(t *testing.T, wire []byte, cut int) {
		s := &stream{conn: &byteConn{in: wire, cut: max(1, cut%4096)}, stop: func() bool { return true }, buf: make([]byte, 64)}
		s.rio.Init(s.conn)
		read := 0
		for {
			frames, err := s.next()
			if err != nil {
				return
			}
			for _, fr := range frames {
				read += len(fr)
			}
			if read > len(wire) {
				t.Fatalf("frames of %d bytes from %d bytes of wire", read, len(wire))
			}
		}
	})
}
