package h1serve

import (
	"errors"
	"net"
	"sync"
	"time"
)

// aLongTimeAgo is a read deadline that ends a blocked read at once.
var aLongTimeAgo = time.Unix(1, 0)

// watch notices a client that goes away while its request runs. Armed
// once the request's body is read, it cancels the request when the
// client goes. Where the server's epoll set follows the connection
// (hangup_linux.go), that set's goroutine calls hangup as the client
// closes or resets it. Elsewhere, the server's watcher (watchers) starts
// the watch once armed for WatchDelay: it reads the connection from a
// goroutine of its own, where an end of the connection cancels the
// request and a byte (the next request, pipelined) is kept for the
// connection's reader. stop ends it when the handler returns.
type watch struct {
	mu       sync.Mutex
	gone     bool // the client closed or reset the connection (hangups)
	armed    bool
	armedAt  time.Time
	listed   bool // in the server's watcher list; guarded by the watcher's mu
	cancel   func()
	running  bool // the watch's goroutine reads the connection
	aborting bool
	done     chan struct{} // closed when the running read returned

	// A byte the read took from the connection; read by the connection's
	// goroutine only once the watch has stopped.
	ahead    [1]byte
	hasAhead bool
}

func (wt *watch) arm(c *conn, cancel func()) {
	wt.mu.Lock()
	if wt.hasAhead {
		wt.mu.Unlock()
		return // the client sent more already: it is there
	}
	if c.hupID != 0 {
		if wt.gone {
			wt.mu.Unlock()
			cancel()
			return
		}
		wt.armed, wt.cancel = true, cancel
		wt.mu.Unlock()
		return
	}
	wt.armed, wt.armedAt, wt.cancel = true, time.Now(), cancel
	wt.mu.Unlock()
	c.srv.watcher.add(c)
}

// hangup is called, from the server's hangups set, as the client closes
// or resets the connection: the running request, if armed, is cancelled,
// and any request read after is cancelled as it is armed.
func (wt *watch) hangup() {
	wt.mu.Lock()
	wt.gone = true
	var cancel func()
	if wt.armed {
		cancel = wt.cancel
	}
	wt.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// due starts the watch if it has been armed for d by now, and reports
// whether it is still to be looked at again (armed, not yet due).
func (wt *watch) due(c *conn, now time.Time, d time.Duration) (pending bool) {
	wt.mu.Lock()
	if !wt.armed {
		wt.mu.Unlock()
		return false
	}
	if now.Sub(wt.armedAt) < d {
		wt.mu.Unlock()
		return true
	}
	wt.armed, wt.running = false, true
	done := make(chan struct{})
	wt.done = done
	cancel := wt.cancel
	wt.mu.Unlock()
	go wt.run(c, cancel, done)
	return false
}

// run reads the connection until the client sends or goes, or stop ends
// the read.
func (wt *watch) run(c *conn, cancel func(), done chan struct{}) {
	if h := c.srv.watchHook; h != nil {
		h()
	}
	n, err := c.nc.Read(wt.ahead[:])

	wt.mu.Lock()
	wt.running = false
	wt.hasAhead = n > 0
	aborted := wt.aborting
	wt.mu.Unlock()
	var ne net.Error
	if n == 0 && err != nil && !aborted && !(errors.As(err, &ne) && ne.Timeout()) {
		cancel() // the client closed or reset the connection
	}
	close(done)
}

// stop disarms the watch and ends a read in progress.
func (wt *watch) stop(c *conn) {
	wt.mu.Lock()
	wt.armed = false
	if !wt.running {
		wt.mu.Unlock()
		return
	}
	wt.aborting = true
	done := wt.done
	wt.mu.Unlock()
	c.nc.SetReadDeadline(aLongTimeAgo)
	<-done
	c.nc.SetReadDeadline(time.Time{})
	wt.mu.Lock()
	wt.aborting = false
	wt.mu.Unlock()
}

// read reads the connection for its own goroutine, the byte read ahead
// first.
func (wt *watch) read(c *conn, p []byte) (int, error) {
	if wt.hasAhead && len(p) > 0 {
		wt.mu.Lock()
		wt.hasAhead = false
		p[0] = wt.ahead[0]
		wt.mu.Unlock()
		return 1, nil
	}
	return c.rio.Read(p)
}

// watchers starts the watches of a server's connections. A timer a
// request, set as its body is read, would wake one of the runtime's
// threads for each request (a timer earlier than the poller's next
// wake-up interrupts it); one goroutine looks at every armed watch each
// WatchDelay instead, while any is armed and for watcherLinger ticks
// after, so that a connection's watch starts between one and two
// WatchDelays after it was armed.
type watchers struct {
	mu      sync.Mutex
	list    []*conn // armed when listed; a disarmed one leaves at the next tick
	running bool
	closed  bool          // the server closed: no watch starts any more
	quit    chan struct{} // closed to end the running watcher
	done    chan struct{} // closed as the last watcher ended
}

// watcherLinger is how many ticks the watcher keeps ticking with nothing
// armed before it ends, to be started again by the next arm: steady
// traffic keeps one goroutine ticking rather than starting one a request.
const watcherLinger = 100

// minWatchTick bounds how often the watcher ticks.
const minWatchTick = 50 * time.Microsecond

func (ws *watchers) add(c *conn) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.closed {
		return
	}
	if !c.watch.listed {
		c.watch.listed = true
		ws.list = append(ws.list, c)
	}
	if !ws.running {
		ws.running = true
		ws.quit, ws.done = make(chan struct{}), make(chan struct{})
		go ws.run(c.srv, ws.quit, ws.done)
	}
}

// close ends the watcher, once the server's connections are closed or
// done, and waits for it to end.
func (ws *watchers) close() {
	ws.mu.Lock()
	ws.closed = true
	if ws.running {
		ws.running = false
		close(ws.quit)
	}
	done := ws.done
	ws.mu.Unlock()
	if done != nil {
		<-done
	}
}

func (ws *watchers) run(s *Server, quit, done chan struct{}) {
	defer close(done)
	d := s.WatchDelay
	if d <= 0 {
		d = DefaultWatchDelay
	}
	t := time.NewTicker(max(d, minWatchTick))
	defer t.Stop()
	idle := 0
	for {
		var now time.Time
		select {
		case now = <-t.C:
		case <-quit:
			return
		}
		ws.mu.Lock()
		keep := ws.list[:0]
		for _, c := range ws.list {
			if c.watch.due(c, now, d) {
				keep = append(keep, c)
			} else {
				c.watch.listed = false
			}
		}
		clear(ws.list[len(keep):])
		ws.list = keep
		if len(keep) > 0 {
			idle = 0
		} else if idle++; idle >= watcherLinger {
			ws.running = false
			ws.mu.Unlock()
			return
		}
		ws.mu.Unlock()
	}
}
