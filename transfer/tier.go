package transfer

import (
	"context"
	"errors"
	"fmt"
)

// Namespace is where a block lives in a shared tier: its model and its
// tenant salt (blockkey.Seed(model, tenant)). Keys are namespaced
// baton:kv:<model>:<salt as 16 hex digits>:<block key as 16 hex digits>.
type Namespace struct {
	Model string
	Salt  uint64
}

// StoreKey returns the shared-tier key of block key in ns.
func StoreKey(ns Namespace, key uint64) string {
	return fmt.Sprintf("baton:kv:%s:%016x:%016x", ns.Model, ns.Salt, key)
}

// Store is a shared KV block tier that every worker of a fleet reads and
// writes: Redis, or an in-process store for a fleet in one process. Its
// methods are safe for concurrent use and honour ctx. Any error means the
// tier is unavailable for now: callers bypass it and recompute, never fail
// a request.
type Store interface {
	// Put writes blocks, each value carrying its checksum, with the store's
	// TTL. The caller keeps ownership of the blocks' Data.
	Put(ctx context.Context, ns Namespace, blocks []Block) error
	// Get fetches blocks of size bytes by key. data[i] is nil when keys[i]
	// is missing, or its value failed verification (it is then deleted):
	// a bad value is never returned.
	Get(ctx context.Context, ns Namespace, keys []uint64, size int) (data [][]byte, err error)
	// Exists reports which keys are present, without fetching them.
	Exists(ctx context.Context, ns Namespace, keys []uint64) ([]bool, error)
	// Close releases the store's connections; it is idempotent.
	Close() error
}

// ErrBypassed is returned (wrapped) by a store behind an open breaker: the
// tier is skipped until it recovers.
var ErrBypassed = errors.New("tier bypassed")

// MaxHotChain bounds the blocks of one prefix a HotTracker records: longer
// chains are recorded by their first MaxHotChain blocks (1,024 blocks of
// 16 tokens: 16,384 tokens, 8 KiB of keys).
const MaxHotChain = 1024

// HotPrefix is one prefix a HotTracker ranks: its namespace, its chain of
// block keys (leading first) and its score, the uses recorded.
type HotPrefix struct {
	NS    Namespace
	Keys  []uint64
	Score float64
}

// HotTracker is what a shared tier may also implement (an optional
// interface: Store does not require it): fleet-wide prefix popularity,
// kept in the tier itself so that any worker that joins the fleet can read
// it and warm its cache with the hottest prefixes, without asking the
// scheduler. Its methods are safe for concurrent use, honour ctx, and fail
// like a Store's: an error means the tracker is unavailable for now.
//
// Use Tracker to find a store's tracker: a wrapper such as a breaker has
// the methods whether or not the store it wraps tracks anything.
type HotTracker interface {
	// Touch records one use of the prefix whose block chain, leading block
	// first, is keys in ns; only the first MaxHotChain keys are recorded.
	// A prefix is identified by its namespace and its last recorded key
	// (chained keys identify the whole chain). Touching no keys does
	// nothing. Entries not touched for the store's TTL are forgotten.
	Touch(ctx context.Context, ns Namespace, keys []uint64) error
	// Hottest returns up to k prefixes of model, most used first, each
	// with its chain.
	Hottest(ctx context.Context, model string, k int) ([]HotPrefix, error)
}

// Tracker returns s's HotTracker, or nil when s tracks nothing: s itself
// if it implements HotTracker, unless it is a wrapper (it has an
// Unwrap() Store method) around a store that tracks nothing.
func Tracker(s Store) HotTracker {
	h, ok := s.(HotTracker)
	if !ok {
		return nil
	}
	if u, ok := s.(interface{ Unwrap() Store }); ok && Tracker(u.Unwrap()) == nil {
		return nil
	}
	return h
}

// ErrNotTracked is returned (wrapped) by a wrapper's HotTracker methods
// when the store it wraps is no HotTracker.
var ErrNotTracked = errors.New("store does not track hot prefixes")

// HotID returns the identifier of the prefix of ns whose last recorded key
// is last: 32 hex digits, the salt's then the key's. Stores use it to name
// a prefix's entry.
func HotID(ns Namespace, last uint64) string {
	return fmt.Sprintf("%016x%016x", ns.Salt, last)
}
