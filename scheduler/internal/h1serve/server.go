// Package h1serve serves an http.Handler over plain HTTP/1.1 connections,
// each connection's requests read, handled and answered on one goroutine.
//
// net/http's server starts, for every request, a background read of the
// connection to notice a client that goes away, and stops it again when
// the handler returns: a goroutine hand-off and a deadline change on both
// ends of every request, which is most of what a proxy adds to a short
// request's time to first byte. On Linux this server adds each connection,
// once, to an epoll set of its own for the client's FIN or reset
// (hangup_linux.go), followed by one goroutine that sleeps until a client
// goes: a request costs nothing, and a client that goes cancels its
// request at once. Elsewhere (or where a connection has no descriptor) it
// starts the read only once a request has run for WatchDelay (10 ms by
// default) with its body read, so a request answered sooner costs none of
// it, and one that runs longer is cancelled when its client goes, at most
// twice WatchDelay late; one goroutine a server starts those watches,
// ticking while requests are armed (a timer a request would wake a thread
// of the runtime's for every request).
//
// The parsing of requests is net/http's (http.ReadRequest, which also
// frames request bodies); responses are framed here: a body the handler
// finishes within 2 KiB without flushing gets a Content-Length, a longer
// or flushed one is chunked (close-delimited for HTTP/1.0 clients). The
// handler's ResponseWriter implements http.Flusher and the deadlines of
// http.ResponseController. TLS and HTTP/2 are net/http's business: serve
// them with http.Server.
package h1serve

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/workers/rawio"
)

// DefaultWatchDelay is Server.WatchDelay's default where the epoll set
// does not follow connections: a client that goes away is noticed within
// 10–20 ms, a small part of a generation's time,
// and the watcher's ticks cost a hundred wake-ups a second while requests
// run, whatever their number.
const DefaultWatchDelay = 10 * time.Millisecond

// Server serves HTTP/1.1 on plain connections. Set its fields before
// Serve; they are not changed after.
type Server struct {
	Handler http.Handler
	// ReadHeaderTimeout bounds the reading of a request's headers, from its
	// first byte; 0 is none.
	ReadHeaderTimeout time.Duration
	// IdleTimeout bounds the wait for a connection's next request; 0 is
	// none.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's line and headers: a request over it
	// is answered 431 and its connection closed. 0 is
	// http.DefaultMaxHeaderBytes.
	MaxHeaderBytes int
	// RequestTimeout, if not 0, is the deadline of each request's
	// context, from the reading of its head: a handler that bounds its
	// requests so needs no context of its own for it.
	RequestTimeout time.Duration
	// BaseContext returns the context of the requests of connections l
	// accepts; nil is context.Background.
	BaseContext func(l net.Listener) context.Context
	// ConnState is called as a connection changes state (New, Active,
	// Idle, Closed), as http.Server's.
	ConnState func(net.Conn, http.ConnState)
	// ErrorLog logs accept errors and handler panics; nil is slog.Default.
	ErrorLog *slog.Logger
	// WatchDelay is, where the epoll set does not follow a connection, how
	// long a request runs, its body read, before its
	// connection is watched for the client going away (up to twice as
	// long: the watches start on a tick of this period); 0 is
	// DefaultWatchDelay.
	WatchDelay time.Duration

	watchHook func() // tests: called as a watch starts reading
	tickWatch bool   // tests: watches started by the watcher's ticks, as where epoll is not
	watcher   watchers
	hupsOnce  sync.Once
	hups      *hangups // nil where clients' hang-ups cannot be followed
	shutdown  atomic.Bool
	mu        sync.Mutex
	listeners map[*net.Listener]struct{}
	conns     map[*conn]struct{}
	gone      chan struct{} // a connection closed, for Shutdown's wait
}

// Serve accepts connections on l and serves each on its own goroutine.
// It returns http.ErrServerClosed after Shutdown or Close, and otherwise
// the error Accept returned that was not temporary. It closes l.
func (s *Server) Serve(l net.Listener) error {
	if !s.track(&l, true) {
		l.Close()
		return http.ErrServerClosed
	}
	defer s.track(&l, false)
	ctx := context.Background()
	if s.BaseContext != nil {
		ctx = s.BaseContext(l)
	}
	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if s.shutdown.Load() {
				return http.ErrServerClosed
			}
			if t, ok := err.(interface{ Temporary() bool }); ok && t.Temporary() {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.logger().Warn("accepting a connection", "err", err, "retry_in", backoff)
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		c := &conn{srv: s, nc: nc, base: ctx, created: time.Now()}
		if !s.add(c) {
			nc.Close()
			return http.ErrServerClosed
		}
		c.setState(http.StateNew)
		s.followHangups(c)
		go c.serve()
	}
}

