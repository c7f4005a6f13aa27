package httpengine

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/batonllm/baton/workers/rawio"
)

// h1Transport is the round tripper of plain-http engines: HTTP/1.1 over a
// pool of keep-alive connections, each request written and its response
// read on the caller's goroutine. net/http's Transport hands every request
// to a connection's writer goroutine and its response back from a reader
// goroutine; on a busy scheduler those hand-offs, not the bytes, are most
// of the time from a request to the engine's first byte. Parsing and
// framing (chunked bodies, Content-Length, trailers) are net/http's own
// (Request.Write, ReadResponse).
//
// A context that ends while a request is in flight expires the
// connection's deadline, so the blocked read or write returns at once and
// the connection is closed. https URLs go to next.
type h1Transport struct {
	dial          func(ctx context.Context, network, addr string) (net.Conn, error)
	headerTimeout time.Duration // 0: none
	maxIdle       int           // idle connections kept per host
	idleTimeout   time.Duration
	next          http.RoundTripper
	now           func() time.Time

	mu   sync.Mutex
	idle map[string][]*h1Conn // by host:port, most recently used last
}

// PlainHTTP returns a round tripper that sends http:// requests as
// h1Transport does, on the caller's goroutine over pooled keep-alive
// connections (dialled with a 5s timeout), and everything else (https)
// through next. Its CloseIdleConnections closes next's too. The vllm and
// llamacpp packages' scrapers and tokenizers use it.
func PlainHTTP(next *http.Transport) interface {
	http.RoundTripper
	CloseIdleConnections()
} {
	return newH1Transport(0, next)
}

