package replica

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// A follower reads the stream over a plain TCP connection of its own,
// parsing XREAD's replies itself, so that Poll can apply what Redis has
// sent on the goroutine that calls it. The Sharer's reading goroutine
// waits for the connection in the runtime's poller, and while every
// processor is busy (a burst of requests, each some milliseconds of
// CPU) the runtime looks at the poller only every 10 ms or so: a message
// already in the socket waits that long for a goroutine to read it. A
// replica that polls before each decision applies it at once.
type follower struct {
	s    *Sharer
	addr string
	auth []string // AUTH's arguments, or none
	db   int

	mu   sync.Mutex // guards what follows, and reading the connection
	conn *net.TCPConn
	rc   syscall.RawConn
	buf  []byte
	last string
	err  error // the connection broke
	cmd  []byte
}

// newFollower returns a follower of the stream on client's server, or
// nil when client is not one it can reach itself (TLS, a cluster).
func newFollower(s *Sharer, client redis.UniversalClient) *follower {
	c, ok := client.(*redis.Client)
	if !ok || !ownConnections {
		return nil
	}
	o := c.Options()
	if o.TLSConfig != nil || o.Network == "unix" || o.CredentialsProvider != nil || o.CredentialsProviderContext != nil || o.StreamingCredentialsProvider != nil {
		return nil
	}
	f := &follower{s: s, addr: o.Addr, db: o.DB}
	switch {
	case o.Username != "":
		f.auth = []string{"AUTH", o.Username, o.Password}
	case o.Password != "":
		f.auth = []string{"AUTH", o.Password}
	}
	return f
}

// follow reads the stream after last until the connection breaks or the
// Sharer closes; it returns the id of the newest message applied.
func (f *follower) follow(last string) (string, error) {
	conn, rc, err := f.dial(last)
	if err != nil {
		return last, err
	}
	stop := context.AfterFunc(f.s.ctx, func() { conn.Close() })
	defer stop()
	err = rc.Read(func(fd uintptr) bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return f.pump(fd, true)
	})
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		err = f.err
	}
	conn.Close()
	f.conn, f.rc = nil, nil
	return f.last, err
}

// Poll applies the messages that have reached the connection, on the
// calling goroutine, without waiting: if another goroutine is reading
// them, it returns at once.
func (f *follower) poll() {
	if !f.mu.TryLock() {
		return
	}
	defer f.mu.Unlock()
	if f.rc == nil || f.err != nil {
		return
	}
	f.rc.Control(func(fd uintptr) { f.pump(fd, false) })
}

// dial connects to Redis, authenticates and selects the database, and
// sends the first XREAD.
func (f *follower) dial(last string) (*net.TCPConn, syscall.RawConn, error) {
	conn, err := dialRedis(f.s.ctx, f.addr, f.auth, f.db)
	if err != nil {
		return nil, nil, err
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.conn, f.rc, f.buf, f.last, f.err = conn, rc, f.buf[:0], last, nil
	if err := f.request(); err != nil {
		conn.Close()
		f.conn, f.rc = nil, nil
		return nil, nil, err
	}
	return conn, rc, nil
}

// dialRedis connects to the Redis at addr, authenticates with auth's
// command (none when nil), selects db and pings it: a server that turns
// the connection away (a Redis in protected mode, reached from another
// host, answers with its reason and closes) is an error that says why,
// here, rather than a broken pipe on the first message.
func dialRedis(ctx context.Context, addr string, auth []string, db int) (*net.TCPConn, error) {
	d := net.Dialer{Timeout: callTimeout}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn := c.(*net.TCPConn)
	var cmd []byte
	n := 1
	if auth != nil {
		cmd = appendCommand(cmd, auth...)
		n++
	}
	if db != 0 {
		cmd = appendCommand(cmd, "SELECT", strconv.Itoa(db))
		n++
	}
	cmd = appendCommand(cmd, "PING")
	conn.SetDeadline(time.Now().Add(callTimeout))
	_, werr := conn.Write(cmd)
	// A server that closed at once may have said why before the write
	// failed: its answer is read either way.
	var buf []byte
	for range n {
		reply, err := readReply(conn, &buf)
		if err == nil {
			err = reply
		}
		if err != nil {
			conn.Close()
			if werr != nil && reply == nil {
				err = werr
			}
			return nil, err
		}
	}
	conn.SetDeadline(time.Time{})
	return conn, nil
}

// request sends XREAD for the messages after f.last. f.mu is held.
func (f *follower) request() error {
	f.cmd = appendCommand(f.cmd[:0], "XREAD", "COUNT", "512", "BLOCK", strconv.Itoa(int(readBlock/time.Millisecond)),
		"STREAMS", f.s.cfg.Stream, f.last)
	if _, err := f.conn.Write(f.cmd); err != nil {
		f.err = err
		return err
	}
	return nil
}

// pump reads what the socket holds (all of it when all, else one read),
// applies each whole reply's messages and asks for the next; it reports
// whether the connection is done with (broken). f.mu is held.
func (f *follower) pump(fd uintptr, all bool) (done bool) {
	return readSocket(fd, &f.buf, &f.err, all, errors.New("redis closed the connection"), f.replies)
}

// replies applies the whole replies f.buf holds. f.mu is held.
func (f *follower) replies() {
	for f.err == nil {
		v, n, err := parseRESP(f.buf)
		if err != nil {
			f.err = err
			return
		}
		if n == 0 {
			return
		}
		switch v.kind {
		case '-':
			f.err = v.replyError()
		case 0: // BLOCK timed out
			f.s.setUp(true, nil)
		case '*':
			f.s.setUp(true, nil)
			for _, st := range v.items {
				if st.kind != '*' || len(st.items) != 2 {
					f.err = errRESP
					break
				}
				for _, m := range st.items[1].items {
					if m.kind != '*' || len(m.items) != 2 {
						f.err = errRESP
						break
					}
					var from, sq, t string
					var data []byte
					fields := m.items[1].items
					for i := 0; i+1 < len(fields); i += 2 {
						switch v := fields[i+1].str; string(fields[i].str) {
						case "r":
							from = string(v)
						case "s":
							sq = string(v)
						case "t":
							t = string(v)
						case "d":
							data = v
						}
					}
					f.last = string(m.items[0].str)
					seq, _ := strconv.ParseUint(sq, 10, 64)
					published, _ := strconv.ParseInt(t, 10, 64)
					f.s.applyMessage(ViaRedis, f.last, from, seq, published, data, true)
				}
			}
		default:
			f.err = errRESP
		}
		f.buf = f.buf[:copy(f.buf, f.buf[n:])]
		if f.err == nil {
			f.request()
		}
	}
}
