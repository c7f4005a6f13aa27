package kvevents

import (
	"bufio"
	"context"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// bufferedTCP is the name the subscriber registers zmq4's tcp transport
// under with its reads buffered: zmq4 reads each frame's header and body
// with a call of its own, which on a bare connection is a system call
// each, six or more a batch.
const bufferedTCP = "baton-buffered-tcp"

// readBuffer is the read buffer of a connection to an engine, and a
// stream's first buffer: a few batches of a busy engine's events.
const readBuffer = 16 << 10

var registerOnce sync.Once

// zmqEndpoint returns the endpoint the subscriber's zmq4 socket dials or
// listens on for ep: tcp endpoints through the buffered transport. Only
// listening subscribers have one over tcp: those that dial read their
// stream themselves (see stream).
func zmqEndpoint(ep string) string {
	addr, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return ep
	}
	registerOnce.Do(func() {
		if err := zmq4.RegisterTransport(bufferedTCP, bufferedTransport{transport.New("tcp")}); err != nil {
			panic(err) // the name is the package's own
		}
	})
	return bufferedTCP + "://" + addr
}

// bufferedTransport is a transport whose accepted connections' reads are
// buffered; it never dials (see zmqEndpoint).
type bufferedTransport struct{ transport.Transport }

func (t bufferedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.Transport.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return bufferedListener{l}, nil
}

type bufferedListener struct{ net.Listener }

func (l bufferedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newBufferedConn(c), nil
}

// bufferedConn is a connection whose reads go through a buffer. Only
// zmq4's reader goroutine of the connection reads it.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func newBufferedConn(c net.Conn) *bufferedConn {
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, readBuffer)}
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

var (
	_ transport.Transport = bufferedTransport{}
	_ net.Conn            = (*bufferedConn)(nil)
)
