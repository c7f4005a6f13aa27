package sim

import (
	"context"
	"errors"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvblock"
)

// The engine's side of the CPU and shared tiers: modelled copy and fetch
// times, the lookup in the shared tier at admission, the writer that
// feeds it, and warm-up.

// Writes to the shared tier are batched by up to storeBatch blocks, each
// Put bounded by storeWriteFactor × Config.Tiers.StoreTimeout of real time.
const (
	storeBatch       = 64
	storeWriteFactor = 4
)

// pcieSeconds is the modelled time of copying n blocks from the CPU tier
// back to the GPU tier.
func (e *Engine) pcieSeconds(n int) float64 { return e.fig.CPUCopySeconds(n) }

// fetchSeconds is the modelled time of fetching n blocks from the shared
// tier in one round trip; a lookup that finds none still costs the trip.
func (e *Engine) fetchSeconds(n int) float64 {
	return max(e.fig.RedisFetchSeconds(n), e.fig.RedisRTTSeconds)
}

// PCIeSeconds and FetchSeconds are the modelled times (before TimeScale)
// of promoting n blocks from the CPU tier and of fetching n blocks from
// the shared tier.
func (e *Engine) PCIeSeconds(n int) float64  { return e.pcieSeconds(n) }
func (e *Engine) FetchSeconds(n int) float64 { return e.fetchSeconds(n) }

// CostParams returns the engine's cost figures in real seconds (modelled
// figures over TimeScale), for a scheduler to estimate time to first
// token with the formulas the engine charges.
func (e *Engine) CostParams() *workerpb.CostParams {
	return e.fig.Scaled(e.cfg.TimeScale).Proto()
}