func newH1Transport(headerTimeout time.Duration, next http.RoundTripper) *h1Transport {
	return &h1Transport{
		dial: (&net.Dialer{
			Timeout:   5 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		headerTimeout: headerTimeout,
		maxIdle:       256,
		idleTimeout:   90 * time.Second,
		next:          next,
		now:           time.Now,
		idle:          make(map[string][]*h1Conn),
	}
}

// h1Conn is one pooled connection.
type h1Conn struct {
	addr   string
	nc     net.Conn
	rio    rawio.Conn // nc's reads and writes, out of the runtime's sight
	br     *bufio.Reader
	bw     *bufio.Writer
	idleAt time.Time

	mu        sync.Mutex
	cancelled bool // the request's context ended: deadlines stay expired
}

// longAgo is a deadline that has passed.
var longAgo = time.Unix(1, 0)

// cancel expires the connection's deadlines for good.
func (pc *h1Conn) cancel() {
	pc.mu.Lock()
	pc.cancelled = true
	_ = pc.nc.SetDeadline(longAgo)
	pc.mu.Unlock()
}

// setReadDeadline sets the read deadline unless the request was cancelled.
func (pc *h1Conn) setReadDeadline(t time.Time) {
	pc.mu.Lock()
	if !pc.cancelled {
		_ = pc.nc.SetReadDeadline(t)
	}
	pc.mu.Unlock()
}

// errH1Stale marks a failure on a pooled connection before any of the
// request reached the engine: safe to send again on a new one.
var errH1Stale = errors.New("pooled connection closed by the engine")

func (t *h1Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" || req.URL.Host == "" {
		return t.next.RoundTrip(req)
	}
	addr := canonicalAddr(req.URL)
	ctx := req.Context()
	for attempt := 0; ; attempt++ {
		pc, reused, err := t.conn(ctx, addr, attempt == 0)
		if err != nil {
			closeBody(req)
			return nil, err
		}
		resp, err := t.exchange(ctx, pc, req)
		if err == nil {
			return resp, nil
		}
		if reused && errors.Is(err, errH1Stale) && ctx.Err() == nil && attempt == 0 {
			if req.Body == nil || req.Body == http.NoBody {
				continue
			}
			if req.GetBody != nil {
				body, gerr := req.GetBody()
				if gerr == nil {
					r2 := *req
					r2.Body = body
					req = &r2
					continue
				}
			}
		}
		closeBody(req)
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, fmt.Errorf("%w: %w", ctxErr, err)
		}
		return nil, err
	}
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// exchange writes req on pc and reads the response's head. On error pc is
// closed.
func (t *h1Transport) exchange(ctx context.Context, pc *h1Conn, req *http.Request) (*http.Response, error) {
	stop := t.begin(ctx, pc)
	fail := func(err error) (*http.Response, error) {
		stop()
		_ = pc.nc.Close()
		return nil, err
	}
	if err := req.Write(pc.bw); err != nil {
		return fail(fmt.Errorf("writing the request: %w", err))
	}
	if err := pc.send(); err != nil {
		return fail(err)
	}
	var resp *http.Response
	for {
		r, err := http.ReadResponse(pc.br, req)
		if err != nil {
			return fail(fmt.Errorf("reading the response: %w", err))
		}
		if r.StatusCode >= 100 && r.StatusCode < 200 && r.StatusCode != http.StatusSwitchingProtocols {
			continue // interim answers (100 Continue, 103 Early Hints)
		}
		resp = r
		break
	}
	if t.headerTimeout > 0 {
		pc.setReadDeadline(time.Time{})
	}
	if resp.StatusCode == http.StatusSwitchingProtocols {
		return fail(errors.New("the engine switched protocols"))
	}
	b := &h1Body{rc: resp.Body, t: t, pc: pc, stop: stop, reuse: !resp.Close && !req.Close}
	if resp.Body == http.NoBody {
		b.finish(true)
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

// begin starts an exchange on pc: the wait for the answer's head bounded
// by headerTimeout, and ctx's end expiring pc's deadlines until the
// returned stop is called.
func (t *h1Transport) begin(ctx context.Context, pc *h1Conn) (stop func() bool) {
	if t.headerTimeout > 0 {
		pc.setReadDeadline(t.now().Add(t.headerTimeout))
	}
	return context.AfterFunc(ctx, pc.cancel)
}

// send flushes the request written to pc.bw and waits for the answer's
// first byte. An error wraps errH1Stale where none of the request can have
// been read: the flush failed, or the engine closed the connection without
// a byte of answer.
func (pc *h1Conn) send() error {
	if err := pc.bw.Flush(); err != nil {
		return fmt.Errorf("%w: %w", errH1Stale, err)
	}
	if _, err := pc.br.Peek(1); err != nil {
		if isClosedWhileIdle(err) {
			err = fmt.Errorf("%w: %w", errH1Stale, err)
		}
		return fmt.Errorf("reading the response: %w", err)
	}
	return nil
}

// isClosedWhileIdle reports whether err, the first read of an answer,
// says the engine closed the connection without a byte of answer: it had
// closed it while idle.
func isClosedWhileIdle(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

// peekAfter is how long a connection stays idle before it is looked at
// (alive) as it is taken from the pool: engines' servers close idle
// connections after seconds (uvicorn's keep-alive is 5s), and one closed
// sooner fails its request before any of it is read, which is sent again.
const peekAfter = time.Second

// conn returns a pooled connection to addr or dials one; reused reports a
// pooled one.
func (t *h1Transport) conn(ctx context.Context, addr string, pooled bool) (pc *h1Conn, reused bool, err error) {
	for pooled {
		pc = t.take(addr)
		if pc == nil {
			break
		}
		idle := t.now().Sub(pc.idleAt)
		if idle > t.idleTimeout || idle > peekAfter && !alive(pc.nc) {
			_ = pc.nc.Close()
			continue
		}
		return pc, true, nil
	}
	nc, err := t.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	pc = &h1Conn{addr: addr, nc: nc}
	pc.rio.Init(nc)
	pc.br = bufio.NewReaderSize(&pc.rio, 16<<10)
	pc.bw = bufio.NewWriterSize(&pc.rio, 16<<10)
	return pc, false, nil
}

func (t *h1Transport) take(addr string) *h1Conn {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.idle[addr]
	if len(l) == 0 {
		return nil
	}
	pc := l[len(l)-1]
	l[len(l)-1] = nil
	t.idle[addr] = l[:len(l)-1]
	return pc
}

// put returns pc to the pool, or closes it when the pool is full.
func (t *h1Transport) put(pc *h1Conn) {
	pc.idleAt = t.now()
	t.mu.Lock()
	l := t.idle[pc.addr]
	if len(l) < t.maxIdle {
		t.idle[pc.addr] = append(l, pc)
		pc = nil
	}
	t.mu.Unlock()
	if pc != nil {
		_ = pc.nc.Close()
	}
}

// CloseIdleConnections closes the pooled connections (http.Client calls it).
func (t *h1Transport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = make(map[string][]*h1Conn)
	t.mu.Unlock()
	for _, l := range idle {
		for _, pc := range l {
			_ = pc.nc.Close()
		}
	}
	if ci, ok := t.next.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
}

// h1Body is a response body whose connection goes back to the pool once
// the body has been read to its end, and is closed when it is not.
type h1Body struct {
	rc    io.ReadCloser // RoundTrip's: net/http's reader of the body
	t     *h1Transport
	pc    *h1Conn
	stop  func() bool // unregisters the context's cancel
	reuse bool
	done  atomic.Bool

	// post's, where rc is nil: the body is read from pc.br, framed by
	// chunks (Transfer-Encoding: chunked) or else by left, the bytes of
	// its Content-Length still to read (-1: to the connection's end).
	answer answer
	chunks io.Reader
	left   int64
	ended  bool // the chunked body was read to its end
}

func (b *h1Body) chunked() bool { return b.chunks != nil }

func (b *h1Body) Read(p []byte) (int, error) {
	if b.rc != nil {
		n, err := b.rc.Read(p)
		if err == io.EOF {
			b.finish(b.reuse)
		}
		return n, err
	}
	switch {
	case b.ended:
		return 0, io.EOF
	case b.chunked():
		n, err := b.chunks.Read(p)
		if err == io.EOF {
			b.ended = true
			if terr := readTrailer(b.pc.br); terr != nil {
				b.finish(false)
				return n, fmt.Errorf("reading the body's trailer: %w", terr)
			}
			b.finish(b.reuse)
		}
		return n, err
	case b.left == 0:
		return 0, io.EOF
	case b.left > 0:
		if int64(len(p)) > b.left {
			p = p[:b.left]
		}
		n, err := b.pc.br.Read(p)
		b.left -= int64(n)
		if b.left == 0 {
			b.finish(b.reuse)
			return n, io.EOF
		}
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return n, err
	default:
		n, err := b.pc.br.Read(p)
		if err == io.EOF {
			b.finish(false)
		}
		return n, err
	}
}

// Buffered is how many bytes of the response past its header have
// arrived and wait to be read: a Read now does not block.
func (b *h1Body) Buffered() int {
	if b.done.Load() {
		return 0
	}
	return b.pc.br.Buffered()
}

// Close closes the connection unless the body was read to its end. It may
// be called from another goroutine to abort a blocked Read.
func (b *h1Body) Close() error {
	b.finish(false)
	return nil
}

// finish releases the connection once: to the pool when reuse holds and
// the request's context had not ended, closed otherwise.
func (b *h1Body) finish(reuse bool) {
	if b.done.Swap(true) {
		return
	}
	if reuse && b.stop() && b.pc.br.Buffered() == 0 {
		b.t.put(b.pc)
		return
	}
	b.stop()
	_ = b.pc.nc.Close()
}

// canonicalAddr is u's host:port, port 80 when u names none.
func canonicalAddr(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
	}
	return net.JoinHostPort(u.Hostname(), port)
}
