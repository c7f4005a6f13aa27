package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/workers/engine"
)

// ErrBreakerOpen is returned (wrapped) by Worker.Acquire when the worker's
// breaker refuses the call: it is open, or half-open with its probe calls
// all taken. The caller should pick another worker.
var ErrBreakerOpen = errors.New("breaker open")

// ErrRemoved is returned (wrapped) by Worker.Acquire once the worker has
// left its pool: a decision picked from an older Snapshot is picked again.
var ErrRemoved = errors.New("worker removed from its pool")

// Worker is one engine the scheduler routes to. Set the exported fields,
// then hand the Worker to Pool.Add or Pool.Set, which give it its breaker;
// do not change the fields afterwards. A Worker belongs to one Pool. Its
// in-flight count, health and breaker are shared by every Snapshot that
// holds it, and its methods are safe for concurrent use.
type Worker struct {
	// Name identifies the worker: unique in its pool, the ring member, the
	// metrics label and the X-Baton-Worker header.
	Name string
	// Addr is the engine's address, for logs.
	Addr string
	// Models lists the models the engine serves at first; empty means any
	// model. SetModels replaces the list later.
	Models []string
	// Discover has the pool ask the engine what it serves (its client's
	// engine.Describer) after every passing health check; the pool's
	// OnDescribe hook hears each new answer.
	Discover bool
	// Client drives the engine. The pool calls Check on it; it does not
	// Close it: whoever created the client closes it once the worker is
	// removed and its calls have ended.
	Client engine.Client
	// MaxLoRAs is how many LoRA adapters the engine holds at once (vLLM's
	// --max-loras): the scheduler loads adapters onto it up to that many,
	// then evicts the least recently used. 0: it loads none onto it.
	MaxLoRAs int

	pool    *Pool // set once by Pool.Add or Pool.Set
	breaker *gobreaker.TwoStepCircuitBreaker[struct{}]
	// st is the worker's status in its pool's slab once it joined one
	// (see status), own until then.
	st  atomic.Pointer[status]
	own status
	// failedChecks counts consecutive failed health checks, and described
	// is the engine's latest description; only the pool's health round,
	// which is serialized, touches them.
	failedChecks int
	described    *engine.Description
	// checked is when the worker's previous health check began; answered
	// is when it last answered a call (Answered), in Unix nanoseconds.
	checked  time.Time
	answered atomic.Int64

	// removed is set when the worker leaves its pool, after which Acquire
	// refuses; drained is closed once it is set and no call is in flight.
	removed     atomic.Bool
	drained     chan struct{}
	drainedOnce sync.Once

	lora adapters // the LoRA adapters it holds (adapters.go)
}

// status is what a decision reads of a worker: its health, breaker
// state, calls in flight and models. A pool keeps its workers' statuses
// side by side in a slab (statusSlab), which its snapshots point into,
// so that a decision over many workers reads a few pages of them rather
// than a Worker each, scattered over the heap.
type status struct {
	inFlight atomic.Int64
	// openUntil is when an open breaker turns half-open, in Unix
	// nanoseconds (the breaker only changes state when next asked).
	openUntil atomic.Int64
	models    atomic.Pointer[[]string]
	// state mirrors the breaker's state, so Available reads atomics only.
	state    atomic.Int32
	healthy  atomic.Bool
	anyModel atomic.Bool // models is set and empty
}

// status returns the worker's status.
func (w *Worker) status() *status {
	if s := w.st.Load(); s != nil {
		return s
	}
	return &w.own
}

// available is Worker.Available.
func (s *status) available() bool {
	if !s.healthy.Load() {
		return false
	}
	if gobreaker.State(s.state.Load()) != gobreaker.StateOpen {
		return true
	}
	return time.Now().UnixNano() >= s.openUntil.Load()
}

// serves is Worker.Serves, for a worker whose models are set (one in a
// pool). A worker that serves any model is answered without loading its
// list, which sits elsewhere.
func (s *status) serves(model string) bool {
	if s.anyModel.Load() {
		return true
	}
	m := *s.models.Load()
	return len(m) == 0 || slices.Contains(m, model)
}

// setModels sets the models the worker serves. The list is stored before
// anyModel, which serves loads before it: a serves concurrent with a
// change answers as of the list before it or after it.
func (s *status) setModels(models []string) {
	s.models.Store(&models)
	s.anyModel.Store(len(models) == 0)
}

// statusSlab hands out statuses from chunks of a page, side by side.
// A chunk lives for as long as a worker holds one of its statuses.
type statusSlab struct {
	chunk []status
}

// statusChunk is the statuses of one chunk: a page of 4 KiB.
const statusChunk = 4096 / int(unsafe.Sizeof(status{}))

func (sl *statusSlab) next() *status {
	if len(sl.chunk) == 0 {
		sl.chunk = make([]status, statusChunk)
	}
	s := &sl.chunk[0]
	sl.chunk = sl.chunk[1:]
	return s
}

// Successor returns a new Worker over w's engine, for another pool: the
// same name, address, client and models, and what w knows of the LoRA
// adapters the engine holds (which, loaded when, its slots, their load
// time); its breaker, health and in-flight count start afresh.
func (w *Worker) Successor() *Worker {
	n := &Worker{Name: w.Name, Addr: w.Addr, Models: w.ServedModels(), Discover: w.Discover, Client: w.Client, MaxLoRAs: w.MaxLoRAs}
	w.lora.copyTo(&n.lora)
	return n
}

// ServedModels returns the models the worker serves; empty means any. The
// slice must not be modified.
func (w *Worker) ServedModels() []string {
	if m := w.status().models.Load(); m != nil {
		return *m
	}
	return w.Models
}