// fetch asks the shared tier, before s is queued, for the leading prompt
// blocks neither local tier holds, when fetching all of them would take
// less modelled time than computing them. The blocks that come back, up to
// the first missing one, enter the GPU tier (stored events, tier GPU) and
// s waits the modelled fetch time (fetchSeconds, over TimeScale, less the
// real time the call took); missing keys are announced as removed from
// the Redis tier. A lookup that fails, times out or is bypassed leaves the
// blocks to be computed: only ctx ending or the engine closing fails s.
//
// Blocks fetched may be evicted again before s is admitted under memory
// pressure; s then recomputes them.
func (e *Engine) fetch(ctx context.Context, s *seq) error {
	if e.store == nil {
		return nil
	}
	local := e.cache.Lookup(s.Keys)
	want := s.Keys[local:]
	if len(want) == 0 {
		return nil
	}
	// Tokens the fetched blocks stand for: the prompt's last token is
	// always recomputed.
	tokens := min(len(want)*BlockTokens, s.Prompt-1-local*BlockTokens)
	if tokens <= 0 || e.fetchSeconds(len(want)) >= e.cost.PrefillSeconds(tokens, local*BlockTokens) {
		return nil
	}
	start := time.Now()
	fctx, cancel := context.WithTimeout(ctx, e.cfg.Tiers.StoreTimeout)
	data, err := e.store.Get(fctx, s.NS, want, e.blockBytes)
	cancel()
	e.statsMu.Lock()
	e.stats.StoreLookups++
	if err != nil {
		e.stats.StoreErrors++
	}
	e.statsMu.Unlock()
	if err != nil {
		return ctx.Err() // nil unless the caller gave up
	}
	n := 0
	for n < len(want) && n < len(data) && data[n] != nil {
		n++
	}
	var missing []uint64
	for i, k := range want {
		if i >= len(data) || data[i] == nil {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		e.hub.publishCache(CacheEvent{Kind: BlockRemoved, Tier: TierRedis, Keys: missing})
	}
	for _, k := range want[:n] {
		e.cache.Insert(s.NS, k, true)
	}
	s.fetchLo, s.fetchHi = local, local+n
	secs := e.fetchSeconds(n)
	e.statsMu.Lock()
	e.stats.StoreHitBlocks += uint64(n)
	e.stats.StoreFetchSeconds += secs
	e.statsMu.Unlock()
	if !sleepUntil(start.Add(time.Duration(secs/e.cfg.TimeScale*float64(time.Second))), nil, e.quit, ctx.Done()) {
		if err := ctx.Err(); err != nil {
			return err
		}
		return ErrClosed
	}
	return nil
}

// storeWrite is one block waiting to be written to the shared tier.
type storeWrite struct {
	ns  transfer.Namespace
	key uint64
}

// queueWrite hands a block to the writer without blocking: when the queue
// is full the block is dropped and counted. Called with the cache's lock
// held.
func (e *Engine) queueWrite(ns transfer.Namespace, key uint64) {
	select {
	case e.writes <- storeWrite{ns, key}:
	default:
		e.statsMu.Lock()
		e.stats.StoreWriteDropped++
		e.statsMu.Unlock()
	}
}

// writer writes queued blocks to the shared tier, up to storeBatch per Put
// and namespace, and announces those written (stored events, tier Redis).
// Blocks still queued at Close are abandoned.
func (e *Engine) writer() {
	defer e.wg.Done()
	batch := make([]storeWrite, 0, storeBatch)
	for {
		select {
		case w := <-e.writes:
			batch = append(batch[:0], w)
		case <-e.quit:
			return
		}
	drain:
		for len(batch) < storeBatch {
			select {
			case w := <-e.writes:
				batch = append(batch, w)
			default:
				break drain
			}
		}
		e.put(batch)
	}
}

// put writes one batch, a Put per namespace, and returns the blocks
// written.
func (e *Engine) put(batch []storeWrite) int {
	written := 0
	byNS := make(map[transfer.Namespace][]transfer.Block)
	for _, w := range batch {
		buf := e.getBuf()
		kvblock.Fill(*buf, w.key)
		byNS[w.ns] = append(byNS[w.ns], transfer.Block{Key: w.key, Data: *buf})
	}
	for ns, blocks := range byNS {
		ctx, cancel := context.WithTimeout(e.ctx, storeWriteFactor*e.cfg.Tiers.StoreTimeout)
		err := e.store.Put(ctx, ns, blocks)
		cancel()
		keys := make([]uint64, len(blocks))
		for i, b := range blocks {
			keys[i] = b.Key
			e.putBuf(b.Data)
		}
		e.statsMu.Lock()
		if err != nil {
			e.stats.StoreWriteErrors += uint64(len(blocks))
		} else {
			e.stats.StoreWrites += uint64(len(blocks))
		}
		e.statsMu.Unlock()
		if err == nil {
			written += len(keys)
			e.hub.publishCache(CacheEvent{Kind: BlockStored, Tier: TierRedis, Keys: keys})
		}
	}
	return written
}

// Warm fetches the blocks of one prefix (chained keys, leading first) in
// namespace ns from the shared tier into the cache, as unreferenced
// blocks of the GPU tier (or of the CPU tier when every GPU block is in
// use), announcing them as stored. It stops at the first block the tier
// lacks (later ones could never be hit) and returns how many blocks it
// inserted. Blocks already cached are not fetched again. Warm-up costs no
// modelled time: it runs before the worker takes traffic.
//
// It fails only when the engine has no shared tier, or with the store's or
// ctx's error.
func (e *Engine) Warm(ctx context.Context, ns transfer.Namespace, keys []uint64) (int, error) {
	if e.store == nil {
		return 0, errNoStore
	}
	local := e.cache.Lookup(keys)
	want := keys[local:]
	if len(want) == 0 {
		return 0, nil
	}
	data, err := e.store.Get(ctx, ns, want, e.blockBytes)
	if err != nil {
		return 0, err
	}
	n := 0
	for ; n < len(want) && n < len(data) && data[n] != nil; n++ {
		if e.cache.Insert(ns, want[n], true) == 0 {
			break
		}
	}
	e.statsMu.Lock()
	e.stats.WarmedBlocks += uint64(n)
	e.statsMu.Unlock()
	return n, nil
}

var errNoStore = errors.New("sim engine has no shared tier (Config.Tiers.Store)")