// followHangups has the server's epoll set follow c's connection, so that
// its client going cancels its request at once; where that cannot be,
// c's watches are started by the watcher's ticks.
func (s *Server) followHangups(c *conn) {
	if s.tickWatch {
		return
	}
	s.hupsOnce.Do(func() {
		h, err := newHangups()
		if err != nil {
			s.logger().Warn("clients that go are noticed by reading their connection after a delay", "err", err)
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.shutdown.Load() {
			h.close()
			return
		}
		s.hups = h
	})
	if s.hups != nil {
		s.hups.add(c)
	}
}

func (s *Server) logger() *slog.Logger {
	if s.ErrorLog != nil {
		return s.ErrorLog
	}
	return slog.Default()
}

func (s *Server) track(l *net.Listener, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if add {
		if s.shutdown.Load() {
			return false
		}
		if s.listeners == nil {
			s.listeners = map[*net.Listener]struct{}{}
		}
		s.listeners[l] = struct{}{}
		return true
	}
	delete(s.listeners, l)
	return true
}

func (s *Server) add(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutdown.Load() {
		return false
	}
	if s.conns == nil {
		s.conns = map[*conn]struct{}{}
		s.gone = make(chan struct{}, 1)
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Server) remove(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	gone := s.gone
	s.mu.Unlock()
	select {
	case gone <- struct{}{}:
	default:
	}
}

// newConnGrace is how long Shutdown waits for a new connection's first
// request; shutdownPoll how often it looks again at its connections.
const (
	newConnGrace = 5 * time.Second
	shutdownPoll = 500 * time.Millisecond
)

// Shutdown stops accepting connections, closes those idle (and new ones
// that sent nothing for newConnGrace), and waits until
// ctx is done for the others to finish their request (each is closed after
// it). It returns ctx's error if they did not all finish. It can be called
// again, to wait longer.
func (s *Server) Shutdown(ctx context.Context) error {
	s.shutdown.Store(true)
	s.closeListeners()
	for {
		s.mu.Lock()
		n := 0
		for c := range s.conns {
			if !c.closeIfIdle() {
				n++
			}
		}
		gone := s.gone
		s.mu.Unlock()
		if n == 0 {
			s.watcher.close()
			s.closeHangups()
			return nil
		}
		t := time.NewTimer(shutdownPoll)
		select {
		case <-gone:
		case <-t.C: // a new connection's grace may have run out
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
		t.Stop()
	}
}

// Close stops accepting connections and closes every connection at once.
func (s *Server) Close() error {
	s.shutdown.Store(true)
	err := s.closeListeners()
	s.mu.Lock()
	for c := range s.conns {
		c.nc.Close()
	}
	s.mu.Unlock()
	s.watcher.close()
	s.closeHangups()
	return err
}

func (s *Server) closeHangups() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.hups != nil {
		s.hups.close()
	}
}

func (s *Server) closeListeners() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	for l := range s.listeners {
		if e := (*l).Close(); e != nil && err == nil {
			err = e
		}
	}
	return err
}

// A conn is one client connection.
type conn struct {
	srv  *Server
	nc   net.Conn
	rio  rawio.Conn // nc's reads and writes, out of the runtime's sight
	base context.Context
	br   *bufio.Reader
	bw   *bufio.Writer
	lr   limitReader // between nc and br: bounds a request's headers
	buf  []byte      // a response's body before its header is sent
	// header is the response header map, emptied and given to each
	// request in turn: a handler's ResponseWriter is not used once it
	// returns.
	header http.Header

	created time.Time
	hupID   uint64 // in the server's hangups set when not 0

	mu     sync.Mutex
	state  http.ConnState
	closed bool // by Shutdown, while idle

	// The watch for a client that goes away (watch.go).
	watch watch
}

// closeIfIdle closes c if it waits for a request, and reports whether it
// did or c was closed already.
func (c *conn) closeIfIdle() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return true
	}
	// A new connection's request may be on its way: as net/http, it has
	// newConnGrace to send it.
	if c.state == http.StateIdle || c.state == http.StateNew && time.Since(c.created) >= newConnGrace {
		c.closed = true
		c.nc.Close()
		return true
	}
	return false
}

// setState records st and tells ConnState. It returns false when the
// connection is to be closed instead of becoming active.
func (c *conn) setState(st http.ConnState) bool {
	c.mu.Lock()
	if c.closed && st == http.StateActive {
		c.mu.Unlock()
		return false
	}
	c.state = st
	c.mu.Unlock()
	if f := c.srv.ConnState; f != nil {
		f(c.nc, st)
	}
	return true
}