// SetModels replaces the models the worker serves (empty: any), as its
// engine reports them. It is safe for concurrent use.
func (w *Worker) SetModels(models []string) {
	w.status().setModels(slices.Clone(models))
}

// InFlight returns the number of calls acquired and not yet done.
func (w *Worker) InFlight() int { return int(w.status().inFlight.Load()) }

// Answered records that the worker answered a call just now: a token or
// a whole response reached the scheduler. A health check that times out
// while the worker answers calls is not counted against it (Pool.CheckNow).
func (w *Worker) Answered() { w.answered.Store(time.Now().UnixNano()) }

// Healthy reports whether the worker passed its latest health checks. A
// worker starts healthy, so a new pool routes at once.
func (w *Worker) Healthy() bool { return w.status().healthy.Load() }

// BreakerState returns the state of the worker's breaker. It moves an open
// breaker whose timeout has passed to half-open, so it must not be called
// from the pool's OnBreakerChange hook.
func (w *Worker) BreakerState() gobreaker.State {
	if w.breaker == nil {
		return gobreaker.StateClosed
	}
	return w.breaker.State()
}

// Serves reports whether the worker serves model.
func (w *Worker) Serves(model string) bool {
	m := w.ServedModels()
	return len(m) == 0 || slices.Contains(m, model)
}

// Available reports whether the worker may be routed to: healthy and its
// breaker closed or half-open (an open breaker past its timeout counts as
// half-open). It reads atomics only and does not allocate. Whether the
// worker is too busy is a strategy's concern.
func (w *Worker) Available() bool { return w.status().available() }

// Acquire asks the worker's breaker for a call and counts it in flight. On
// success the caller must call done exactly once when the call ends (for a
// stream, when the stream ends); done releases the in-flight slot and
// reports the outcome to the breaker: IsWorkerFault(err) counts as a
// failure, anything else (nil, context.Canceled, a request fault, an error
// wrapped with ClientError) as a success. Extra calls of done are ignored.
//
// When the breaker refuses the call, Acquire returns an error wrapping
// ErrBreakerOpen and the gobreaker error (gobreaker.ErrOpenState or
// gobreaker.ErrTooManyRequests), and counts nothing.
//
// Once the worker has left its pool, Acquire returns an error wrapping
// ErrRemoved and counts nothing.
func (w *Worker) Acquire() (done func(err error), err error) {
	if w.removed.Load() {
		return nil, fmt.Errorf("worker %s: %w", w.Name, ErrRemoved)
	}
	report := func(error) {}
	if w.breaker != nil {
		report, err = w.breaker.Allow()
		if err != nil {
			return nil, fmt.Errorf("worker %s: %w: %w", w.Name, ErrBreakerOpen, err)
		}
	}
	// Counted before removed is read again, and retire sets removed before
	// it reads the count: a call either sees removed or is seen by Drained.
	w.status().inFlight.Add(1)
	if w.removed.Load() {
		w.release()
		report(nil)
		return nil, fmt.Errorf("worker %s: %w", w.Name, ErrRemoved)
	}
	var once atomic.Bool
	return func(err error) {
		if !once.CompareAndSwap(false, true) {
			return
		}
		if err == nil {
			w.Answered()
		}
		w.release()
		report(err)
	}, nil
}

// release ends a call in flight.
func (w *Worker) release() {
	if w.status().inFlight.Add(-1) == 0 && w.removed.Load() {
		w.drainedOnce.Do(func() { close(w.drained) })
	}
}

// retire marks the worker as removed from its pool. p.mu is held.
func (w *Worker) retire() {
	w.removed.Store(true)
	if w.status().inFlight.Load() == 0 {
		w.drainedOnce.Do(func() { close(w.drained) })
	}
}

// Removed reports whether the worker has left its pool.
func (w *Worker) Removed() bool { return w.removed.Load() }

// Drained returns a channel closed once the worker has left its pool and
// its calls in flight have ended; nil before the worker joined a pool.
// Whoever removed the worker closes its client then.
func (w *Worker) Drained() <-chan struct{} { return w.drained }

// onBreakerChange is the breaker's OnStateChange hook. The breaker calls
// it with its lock held.
func (w *Worker) onBreakerChange(from, to gobreaker.State, timeout time.Duration) {
	if to == gobreaker.StateOpen {
		w.status().openUntil.Store(time.Now().Add(timeout).UnixNano())
	}
	w.status().state.Store(int32(to))
	if h := w.pool.onBreakerChange; h != nil {
		h(w.Name, from, to)
	}
}

// clientError marks an error as the client's doing.
type clientError struct{ err error }

func (e clientError) Error() string { return e.err.Error() }
func (e clientError) Unwrap() error { return e.err }

// ClientError marks err as caused by the client's request (a request the
// engine rejected as invalid, say), so that it does not count against the
// worker's breaker. It returns nil if err is nil.
func ClientError(err error) error {
	if err == nil {
		return nil
	}
	return clientError{err}
}

// IsWorkerFault reports whether err, as passed to Acquire's done, counts as
// the worker's failure. It classifies by where the error came from:
// nil, context.Canceled and engine.ErrClientGone (the client went away),
// the request faults engine.ErrInvalid, engine.ErrUnknownModel and
// engine.ErrTooLarge, engine.ErrTransfer (the other side of a KV
// transfer failed), and errors marked with ClientError do not count;
// everything else does, including context.DeadlineExceeded (the worker was
// too slow).
func IsWorkerFault(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, engine.ErrClientGone) ||
		errors.Is(err, engine.ErrInvalid) || errors.Is(err, engine.ErrUnknownModel) ||
		errors.Is(err, engine.ErrTooLarge) || errors.Is(err, engine.ErrTransfer) {
		return false
	}
	var ce clientError
	return !errors.As(err, &ce)
}
