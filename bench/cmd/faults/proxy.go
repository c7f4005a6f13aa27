package main

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// proxyBase is what the harness's TCP proxies share: a loopback listener
// whose connections each go to serve with a connection dialled to the
// target, and the connections open either side, which close closes.
type proxyBase struct {
	l      net.Listener
	target string

	connMu sync.Mutex
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// start listens on a loopback port and hands each connection c to serve
// with u, a connection to target; both are closed when serve returns. A
// connection whose target does not answer is closed at once: its client
// sees the target down.
func (p *proxyBase) start(target string, serve func(c, u net.Conn)) error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	p.l, p.target, p.conns = l, target, map[net.Conn]struct{}{}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := p.l.Accept()
			if err != nil {
				return
			}
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				p.connect(c, serve)
			}()
		}
	}()
	return nil
}

// connect dials the target for c and runs serve on the pair, tracked
// for close.
func (p *proxyBase) connect(c net.Conn, serve func(c, u net.Conn)) {
	defer c.Close()
	u, err := net.DialTimeout("tcp", p.target, time.Second)
	if err != nil {
		return
	}
	defer u.Close()
	p.track(c, true)
	p.track(u, true)
	defer p.track(c, false)
	defer p.track(u, false)
	serve(c, u)
}

func (p *proxyBase) addr() string { return p.l.Addr().String() }

func (p *proxyBase) track(c net.Conn, add bool) {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	if add {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

// close stops accepting and closes every connection.
func (p *proxyBase) close() {
	p.l.Close()
	p.connMu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.connMu.Unlock()
	p.wg.Wait()
}

// delayProxy forwards TCP connections from its loopback port to target,
// holding every chunk it forwards, either way, for the current delay: a
// slow network or a slow server.
type delayProxy struct {
	proxyBase
	delay atomic.Int64 // nanoseconds
	down  atomic.Bool  // cut: connections are closed as they come
}

// setDown cuts the proxy (every connection open is closed, and new ones
// at once) or restores it.
func (p *delayProxy) setDown(down bool) {
	p.down.Store(down)
	if down {
		p.connMu.Lock()
		for c := range p.conns {
			c.Close()
		}
		p.connMu.Unlock()
	}
}

func newDelayProxy(target string) (*delayProxy, error) {
	p := &delayProxy{}
	if err := p.start(target, p.serve); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *delayProxy) setDelay(d time.Duration) { p.delay.Store(int64(d)) }

func (p *delayProxy) serve(c, u net.Conn) {
	if p.down.Load() {
		return
	}
	done := make(chan struct{}, 2)
	go func() { p.pipe(u, c); done <- struct{}{} }()
	go func() { p.pipe(c, u); done <- struct{}{} }()
	<-done
	c.Close()
	u.Close()
	<-done
}

func (p *delayProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if d := time.Duration(p.delay.Load()); d > 0 {
				time.Sleep(d)
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// blackHole accepts connections on addr and never answers: a worker that
// hangs. Its connections stay open until close.
type blackHole struct {
	l     net.Listener
	mu    sync.Mutex
	conns []net.Conn
	done  chan struct{}
}

func newBlackHole(addr string) (*blackHole, error) {
	var l net.Listener
	var err error
	// The worker it replaces has just been killed: its port may take a
	// moment to be free.
	for range 50 {
		if l, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return nil, err
	}
	b := &blackHole{l: l, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			b.mu.Lock()
			b.conns = append(b.conns, c)
			b.mu.Unlock()
		}
	}()
	return b, nil
}

func (b *blackHole) close() {
	b.l.Close()
	<-b.done
	b.mu.Lock()
	for _, c := range b.conns {
		c.Close()
	}
	b.mu.Unlock()
}