func (c *conn) serve() {
	defer func() {
		if v := recover(); v != nil && v != http.ErrAbortHandler {
			buf := make([]byte, 16<<10)
			buf = buf[:runtime.Stack(buf, false)]
			c.srv.logger().Error("handler panicked", "remote", c.nc.RemoteAddr().String(), "panic", v, "stack", string(buf))
		}
		c.watch.stop(c)
		if c.hupID != 0 {
			c.srv.hups.remove(c.hupID)
		}
		c.nc.Close()
		c.setState(http.StateClosed)
		c.srv.remove(c)
	}()
	c.lr.c = c
	c.rio.Init(c.nc)
	c.br = bufio.NewReaderSize(&c.lr, 4<<10)
	c.bw = bufio.NewWriterSize(&c.rio, 4<<10)
	c.buf = make([]byte, 0, bufferBeforeChunking)
	for first := true; ; first = false {
		if !c.next(first) {
			return
		}
	}
}

// Read reads the connection, first any byte the watch read ahead.
func (c *conn) Read(p []byte) (int, error) {
	return c.watch.read(c, p)
}

// limitReader reads c, at most n bytes while n ≥ 0, and records hitting n.
type limitReader struct {
	c   *conn
	n   int64 // < 0: no limit
	hit bool
}

func (l *limitReader) Read(p []byte) (int, error) {
	if l.n < 0 {
		return l.c.Read(p)
	}
	if l.n == 0 {
		l.hit = true
		return 0, io.EOF
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.c.Read(p)
	l.n -= int64(n)
	return n, err
}

// next waits for the connection's next request and serves it. It returns
// false when the connection is to close.
func (c *conn) next(first bool) bool {
	s := c.srv
	maxHeader := s.MaxHeaderBytes
	if maxHeader <= 0 {
		maxHeader = http.DefaultMaxHeaderBytes
	}
	// As net/http: the header limit, with room for a bufio's fill.
	c.lr.n, c.lr.hit = int64(maxHeader)+4096, false
	if !first {
		if !c.setState(http.StateIdle) {
			return false
		}
		if s.shutdown.Load() {
			return false
		}
	}
	if d := s.IdleTimeout; d > 0 && !first {
		c.nc.SetReadDeadline(time.Now().Add(d))
	} else if d := s.ReadHeaderTimeout; d > 0 && first {
		c.nc.SetReadDeadline(time.Now().Add(d))
	}
	if _, err := c.br.Peek(1); err != nil {
		return false
	}
	if !c.setState(http.StateActive) {
		return false
	}
	if d := s.ReadHeaderTimeout; d > 0 {
		c.nc.SetReadDeadline(time.Now().Add(d))
	} else if s.IdleTimeout > 0 {
		c.nc.SetReadDeadline(time.Time{})
	}
	req, err := http.ReadRequest(c.br)
	if err != nil {
		c.refuse(err)
		return false
	}
	c.lr.n = -1
	if s.ReadHeaderTimeout > 0 {
		c.nc.SetReadDeadline(time.Time{})
	}
	if status, msg := check(req); status != 0 {
		c.reply(status, msg)
		return false
	}
	return c.handle(req)
}

// check returns the status and message of a request net/http's server
// refuses that ReadRequest accepts.
func check(req *http.Request) (int, string) {
	if req.ProtoMajor != 1 {
		return http.StatusHTTPVersionNotSupported, "unsupported protocol version"
	}
	if req.ProtoAtLeast(1, 1) && req.Host == "" {
		if _, ok := req.Header["Host"]; !ok {
			return http.StatusBadRequest, "missing required Host header"
		}
	}
	if len(req.Header["Host"]) > 1 {
		return http.StatusBadRequest, "too many Host headers"
	}
	if req.Method == "PRI" && req.RequestURI == "*" {
		return http.StatusBadRequest, "HTTP/2 is not served here"
	}
	return 0, ""
}

// refuse answers a request that could not be read, as net/http does: 431
// for headers over the limit, 400 for a malformed request, nothing when
// the connection closed or timed out.
func (c *conn) refuse(err error) {
	if c.lr.hit {
		c.reply(http.StatusRequestHeaderFieldsTooLarge, "")
		return
	}
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
		return
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return
	}
	c.reply(http.StatusBadRequest, "")
}

