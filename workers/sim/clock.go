package sim

import (
	"runtime"
	"time"
)

// Modelled waits (a step, a fetch from the shared tier, a KV push's link
// time) must end on time even when they last microseconds, as steps do at
// high time scales. A Go timer does not on Linux: when the process has
// nothing else to run, the runtime waits for it in epoll_wait, whose
// timeout is in whole milliseconds, so a 60 µs timer fires after about
// 1.1 ms. sleepUntil therefore leaves the timer coarseLead before the
// deadline, sleeps in the kernel (preciseSleep) until yieldLead before it,
// and yields the processor through the rest, absorbing the kernel sleep's
// own lateness.
const (
	// coarseLead is how long before its deadline a wait leaves the timer:
	// more than the timer's lateness (up to about 1.1 ms when idle).
	coarseLead = 2 * time.Millisecond
	// yieldLead is how long before its deadline a wait leaves the kernel
	// sleep, whose wake-up comes some 50–110 µs late (50 µs of it the
	// kernel's default timer slack), more on a loaded machine.
	yieldLead = 200 * time.Microsecond
)

// sleepUntil returns true at deadline, never before, and within
// microseconds after unless the machine is short of CPU; or false as soon
// as stop or ctxDone (either may be nil) is closed while it waits on its
// timer: t, a stopped one of the caller's that it leaves stopped, or a new
// one if t is nil. The last coarseLead of a wait is not interrupted, and
// only its last yieldLead keeps the goroutine runnable.
func sleepUntil(deadline time.Time, t *time.Timer, stop, ctxDone <-chan struct{}) bool {
	if d := time.Until(deadline) - coarseLead; d > 0 {
		if t == nil {
			t = time.NewTimer(d)
		} else {
			t.Reset(d)
		}
		select {
		case <-t.C:
		case <-stop:
			t.Stop()
			return false
		case <-ctxDone:
			t.Stop()
			return false
		}
	}
	for {
		d := time.Until(deadline)
		switch {
		case d <= 0:
			return true
		case d > yieldLead:
			preciseSleep(d - yieldLead)
		default:
			runtime.Gosched()
		}
	}
}
