package h1serve

import (
	"errors"
	"os"
	"sync"
	"syscall"
)

// hangups learns of clients that close or reset their connection from an
// epoll set of its own, where each connection is added once, as it is
// accepted, for EPOLLRDHUP (the client's FIN) and the hang-ups and errors
// epoll always reports, edge-triggered. The set's own descriptor is
// followed by the runtime's poller, so that one goroutine sleeps until a
// client goes: a request costs nothing, and a client that goes is noticed
// at once, while its request waits on an engine as while it streams.
// Bytes a client sends (its next request) are not asked for: they wake
// nobody.
type hangups struct {
	f  *os.File // the epoll descriptor, in the runtime's poller
	rc syscall.RawConn

	mu    sync.Mutex
	conns map[uint64]*conn
	next  uint64
}

// epollET is EPOLLET as epoll_event's events field holds it.
const epollET = 1 << 31

func newHangups() (*hangups, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("setnonblock", err)
	}
	f := os.NewFile(uintptr(fd), "h1serve-hangups")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	h := &hangups{f: f, rc: rc, conns: map[uint64]*conn{}}
	go h.run()
	return h, nil
}

// add follows c's connection, and reports whether it can: the connection
// must expose its descriptor (syscall.Conn).
func (h *hangups) add(c *conn) bool {
	sc, ok := c.nc.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	h.mu.Lock()
	h.next++
	id := h.next
	h.conns[id] = c
	h.mu.Unlock()
	ev := syscall.EpollEvent{Events: syscall.EPOLLRDHUP | syscall.EPOLLHUP | syscall.EPOLLERR | epollET}
	ev.Fd, ev.Pad = int32(uint32(id)), int32(uint32(id>>32))
	var cerr, aerr error
	err = h.rc.Control(func(epfd uintptr) {
		cerr = raw.Control(func(fd uintptr) {
			aerr = syscall.EpollCtl(int(epfd), syscall.EPOLL_CTL_ADD, int(fd), &ev)
		})
	})
	if err != nil || cerr != nil || aerr != nil {
		h.remove(id)
		return false
	}
	c.hupID = id
	return true
}

// remove forgets the connection of id; the kernel drops it from the set
// as its descriptor closes.
func (h *hangups) remove(id uint64) {
	h.mu.Lock()
	delete(h.conns, id)
	h.mu.Unlock()
}

func (h *hangups) run() {
	var evs [64]syscall.EpollEvent
	for {
		n := 0
		err := h.rc.Read(func(fd uintptr) bool {
			var err error
			n, err = syscall.EpollWait(int(fd), evs[:], 0)
			if err != nil {
				n = 0
				return !errors.Is(err, syscall.EINTR) && !errors.Is(err, syscall.EAGAIN)
			}
			return n > 0
		})
		if err != nil {
			return // closed
		}
		for _, ev := range evs[:n] {
			id := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			h.mu.Lock()
			c := h.conns[id]
			h.mu.Unlock()
			if c != nil {
				c.watch.hangup()
			}
		}
	}
}

func (h *hangups) close() { h.f.Close() }
