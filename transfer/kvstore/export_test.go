package kvstore

import "time"

// SetRaw stores value under key as is, unencoded, with m's TTL: the
// suite's way to corrupt a block.
func (m *Memory) SetRaw(key string, value []byte) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := &memEntry{key: key, value: append([]byte(nil), value...)}
	if m.ttl > 0 {
		e.expires = m.now().Add(m.ttl)
	}
	if el, ok := m.items[key]; ok {
		m.remove(el)
	}
	m.items[key] = m.lru.PushFront(e)
	m.used += e.cost()
}

// RawValue returns key's stored value, nil if absent.
func (m *Memory) RawValue(key string) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.items[key]; ok {
		return el.Value.(*memEntry).value
	}
	return nil
}

// RawTTL returns key's remaining time to live, -1 when it has none, -2
// when it is absent (Redis's TTL replies).
func (m *Memory) RawTTL(key string) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.items[key]
	if !ok {
		return -2
	}
	e := el.Value.(*memEntry)
	if e.expires.IsZero() {
		return -1
	}
	return e.expires.Sub(m.now())
}

// SetNow replaces m's clock.
func (m *Memory) SetNow(now func() time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.now = now
}
