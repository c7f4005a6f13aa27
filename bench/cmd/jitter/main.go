//go:build linux

// Command jitter measures how long a fixed amount of pure computation
// takes on this machine, in wall time and in the thread's CPU time: a loop
// of register arithmetic (no memory traffic) calibrated to -work, run -n
// times on a locked OS thread, -gap apart. Its spread is the floor under
// any latency percentile measured here: a routing decision that takes
// 40 µs of work cannot have a p99 below this tool's p99 for -work 40µs.
//
//	go run ./bench/cmd/jitter -work 40us -n 5000 -gap 10ms
//
// On a virtual machine, interrupts and the host's scheduling are charged
// to the running thread, so the CPU-time percentiles spread too.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"syscall"
	"time"
	"unsafe"
)

// clockThreadCPUTime is Linux's CLOCK_THREAD_CPUTIME_ID.
const clockThreadCPUTime = 3

func main() {
	fs := flag.NewFlagSet("jitter", flag.ExitOnError)
	work := fs.Duration("work", 40*time.Microsecond, "computation per sample")
	n := fs.Int("n", 5000, "samples")
	gap := fs.Duration("gap", 10*time.Millisecond, "sleep between samples (0: back to back)")
	fs.Parse(os.Args[1:])
	if err := run(os.Stdout, *work, *n, *gap); err != nil {
		fmt.Fprintln(os.Stderr, "jitter:", err)
		os.Exit(2)
	}
}

func run(out io.Writer, work time.Duration, n int, gap time.Duration) error {
	switch {
	case work <= 0:
		return fmt.Errorf("-work: %v is not positive", work)
	case n < 1:
		return fmt.Errorf("-n: %d is below 1", n)
	case gap < 0:
		return fmt.Errorf("-gap: %v is negative", gap)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	iters := calibrate(work)
	wall := make([]time.Duration, n)
	cpu := make([]time.Duration, n)
	for i := range n {
		if gap > 0 {
			time.Sleep(gap)
		}
		c0, w0 := threadCPU(), time.Now()
		spin(iters)
		wall[i], cpu[i] = time.Since(w0), threadCPU()-c0
	}
	fmt.Fprintf(out, "work %v, %d samples, gap %v\n", work, n, gap)
	for _, s := range []struct {
		name string
		v    []time.Duration
	}{{"wall", wall}, {"thread CPU", cpu}} {
		slices.Sort(s.v)
		at := func(q float64) time.Duration { return s.v[int(float64(len(s.v)-1)*q)].Round(100 * time.Nanosecond) }
		fmt.Fprintf(out, "%-10s  p50 %v  p90 %v  p99 %v  p99.9 %v  max %v  (p99/p50 %.2f)\n",
			s.name, at(.5), at(.9), at(.99), at(.999), s.v[len(s.v)-1].Round(100*time.Nanosecond),
			float64(at(.99))/float64(at(.5)))
	}
	return nil
}

// calibrate returns how many spin iterations take about d, from the
// fastest of a few timed runs.
func calibrate(d time.Duration) int {
	iters := 1024
	for {
		t := time.Now()
		spin(iters)
		if time.Since(t) > 5*time.Millisecond {
			break
		}
		iters *= 2
	}
	best := time.Duration(1<<63 - 1)
	for range 5 {
		t := time.Now()
		spin(iters)
		best = min(best, time.Since(t))
	}
	return max(1, int(float64(iters)*float64(d)/float64(best)))
}

var sink uint64

// spin runs n rounds of xorshift: register arithmetic only.
func spin(n int) {
	x := uint64(88172645463325252)
	for range n {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
	}
	sink += x
}

// threadCPU returns the calling thread's CPU time.
func threadCPU() time.Duration {
	var ts syscall.Timespec
	syscall.RawSyscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0)
	return time.Duration(ts.Nano())
}
