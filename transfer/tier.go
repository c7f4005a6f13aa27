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
