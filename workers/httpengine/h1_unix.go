//go:build unix

package httpengine

import (
	"net"
	"syscall"
)

// alive reports whether an idle connection is still open: the engine has
// neither closed it nor sent anything on it (a peek that would block).
func alive(nc net.Conn) bool {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	open := true
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case n == 0 && err == nil: // orderly close
			open = false
		case n > 0: // bytes nobody asked for
			open = false
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK:
		default:
			open = false
		}
		return true
	})
	return err == nil && open
}
