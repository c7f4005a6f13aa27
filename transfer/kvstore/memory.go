package kvstore

import (
	"container/list"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/batonllm/baton/transfer"
)

// ErrClosed is returned by a Memory store's calls after Close.
var ErrClosed = errors.New("kvstore: store closed")

// entryOverhead approximates the bytes an entry costs beyond its key and
// value (list element, map slot, entry struct), so that many tiny blocks
// cannot exceed Capacity by much.
const entryOverhead = 128

// Memory is the shared tier in process: a fleet whose workers run in one
// process (baton demo, tests) shares it when no Redis is configured. It
// holds encoded copies of the blocks, bounded by bytes with LRU eviction
// and by TTL, and verifies them on Get exactly as Redis does.
type Memory struct {
	capacity int64
	ttl      time.Duration // 0: no expiry
	now      func() time.Time

	mu     sync.Mutex
	used   int64
	lru    list.List // of *memEntry, most recently used first
	items  map[string]*list.Element
	hot    map[string]*memHot // by model (hot.go)
	closed bool
}

type memEntry struct {
	key     string
	value   []byte // encoded; never modified once stored
	expires time.Time
}

func (e *memEntry) cost() int64 { return int64(len(e.key)+len(e.value)) + entryOverhead }

// NewMemory returns an empty in-process store.
func NewMemory(cfg MemoryConfig) *Memory {
	m := &Memory{
		capacity: cfg.Capacity,
		ttl:      cfg.TTL,
		now:      time.Now,
		items:    make(map[string]*list.Element),
		hot:      make(map[string]*memHot),
	}
	if m.capacity <= 0 {
		m.capacity = DefaultMemoryCapacity
	}
	switch {
	case m.ttl == 0:
		m.ttl = DefaultTTL
	case m.ttl < 0:
		m.ttl = 0
	}
	return m
}

// Put stores copies of blocks. A block larger than the whole capacity is
// not stored.
func (m *Memory) Put(ctx context.Context, ns transfer.Namespace, blocks []transfer.Block) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	entries := make([]*memEntry, len(blocks))
	for i, b := range blocks { // encode (copy and checksum) outside the lock
		entries[i] = &memEntry{
			key:   transfer.StoreKey(ns, b.Key),
			value: encode(make([]byte, valueSize(len(b.Data))), b.Data),
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	var expires time.Time
	if m.ttl > 0 {
		expires = m.now().Add(m.ttl)
	}
	for _, e := range entries {
		e.expires = expires
		if el, ok := m.items[e.key]; ok {
			m.remove(el)
		}
		if e.cost() > m.capacity {
			continue
		}
		m.items[e.key] = m.lru.PushFront(e)
		m.used += e.cost()
		for m.used > m.capacity {
			m.remove(m.lru.Back())
		}
	}
	return nil
}

// Get returns copies of the payloads of keys; a missing, expired or bad
// value is nil, and a bad one is deleted.
func (m *Memory) Get(ctx context.Context, ns transfer.Namespace, keys []uint64, size int) ([][]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	found := make([]*memEntry, len(keys))
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, ErrClosed
	}
	now := m.now()
	for i, k := range keys {
		if e := m.lookup(transfer.StoreKey(ns, k), now); e != nil {
			m.lru.MoveToFront(m.items[e.key])
			found[i] = e
		}
	}
	m.mu.Unlock()

	// Verify and copy outside the lock: values are never modified.
	data := make([][]byte, len(keys))
	for i, e := range found {
		if e == nil {
			continue
		}
		p, err := decode(keys[i], e.value, size)
		if err != nil {
			m.drop(e)
			continue
		}
		data[i] = append([]byte(nil), p...)
	}
	return data, nil
}

// Exists reports which keys are present and unexpired; it does not count
// as a use for LRU.
func (m *Memory) Exists(ctx context.Context, ns transfer.Namespace, keys []uint64) ([]bool, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ok := make([]bool, len(keys))
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, ErrClosed
	}
	now := m.now()
	for i, k := range keys {
		ok[i] = m.lookup(transfer.StoreKey(ns, k), now) != nil
	}
	return ok, nil
}

// Close drops every block. It is idempotent; calls after it fail with
// ErrClosed.
func (m *Memory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	m.items = nil
	m.hot = nil
	m.lru.Init()
	m.used = 0
	return nil
}

// Len returns the blocks held, expired ones not yet dropped included.
func (m *Memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.items)
}

// Used returns the bytes held as Capacity counts them.
func (m *Memory) Used() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.used
}

// lookup returns key's live entry, dropping it if it has expired. m.mu is
// held.
func (m *Memory) lookup(key string, now time.Time) *memEntry {
	el, ok := m.items[key]
	if !ok {
		return nil
	}
	e := el.Value.(*memEntry)
	if !e.expires.IsZero() && !now.Before(e.expires) {
		m.remove(el)
		return nil
	}
	return e
}

// drop deletes e unless a Put has replaced it since.
func (m *Memory) drop(e *memEntry) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.items[e.key]; ok && el.Value.(*memEntry) == e {
		m.remove(el)
	}
}

// remove deletes el. m.mu is held.
func (m *Memory) remove(el *list.Element) {
	e := m.lru.Remove(el).(*memEntry)
	delete(m.items, e.key)
	m.used -= e.cost()
}

var _ transfer.Store = (*Memory)(nil)
