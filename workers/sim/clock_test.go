package sim

import (
	"testing"
	"time"
)

// sleepUntil ends at its deadline, never before. How little after (much
// less than a runtime timer's millisecond) is logged, and measured by
// BenchmarkOneTokenPaths: a loaded machine may delay any wake-up.
func TestSleepUntilOnTime(t *testing.T) {
	for _, d := range []time.Duration{time.Microsecond, 60 * time.Microsecond, 600 * time.Microsecond, 3 * time.Millisecond} {
		least := time.Hour
		for range 10 {
			start := time.Now()
			deadline := start.Add(d)
			if !sleepUntil(deadline, nil, nil, nil) {
				t.Fatalf("%v: sleepUntil returned false without a stop", d)
			}
			end := time.Now()
			if end.Before(deadline) {
				t.Errorf("%v: returned %v before the deadline", d, deadline.Sub(end))
			}
			least = min(least, end.Sub(deadline))
		}
		t.Logf("%v: at best %v late", d, least)
	}
}

func TestSleepUntilStops(t *testing.T) {
	for _, which := range []string{"stop", "ctxDone"} {
		stop, ctxDone := make(chan struct{}), make(chan struct{})
		ch := map[string]chan struct{}{"stop": stop, "ctxDone": ctxDone}[which]
		timer := time.NewTimer(time.Hour)
		timer.Stop()
		start := time.Now() // before the close is armed: it comes 10 ms after start at least
		time.AfterFunc(10*time.Millisecond, func() { close(ch) })
		if sleepUntil(start.Add(time.Minute), timer, stop, ctxDone) {
			t.Fatalf("%s: sleepUntil returned true before a minute passed", which)
		}
		if d := time.Since(start); d < 10*time.Millisecond || d > 5*time.Second {
			t.Errorf("%s closed after 10ms: sleepUntil returned after %v", which, d)
		}
	}
}
