package kvstore

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer"
)

// Hot-prefix tracking (transfer.HotTracker), in both stores:
//
//   - baton:hot:<model> is a sorted set of the model's prefixes, member
//     transfer.HotID(ns, last key of the chain) (salt and last key, 32 hex
//     digits), score the uses recorded. Touch adds 1 (ZINCRBY) and sets
//     the set's TTL to the store's. It holds at most MaxHotPrefixes
//     members: now and then (every hotTrimEvery touches of a client) the
//     lowest ranked beyond that are removed.
//   - baton:hotchain:<model>:<id> is the prefix's chain of block keys,
//     packed little-endian uint64s, rewritten by every Touch with the
//     store's TTL. A member whose chain has expired (not touched for a
//     TTL) is skipped, and removed, by Hottest.
//   - Scores decay: once per HotHalfLife per model (whichever client gets
//     there first, guarded by baton:hotdecay:<model>, SET NX with that
//     TTL) every score is halved, so yesterday's favourites give way.
const (
	// MaxHotPrefixes bounds the prefixes tracked per model.
	MaxHotPrefixes = 10000
	// HotHalfLife is how often every score of a model is halved.
	HotHalfLife = time.Hour
	// hotTrimEvery is how many touches a client makes between trims (and
	// decay checks).
	hotTrimEvery = 64
	// maxHottest bounds k in Hottest.
	maxHottest = 1000
	// hotPages bounds the pages of 2k members Hottest reads.
	hotPages = 4
)

func hotSetKey(model string) string       { return "baton:hot:" + model }
func hotDecayKey(model string) string     { return "baton:hotdecay:" + model }
func hotChainKey(model, id string) string { return "baton:hotchain:" + model + ":" + id }

// errHotChain reports a chain value that does not decode, or does not end
// with its member's key.
var errHotChain = errors.New("bad hot chain")

// hotChain returns the recorded part of a chain: at most the first
// transfer.MaxHotChain keys.
func hotChain(keys []uint64) []uint64 { return keys[:min(len(keys), transfer.MaxHotChain)] }

func packChain(keys []uint64) []byte {
	b := make([]byte, 8*len(keys))
	for i, k := range keys {
		binary.LittleEndian.PutUint64(b[8*i:], k)
	}
	return b
}

