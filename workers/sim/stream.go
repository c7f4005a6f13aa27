package sim

import (
	"errors"
	"io"
	"strings"
	"sync"

	"github.com/batonllm/baton/workers/engine"
)

// errStreamClosed is returned by Recv after Close.
var errStreamClosed = errors.New("stream closed")

// stream is the engine.Stream of one sequence. The step loop pushes text
// and the end without ever blocking; Recv coalesces whatever text arrived
// since the last call into one event, so a slow reader costs memory
// bounded by its completion, never step-loop time.
type stream struct {
	seq  *seq
	stop func() bool // stops the context watch

	mu        sync.Mutex
	text      strings.Builder
	tokens    int
	final     *engine.Final
	finalSent bool
	err       error
	notify    chan struct{} // capacity 1: a pending wake-up
}

func newStream(s *seq) *stream {
	return &stream{seq: s, notify: make(chan struct{}, 1)}
}

// push appends generated text standing for tokens tokens. Step loop only.
func (st *stream) push(text string, tokens int) {
	st.mu.Lock()
	st.text.WriteString(text)
	st.tokens += tokens
	st.mu.Unlock()
	st.wake()
}

// finish records the final usage. Step loop only.
func (st *stream) finish(f engine.Final) {
	st.mu.Lock()
	st.final = &f
	st.mu.Unlock()
	st.wake()
}

// fail ends the stream with err unless it already ended.
func (st *stream) fail(err error) {
	st.mu.Lock()
	if st.err == nil && !st.finalSent {
		st.err = err
	}
	st.mu.Unlock()
	st.wake()
}

func (st *stream) wake() {
	select {
	case st.notify <- struct{}{}:
	default:
	}
}

// Recv returns the text generated since the previous call (the first
// event is the first token), then an event carrying Final, then io.EOF.
// It returns the context's error if the request's context ended first,
// and ErrClosed if the engine closed.
func (st *stream) Recv() (engine.Event, error) {
	for {
		st.mu.Lock()
		switch {
		case st.finalSent:
			st.mu.Unlock()
			if st.stop != nil {
				st.stop() // the generation ended: stop watching its context
			}
			return engine.Event{}, io.EOF
		case st.err != nil:
			err := st.err
			st.mu.Unlock()
			return engine.Event{}, err
		case st.text.Len() > 0 || st.tokens > 0:
			ev := engine.Event{Text: st.text.String(), Tokens: st.tokens}
			st.text.Reset()
			st.tokens = 0
			st.mu.Unlock()
			return ev, nil
		case st.final != nil:
			st.finalSent = true
			f := *st.final
			st.mu.Unlock()
			return engine.Event{Final: &f}, nil
		}
		st.mu.Unlock()
		<-st.notify
	}
}

// Close cancels the generation if it has not ended and releases its
// blocks. It is idempotent.
func (st *stream) Close() error {
	if st.stop != nil {
		st.stop()
	}
	st.fail(errStreamClosed)
	st.seq.cancel()
	return nil
}

var _ engine.Stream = (*stream)(nil)
