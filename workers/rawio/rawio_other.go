//go:build !linux

package rawio

type rawConn struct{}

func (rawConn) ok() bool { return false }

func (c *Conn) init() {}

func (c *Conn) read(p []byte) (int, error)  { return c.nc.Read(p) }
func (c *Conn) write(p []byte) (int, error) { return c.nc.Write(p) }

const onLinux = false