// unpackChain decodes the chain of member id.
func unpackChain(id string, b []byte) (transfer.Namespace, []uint64, error) {
	var ns transfer.Namespace
	if len(id) != 32 || len(b) == 0 || len(b)%8 != 0 || len(b) > 8*transfer.MaxHotChain {
		return ns, nil, errHotChain
	}
	salt, err1 := strconv.ParseUint(id[:16], 16, 64)
	last, err2 := strconv.ParseUint(id[16:], 16, 64)
	if err1 != nil || err2 != nil {
		return ns, nil, errHotChain
	}
	keys := make([]uint64, len(b)/8)
	for i := range keys {
		keys[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	if keys[len(keys)-1] != last {
		return ns, nil, errHotChain
	}
	ns.Salt = salt
	return ns, keys, nil
}

// Touch records one use of the prefix chained by keys: one pipelined round
// trip (ZINCRBY, SET of the chain, EXPIRE of the set; and, every
// hotTrimEvery calls, the trim and the decay guard, plus, once per
// HotHalfLife, one more for the decay).
func (r *Redis) Touch(ctx context.Context, ns transfer.Namespace, keys []uint64) error {
	keys = hotChain(keys)
	if len(keys) == 0 {
		return nil
	}
	id := transfer.HotID(ns, keys[len(keys)-1])
	set := hotSetKey(ns.Model)
	pipe := r.client.Pipeline()
	pipe.ZIncrBy(ctx, set, 1, id)
	pipe.Set(ctx, hotChainKey(ns.Model, id), packChain(keys), r.ttl)
	if r.ttl > 0 {
		pipe.Expire(ctx, set, r.ttl)
	}
	var decay *redis.BoolCmd
	if r.touches.Add(1)%hotTrimEvery == 0 {
		pipe.ZRemRangeByRank(ctx, set, 0, -(MaxHotPrefixes + 1))
		decay = pipe.SetNX(ctx, hotDecayKey(ns.Model), 1, HotHalfLife)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("redis touch of a %d-block prefix: %w", len(keys), err)
	}
	if decay != nil && decay.Val() {
		// The first decay check of a model sets the guard: scores are
		// halved every HotHalfLife from then on.
		if err := r.client.ZUnionStore(ctx, set, &redis.ZStore{Keys: []string{set}, Weights: []float64{0.5}}).Err(); err != nil {
			return fmt.Errorf("redis decay of %s: %w", set, err)
		}
	}
	return nil
}

// Hottest returns up to k of model's most used prefixes, in two round
// trips (ZREVRANGE, then pipelined GETs of the chains) per page of 2k
// members, and one that removes members whose chain has expired or is
// bad. It reads more pages only while stale members leave it short, at
// most hotPages.
func (r *Redis) Hottest(ctx context.Context, model string, k int) ([]transfer.HotPrefix, error) {
	if k <= 0 {
		return nil, nil
	}
	k = min(k, maxHottest)
	set := hotSetKey(model)
	var out []transfer.HotPrefix
	var stale []any
	page := int64(2 * k) // some chains may have expired
	for p := range int64(hotPages) {
		zs, err := r.client.ZRevRangeWithScores(ctx, set, p*page, (p+1)*page-1).Result()
		if err != nil {
			return nil, fmt.Errorf("redis hottest of %s: %w", model, err)
		}
		if len(zs) == 0 {
			break
		}
		pipe := r.client.Pipeline()
		cmds := make([]*redis.StringCmd, len(zs))
		for i, z := range zs {
			cmds[i] = pipe.Get(ctx, hotChainKey(model, fmt.Sprint(z.Member)))
		}
		_, _ = pipe.Exec(ctx) // a missing chain is redis.Nil, told apart below
		for i, cmd := range cmds {
			id := fmt.Sprint(zs[i].Member)
			v, err := cmd.Bytes()
			switch {
			case errors.Is(err, redis.Nil):
				stale = append(stale, id)
				continue
			case err != nil:
				return nil, fmt.Errorf("redis hottest of %s: %w", model, err)
			}
			ns, keys, err := unpackChain(id, v)
			if err != nil {
				stale = append(stale, id)
				continue
			}
			if len(out) < k {
				ns.Model = model
				out = append(out, transfer.HotPrefix{NS: ns, Keys: keys, Score: zs[i].Score})
			}
		}
		if len(out) == k || int64(len(zs)) < page {
			break
		}
	}
	if len(stale) > 0 {
		// Best effort: a stale member left behind is skipped again.
		_ = r.client.ZRem(ctx, set, stale...).Err()
	}
	return out, nil
}

var _ transfer.HotTracker = (*Redis)(nil)

// memHot is a Memory store's hot prefixes of one model.
type memHot struct {
	entries map[string]*memHotEntry // by transfer.HotID
	decayed time.Time               // last halving (or the first touch)
}

type memHotEntry struct {
	ns      transfer.Namespace
	keys    []uint64 // owned; never modified once stored
	score   float64
	expires time.Time
}

// Touch records one use of the prefix chained by keys, as Redis does.
func (m *Memory) Touch(ctx context.Context, ns transfer.Namespace, keys []uint64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	keys = hotChain(keys)
	if len(keys) == 0 {
		return nil
	}
	id := transfer.HotID(ns, keys[len(keys)-1])
	owned := slices.Clone(keys)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return ErrClosed
	}
	now := m.now()
	h := m.hot[ns.Model]
	if h == nil {
		h = &memHot{entries: make(map[string]*memHotEntry), decayed: now}
		m.hot[ns.Model] = h
	}
	if n := int(now.Sub(h.decayed) / HotHalfLife); n > 0 {
		f := math.Ldexp(1, -min(n, 1100)) // halved n times (0 past float64's range)
		for _, e := range h.entries {
			e.score *= f
		}
		h.decayed = h.decayed.Add(time.Duration(n) * HotHalfLife)
	}
	e := h.entries[id]
	if e == nil {
		e = &memHotEntry{ns: ns}
		h.entries[id] = e
	}
	e.keys = owned
	e.score++
	if m.ttl > 0 {
		e.expires = now.Add(m.ttl)
	}
	if len(h.entries) > MaxHotPrefixes+MaxHotPrefixes/8 {
		m.trimHot(h, now)
	}
	return nil
}

// trimHot drops expired entries, then the lowest ranked beyond
// MaxHotPrefixes. m.mu is held.
func (m *Memory) trimHot(h *memHot, now time.Time) {
	ids := h.live(now)
	if len(ids) <= MaxHotPrefixes {
		return
	}
	sortHot(ids, h.entries)
	for _, id := range ids[MaxHotPrefixes:] {
		delete(h.entries, id)
	}
}

// live drops h's entries expired at now and returns the ids of the rest,
// in no order. m.mu is held.
func (h *memHot) live(now time.Time) []string {
	ids := make([]string, 0, len(h.entries))
	for id, e := range h.entries {
		if !e.expires.IsZero() && !now.Before(e.expires) {
			delete(h.entries, id)
			continue
		}
		ids = append(ids, id)
	}
	return ids
}

// sortHot sorts ids most used first, ties by id descending (Redis's
// ZREVRANGE order).
func sortHot(ids []string, entries map[string]*memHotEntry) {
	slices.SortFunc(ids, func(a, b string) int {
		if c := cmp.Compare(entries[b].score, entries[a].score); c != 0 {
			return c
		}
		return cmp.Compare(b, a)
	})
}

// Hottest returns up to k of model's most used prefixes; the chains are
// the caller's.
func (m *Memory) Hottest(ctx context.Context, model string, k int) ([]transfer.HotPrefix, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, ErrClosed
	}
	h := m.hot[model]
	if k <= 0 || h == nil {
		return nil, nil
	}
	ids := h.live(m.now())
	sortHot(ids, h.entries)
	out := make([]transfer.HotPrefix, 0, min(k, len(ids)))
	for _, id := range ids[:min(k, len(ids))] {
		e := h.entries[id]
		out = append(out, transfer.HotPrefix{NS: e.ns, Keys: slices.Clone(e.keys), Score: e.score})
	}
	return out, nil
}

