package sim

import (
	"context"
	"time"
)

// Drain makes the engine refuse new sequences (Generate, Decode and
// Prefill fail with ErrDraining, which a scheduler retries on another
// worker) while those it runs go on. It cannot be undone; Close still
// stops the engine.
func (e *Engine) Drain() {
	e.mu.Lock()
	e.draining = true
	e.mu.Unlock()
}

// Idle reports whether the engine runs and queues no sequence.
func (e *Engine) Idle() bool { return e.running.Load() == 0 && e.waiting.Load() == 0 }

// WriteHot writes up to n of the cached blocks the shared tier may lack,
// most recently used first, to the shared tier, through the writer's path
// (a batched Put each, announced as stored in the Redis tier), so that
// the fleet keeps them when this worker goes away. It is for a worker
// that drains, once its sequences have ended. Without a shared tier, and
// under the write-through policy (which wrote every block already), it
// writes nothing. It stops when ctx ends and returns the blocks written.
func (e *Engine) WriteHot(ctx context.Context, n int) int {
	if e.store == nil || e.cfg.Tiers.StorePolicy == PolicyWriteThrough || n <= 0 {
		return 0
	}
	hot := e.cache.hottest(n)
	written := 0
	for i := 0; i < len(hot) && ctx.Err() == nil; i += storeBatch {
		written += e.put(hot[i:min(i+storeBatch, len(hot))])
	}
	return written
}

// drainPoll is how often a draining worker checks whether its sequences
// and calls have ended.
const drainPoll = 10 * time.Millisecond
