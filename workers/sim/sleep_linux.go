package sim

import (
	"syscall"
	"time"
)

// preciseSleep sleeps about d in the kernel (nanosleep), blocking its
// thread, which the kernel wakes within its timer slack; the Go runtime
// runs the caller's goroutines on other threads meanwhile. It may return
// early, on a signal.
func preciseSleep(d time.Duration) {
	ts := syscall.NsecToTimespec(int64(d))
	syscall.Nanosleep(&ts, nil)
}
