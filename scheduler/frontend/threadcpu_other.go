//go:build !linux

package frontend

import "time"

// threadCPU reports no thread CPU time outside Linux.
func threadCPU() (cpu time.Duration, tid int, ok bool) { return 0, 0, false }
