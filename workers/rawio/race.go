//go:build race

package rawio

// The race detector learns that a socket's write happens before the
// read of its bytes from syscall.Read and syscall.Write, which annotate
// the two; a raw system call would hide that order and report races that
// are none. Race builds make the same reads and writes through syscall's.
const raceBuild = true
