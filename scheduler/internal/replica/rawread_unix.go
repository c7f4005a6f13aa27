//go:build unix

package replica

import "syscall"

// ownConnections: the Sharer reads and writes the stream over
// connections of its own (follower) where the client allows.
const ownConnections = true

// readFD reads from the descriptor of a non-blocking socket.
func readFD(fd uintptr, b []byte) (int, error) { return syscall.Read(int(fd), b) }
