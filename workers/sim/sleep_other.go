//go:build !linux

package sim

import "time"

// preciseSleep sleeps about d. The runtime's timer rounds up to a
// millisecond on Linux, whose poller takes its timeout in milliseconds;
// kqueue's, for one, is in nanoseconds, so elsewhere the timer serves.
func preciseSleep(d time.Duration) { time.Sleep(d) }
