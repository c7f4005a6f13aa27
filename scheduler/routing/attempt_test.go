package routing

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/scheduler/pool"
)

// recorder is a strategy that records what its decisions hear, in order.
type recorder struct {
	calls []string
}

func (r *recorder) Name() string { return "recorder" }

func (r *recorder) Pick(*Request, *pool.Snapshot) (Decision, error) { return Decision{}, ErrNoWorker }

func (r *recorder) Commit(_ *Request, d Decision) { r.calls = append(r.calls, "commit "+d.Worker.Name) }

func (r *recorder) Done(_ *Request, d Decision, info DoneInfo) {
	s := "done first=" + info.FirstToken.String()
	if info.Err != nil {
		s += " err=" + info.Err.Error()
	}
	if d.Estimate == 0 {
		s += " unestimated"
	}
	r.calls = append(r.calls, s)
}

func (r *recorder) Finish(_ *Request, _ Decision, info FinishInfo) {
	s := "finish"
	if info.Usage {
		s += " usage"
	}
	r.calls = append(r.calls, s)
}

func TestAttemptLifecycle(t *testing.T) {
	boom := errors.New("boom")
	for _, c := range []struct {
		name string
		run  func(a *Attempt)
		want []string
		// breakerOpen: the breaker heard a failure.
		breakerOpen bool
	}{
		{"first token, usage, end", func(a *Attempt) {
			a.FirstToken(time.Second)
			a.FirstToken(2 * time.Second) // not heard
			a.Usage(100, 64)
			a.End(nil, nil)
		}, []string{"commit w00", "done first=1s", "finish usage", "unpin", "released"}, false},
		{"error before the first token", func(a *Attempt) {
			a.End(boom, boom)
		}, []string{"commit w00", "done first=0s err=boom", "finish", "unpin", "released"}, true},
		{"error after the first token, the client's fault", func(a *Attempt) {
			a.FirstToken(time.Millisecond)
			a.End(boom, pool.ClientError(boom))
		}, []string{"commit w00", "done first=1ms", "finish", "unpin", "released"}, false},
		{"prompt by transfer", func(a *Attempt) {
			a.Unestimated()
			a.FirstToken(time.Second)
			a.End(nil, nil)
		}, []string{"commit w00", "done first=1s unestimated", "finish", "unpin", "released"}, false},
		{"ended twice", func(a *Attempt) {
			a.End(nil, nil)
			a.End(boom, boom)
			a.FirstToken(time.Second)
		}, []string{"commit w00", "done first=0s", "finish", "unpin", "released"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFleet(t, 1)
			w := f.worker("w00")
			r := &recorder{}
			hooks := Hooks{
				Unpin:    func() { r.calls = append(r.calls, "unpin") },
				Released: func() { r.calls = append(r.calls, "released") },
			}
			a, err := Start(r, &Request{}, Decision{Worker: w, Estimate: time.Second}, hooks)
			if err != nil {
				t.Fatal(err)
			}
			if got := w.InFlight(); got != 1 {
				t.Fatalf("in flight after Start: %d, want 1", got)
			}
			c.run(a)
			if diff := cmp.Diff(c.want, r.calls); diff != "" {
				t.Errorf("calls (-want +got):\n%s", diff)
			}
			if got := w.InFlight(); got != 0 {
				t.Errorf("in flight after End: %d, want 0", got)
			}
			if got := !w.Available(); got != c.breakerOpen {
				t.Errorf("breaker open = %t, want %t", got, c.breakerOpen)
			}
		})
	}
}

// A worker whose breaker refuses commits nothing, holds no slot and
// gives its adapter pin back.
func TestAttemptRefused(t *testing.T) {
	f := newFleet(t, 1)
	f.openBreaker("w00")
	r := &recorder{}
	unpinned := false
	a, err := Start(r, &Request{}, Decision{Worker: f.worker("w00")}, Hooks{Unpin: func() { unpinned = true }})
	if err == nil || !errors.Is(err, pool.ErrBreakerOpen) || a != nil {
		t.Fatalf("Start on an open breaker: %v, %v; want ErrBreakerOpen", a, err)
	}
	if len(r.calls) != 0 || !unpinned || f.worker("w00").InFlight() != 0 {
		t.Errorf("after a refusal: calls %s, unpinned %t, in flight %d", strings.Join(r.calls, ", "), unpinned, f.worker("w00").InFlight())
	}
}
