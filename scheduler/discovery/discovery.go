// Package discovery finds the workers a scheduler routes to: a static
// list, the records of a DNS name (a headless Service), or Kubernetes
// EndpointSlices. Every Source reports the whole member set each time it
// changes; the scheduler adds and removes workers to match it.
package discovery

import (
	"cmp"
	"slices"
	"sync"
)

// Member is one worker as discovery found it.
type Member struct {
	// Name identifies the worker among the members, for as long as it
	// lives: a pod's name, or the worker's address.
	Name string
	// Address is the worker's host:port.
	Address string
	// Kind and Role are the worker's as its labels say; "" leaves them to
	// the configuration.
	Kind, Role string
}

// Source reports the set of workers.
type Source interface {
	// Updates returns the channel on which the source sends the whole
	// member set, sorted by name, each time it changes; an empty set means
	// there are no workers. The first set comes once the source has looked
	// (a static source's at once). The channel holds one set: a reader that
	// falls behind receives the latest, never a stale one. Close closes it.
	Updates() <-chan []Member
	// Close stops the source and waits for its goroutines. It is
	// idempotent.
	Close() error
}

// latest is an Updates channel that keeps only the newest set, for a
// source with one sending goroutine.
type latest struct {
	ch       chan []Member
	last     []Member
	sent     bool
	closeOne sync.Once
}

func newLatest() *latest { return &latest{ch: make(chan []Member, 1)} }

// send sends ms, sorted by name, unless it equals the last set sent. Only
// one goroutine sends.
func (l *latest) send(ms []Member) {
	ms = slices.Clone(ms)
	slices.SortFunc(ms, func(a, b Member) int { return cmp.Compare(a.Name, b.Name) })
	if l.sent && slices.Equal(ms, l.last) {
		return
	}
	l.last, l.sent = ms, true
	select {
	case <-l.ch: // drop the set the reader has not taken yet
	default:
	}
	l.ch <- ms
}

// close closes the channel once the sender is done.
func (l *latest) close() { l.closeOne.Do(func() { close(l.ch) }) }

// Static is a Source of a fixed list.
type Static struct{ l *latest }

// NewStatic returns a source that reports members once.
func NewStatic(members []Member) *Static {
	s := &Static{l: newLatest()}
	s.l.send(members)
	return s
}

// Updates implements Source.
func (s *Static) Updates() <-chan []Member { return s.l.ch }

// Close implements Source.
func (s *Static) Close() error {
	s.l.close()
	return nil
}

var _ Source = (*Static)(nil)
