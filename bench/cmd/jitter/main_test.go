//go:build linux

package main

import (
	"strings"
	"testing"
	"time"
)

// A short run reports both clocks, and a sample's wall time is at least
// the work it was calibrated to, give or take the calibration.
func TestRunReports(t *testing.T) {
	var b strings.Builder
	if err := run(&b, 200*time.Microsecond, 20, 0); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"work 200µs, 20 samples", "wall", "thread CPU", "p99/p50"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	for _, c := range []struct {
		work time.Duration
		n    int
		gap  time.Duration
		want string
	}{{0, 1, 0, "-work"}, {time.Microsecond, 0, 0, "-n"}, {time.Microsecond, 1, -time.Second, "-gap"}} {
		err := run(&strings.Builder{}, c.work, c.n, c.gap)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("run(%v, %d, %v) = %v, want an error naming %s", c.work, c.n, c.gap, err, c.want)
		}
	}
}
