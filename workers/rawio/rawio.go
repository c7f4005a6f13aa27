// Package rawio reads and writes a socket with system calls the Go
// runtime does not see.
//
// A read or write through net.Conn enters the runtime's system call
// state, and the first one after the process was idle wakes the runtime's
// monitor thread (sysmon), which then polls every 20 µs until the process
// is idle again: a futex wake-up, a few sleeps and as many context
// switches for each request that arrives at an idle proxy, on the path of
// its first byte. A non-blocking socket's read or write never blocks, so
// it can be made as a raw system call instead; where it would block, the
// goroutine waits in the runtime's poller as net.Conn's would.
//
// Conn does so where the connection has a descriptor (Linux); elsewhere,
// and over TLS, it reads and writes the connection itself.
package rawio

import (
	"io"
	"net"
)

// A Conn reads and writes its connection's descriptor directly. The zero
// Conn is not usable; Init one. One goroutine may read while another
// writes; concurrent reads (or writes) are not allowed.
type Conn struct {
	nc  net.Conn
	raw rawConn // zero where the connection has no descriptor

	// The read's and the write's in progress, for the closures made once
	// by Init (a closure made per call would be allocated): one read and
	// one write may run at once, as on a net.Conn, but not two of either.
	rd, wr op
	readF  func(uintptr) bool
	writeF func(uintptr) bool
}

// op is a read's or a write's arguments and results.
type op struct {
	p   []byte
	n   int
	err error
}

// Init makes c read and write nc.
func (c *Conn) Init(nc net.Conn) {
	*c = Conn{nc: nc}
	c.init()
}

// Read reads into p as nc.Read would.
func (c *Conn) Read(p []byte) (int, error) {
	if !c.raw.ok() {
		return c.nc.Read(p)
	}
	return c.read(p)
}

// Write writes p as nc.Write would.
func (c *Conn) Write(p []byte) (int, error) {
	if !c.raw.ok() {
		return c.nc.Write(p)
	}
	return c.write(p)
}

var (
	_ io.Reader = (*Conn)(nil)
	_ io.Writer = (*Conn)(nil)
)

// wrap makes err the *net.OpError nc's own Read or Write would return.
func (c *Conn) wrap(op string, err error) error {
	return &net.OpError{Op: op, Net: c.nc.LocalAddr().Network(), Source: c.nc.LocalAddr(), Addr: c.nc.RemoteAddr(), Err: err}
}