var _ transfer.HotTracker = (*Memory)(nil)

// Touch calls the store's Touch unless the breaker is open. It fails with
// transfer.ErrNotTracked, without counting, when the store tracks nothing.
func (b *Breaker) Touch(ctx context.Context, ns transfer.Namespace, keys []uint64) error {
	h := transfer.Tracker(b.s)
	if h == nil {
		return fmt.Errorf("%s: %w", b.cb.Name(), transfer.ErrNotTracked)
	}
	_, err := b.cb.Execute(func() (struct{}, error) {
		return struct{}{}, h.Touch(ctx, ns, keys)
	})
	return b.wrap(OpTouch, err)
}

// Hottest calls the store's Hottest unless the breaker is open. It fails
// with transfer.ErrNotTracked, without counting, when the store tracks
// nothing.
func (b *Breaker) Hottest(ctx context.Context, model string, k int) ([]transfer.HotPrefix, error) {
	h := transfer.Tracker(b.s)
	if h == nil {
		return nil, fmt.Errorf("%s: %w", b.cb.Name(), transfer.ErrNotTracked)
	}
	var out []transfer.HotPrefix
	_, err := b.cb.Execute(func() (struct{}, error) {
		var err error
		out, err = h.Hottest(ctx, model, k)
		return struct{}{}, err
	})
	return out, b.wrap(OpHottest, err)
}

// Unwrap returns the store the breaker guards (see transfer.Tracker).
func (b *Breaker) Unwrap() transfer.Store { return b.s }

var _ transfer.HotTracker = (*Breaker)(nil)
