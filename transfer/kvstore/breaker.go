package kvstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/transfer"
)

// Breaker guards a Store with a circuit breaker (sony/gobreaker): after
// Failures consecutive failed calls it opens, and every call fails at once
// with an error wrapping transfer.ErrBypassed, without touching the store;
// after OpenTimeout it lets HalfOpenRequests probes through, which close it
// if they succeed or open it again if one fails. Callers that see any error
// recompute instead, so a slow or dead Redis never fails a request, and the
// tier comes back when Redis does.
//
// Calls cancelled by their caller (context.Canceled) count neither way.
type Breaker struct {
	s       transfer.Store
	cb      *gobreaker.CircuitBreaker[struct{}]
	onError func(op Op, err error)
}

// Op names a Breaker's operations, for OnError.
type Op string

// Operations of a Breaker.
const (
	OpPut     Op = "put"
	OpGet     Op = "get"
	OpExists  Op = "exists"
	OpTouch   Op = "touch"
	OpHottest Op = "hottest"
)

// BreakerOption customises a Breaker.
type BreakerOption func(*breakerOptions)

type breakerOptions struct {
	settings gobreaker.Settings
	onError  func(Op, error)
}

// OnStateChange calls fn on each transition (for metrics and logs). fn is
// called synchronously, with the breaker's lock held, from the goroutine of
// the call that caused the transition: it must be quick and must not call
// the Breaker.
func OnStateChange(fn func(name string, from, to gobreaker.State)) BreakerOption {
	return func(o *breakerOptions) { o.settings.OnStateChange = fn }
}

// OnError calls fn with every error a call returns but those of calls
// their caller cancelled (context.Canceled): the store's own, and the
// breaker's refusals (transfer.ErrBypassed). fn is called synchronously
// from the goroutine of the call, after it: it must be quick.
func OnError(fn func(op Op, err error)) BreakerOption {
	return func(o *breakerOptions) { o.onError = fn }
}

// NewBreaker returns s behind a breaker configured by cfg (see
// BreakerConfig.Validate; out-of-range values mean the defaults). Closing
// the Breaker closes s.
func NewBreaker(s transfer.Store, cfg BreakerConfig, opts ...BreakerOption) *Breaker {
	cfg = cfg.withDefaults()
	failures := cfg.Failures
	o := breakerOptions{settings: gobreaker.Settings{
		Name:        cfg.Name,
		MaxRequests: cfg.HalfOpenRequests,
		Timeout:     cfg.OpenTimeout,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= failures },
		IsExcluded:  func(err error) bool { return errors.Is(err, context.Canceled) },
	}}
	for _, opt := range opts {
		opt(&o)
	}
	return &Breaker{s: s, cb: gobreaker.NewCircuitBreaker[struct{}](o.settings), onError: o.onError}
}

// Put calls the store's Put unless the breaker is open.
func (b *Breaker) Put(ctx context.Context, ns transfer.Namespace, blocks []transfer.Block) error {
	_, err := b.cb.Execute(func() (struct{}, error) {
		return struct{}{}, b.s.Put(ctx, ns, blocks)
	})
	return b.wrap(OpPut, err)
}

// Get calls the store's Get unless the breaker is open.
func (b *Breaker) Get(ctx context.Context, ns transfer.Namespace, keys []uint64, size int) ([][]byte, error) {
	var data [][]byte
	_, err := b.cb.Execute(func() (struct{}, error) {
		var err error
		data, err = b.s.Get(ctx, ns, keys, size)
		return struct{}{}, err
	})
	return data, b.wrap(OpGet, err)
}

// Exists calls the store's Exists unless the breaker is open.
func (b *Breaker) Exists(ctx context.Context, ns transfer.Namespace, keys []uint64) ([]bool, error) {
	var ok []bool
	_, err := b.cb.Execute(func() (struct{}, error) {
		var err error
		ok, err = b.s.Exists(ctx, ns, keys)
		return struct{}{}, err
	})
	return ok, b.wrap(OpExists, err)
}

// Close closes the store, whatever the breaker's state.
func (b *Breaker) Close() error { return b.s.Close() }

// State returns the breaker's state.
func (b *Breaker) State() gobreaker.State { return b.cb.State() }

// Name returns the breaker's name (BreakerConfig.Name).
func (b *Breaker) Name() string { return b.cb.Name() }

// wrap turns the breaker's refusals (open, or half-open with its probes
// taken) into transfer.ErrBypassed, and reports errors to OnError's fn.
func (b *Breaker) wrap(op Op, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests) {
		err = fmt.Errorf("%s: %w: %w", b.cb.Name(), transfer.ErrBypassed, err)
	}
	if b.onError != nil && !errors.Is(err, context.Canceled) {
		b.onError(op, err)
	}
	return err
}

var _ transfer.Store = (*Breaker)(nil)
