//go:build linux

package rawio

import (
	"io"
	"os"
	"syscall"
	"unsafe"
)

type rawConn struct {
	rc syscall.RawConn
}

func (r rawConn) ok() bool { return r.rc != nil }

func (c *Conn) init() {
	sc, ok := c.nc.(syscall.Conn)
	if !ok {
		return
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return
	}
	c.raw.rc = rc
	c.readF = c.readFD
	c.writeF = c.writeFD
}

func sysRead(fd uintptr, p []byte) (int, syscall.Errno) {
	if raceBuild {
		n, err := syscall.Read(int(fd), p)
		return max(n, 0), errno(err)
	}
	r, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
	return int(r), e
}

func sysWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	if raceBuild {
		n, err := syscall.Write(int(fd), p)
		return max(n, 0), errno(err)
	}
	r, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(unsafe.SliceData(p))), uintptr(len(p)))
	return int(r), e
}

func errno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	return err.(syscall.Errno)
}

func (c *Conn) readFD(fd uintptr) bool {
	for {
		r, e := sysRead(fd, c.rd.p)
		switch e {
		case 0:
			c.rd.n, c.rd.err = r, nil
			return true
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait in the poller
		default:
			c.rd.n, c.rd.err = 0, os.NewSyscallError("read", e)
			return true
		}
	}
}

func (c *Conn) read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rd = op{p: p}
	err := c.raw.rc.Read(c.readF)
	n, rerr := c.rd.n, c.rd.err
	c.rd = op{}
	switch {
	case err != nil:
		return 0, c.wrap("read", err)
	case rerr != nil:
		return 0, c.wrap("read", rerr)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (c *Conn) writeFD(fd uintptr) bool {
	for len(c.wr.p) > 0 {
		r, e := sysWrite(fd, c.wr.p)
		switch e {
		case 0:
			c.wr.n += r
			c.wr.p = c.wr.p[r:]
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false // wait until writable
		default:
			c.wr.err = os.NewSyscallError("write", e)
			return true
		}
	}
	return true
}

func (c *Conn) write(p []byte) (int, error) {
	c.wr = op{p: p}
	err := c.raw.rc.Write(c.writeF)
	n, werr := c.wr.n, c.wr.err
	c.wr = op{}
	if err == nil {
		err = werr
	}
	if err != nil {
		return n, c.wrap("write", err)
	}
	return n, nil
}

const onLinux = true
