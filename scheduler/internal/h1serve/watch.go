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
// once the request's body is read, it reads the connection from a timer's
// goroutine after WatchDelay: an end of the connection cancels the
// request; a byte (the next request, pipelined) is kept for the
// connection's reader. stop ends it when the handler returns.
type watch struct {
	mu       sync.Mutex
	timer    *time.Timer
	armed    bool
	cancel   func()
	running  bool // the timer's goroutine reads the connection
	aborting bool
	done     chan struct{} // closed when the running read returned

	// A byte the read took from the connection; read by the connection's
	// goroutine only once the watch has stopped.
	ahead    [1]byte
	hasAhead bool
}

func (wt *watch) arm(c *conn, cancel func()) {
	d := c.srv.WatchDelay
	if d <= 0 {
		d = DefaultWatchDelay
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if wt.hasAhead {
		return // the client sent more already: it is there
	}
	wt.armed, wt.cancel = true, cancel
	if wt.timer == nil {
		wt.timer = time.AfterFunc(d, func() { wt.run(c) })
	} else {
		wt.timer.Reset(d)
	}
}

// run is the timer's: it reads the connection until the client sends or
// goes, or stop ends the read.
func (wt *watch) run(c *conn) {
	wt.mu.Lock()
	if !wt.armed {
		wt.mu.Unlock()
		return
	}
	wt.armed, wt.running = false, true
	done := make(chan struct{})
	wt.done = done
	cancel := wt.cancel
	wt.mu.Unlock()
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
	if wt.timer != nil {
		wt.timer.Stop()
	}
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
	return c.nc.Read(p)
}