// reply writes a plain-text error of the server's own and half-closes the
// connection, so that a client still sending reads it rather than a reset.
func (c *conn) reply(status int, msg string) {
	c.nc.SetWriteDeadline(time.Now().Add(time.Second))
	if msg == "" {
		msg = http.StatusText(status)
	} else {
		msg = http.StatusText(status) + ": " + msg
	}
	io.WriteString(c.bw, "HTTP/1.1 "+statusLine(status)+"\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"+msg)
	c.bw.Flush()
	c.linger()
}

// linger ends a connection whose client may still be sending (a body the
// handler did not read, a request refused before its end): it half-closes
// it and reads what comes for up to half a second, so that the client
// reads the answer before the close, rather than the reset that closing
// over unread bytes makes the kernel send.
func (c *conn) linger() {
	cw, ok := c.nc.(interface{ CloseWrite() error })
	if !ok {
		return
	}
	cw.CloseWrite()
	c.nc.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	io.Copy(io.Discard, io.LimitReader(c.nc, 16<<20))
}

// handle serves req and reports whether the connection stays open.
func (c *conn) handle(req *http.Request) bool {
	var ctx context.Context
	var cancel context.CancelFunc
	if d := c.srv.RequestTimeout; d > 0 {
		ctx, cancel = context.WithTimeout(c.base, d)
	} else {
		ctx, cancel = context.WithCancel(c.base)
	}
	defer cancel()
	req = req.WithContext(ctx)
	req.RemoteAddr = c.nc.RemoteAddr().String()
	if c.header == nil {
		c.header = make(http.Header, 8)
	}
	clear(c.header)
	w := &response{c: c, req: req, header: c.header, contentLength: -1, buf: c.buf[:0]}
	w.closeAfter = req.Close || !req.ProtoAtLeast(1, 1) && !keepAlive(req)
	body := &body{rc: req.Body, w: w}
	w.body = body
	if req.ProtoAtLeast(1, 1) && req.ContentLength != 0 {
		if e, ok := req.Header["Expect"]; ok {
			if len(e) != 1 || !asciiEqualFold(e[0], "100-continue") {
				w.closeAfter = true
				w.Header().Set("Connection", "close")
				http.Error(w, "unsupported Expect header", http.StatusExpectationFailed)
				w.finish()
				c.linger() // its body may be on its way
				return false
			}
			body.cont = true
			req.Header.Del("Expect")
		}
	}
	req.Body = body
	if req.ContentLength == 0 && len(req.TransferEncoding) == 0 {
		body.eof = true
		c.watch.arm(c, cancel)
	}
	w.cancel = cancel
	c.srv.Handler.ServeHTTP(w, req)
	c.watch.stop(c)
	if w.broken {
		return false
	}
	w.finish()
	if w.broken {
		return false
	}
	if w.closeAfter {
		if !body.eof {
			c.linger()
		}
		return false
	}
	// What the handler left of the body is read and dropped, up to a
	// bound past which closing is cheaper; a body the client was asked
	// to send (100-continue) and never was is not waited for.
	if !body.eof {
		if body.cont && !body.continued {
			return false
		}
		n, err := io.CopyN(io.Discard, body.rc, maxPostHandlerRead+1)
		if err != io.EOF || n > maxPostHandlerRead {
			c.linger()
			return false
		}
	}
	if w.wroteDeadline {
		c.nc.SetWriteDeadline(time.Time{})
	}
	if w.readDeadline {
		c.nc.SetReadDeadline(time.Time{})
	}
	return !c.srv.shutdown.Load()
}

// maxPostHandlerRead is how much of a body its handler left is read and
// dropped to keep the connection; past it the connection closes.
const maxPostHandlerRead = 256 << 10

// keepAlive reports whether an HTTP/1.0 request asked to keep its
// connection.
func keepAlive(req *http.Request) bool {
	for _, v := range req.Header["Connection"] {
		if asciiEqualFold(v, "keep-alive") {
			return true
		}
	}
	return false
}

func asciiEqualFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// body is a request's body as the handler reads it: it sends 100 Continue
// before the first read when the client waits for it, and arms the watch
// once it has been read to its end.
type body struct {
	rc        io.ReadCloser
	w         *response
	cont      bool // the client waits for 100 Continue
	continued bool
	eof       bool
}

func (b *body) Read(p []byte) (int, error) {
	if b.eof {
		return 0, io.EOF
	}
	if b.cont && !b.continued {
		b.continued = true
		if !b.w.sent {
			c := b.w.c
			c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
			if err := c.bw.Flush(); err != nil {
				b.w.broken = true
				return 0, err
			}
		}
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof = true
		b.w.c.watch.arm(b.w.c, b.w.cancel)
	}
	return n, err
}

func (b *body) Close() error { return nil }
