package sim

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
)

// Errors of Generate; match them with errors.Is.
var (
	// ErrClosed: the engine is closed. It wraps engine.ErrUnavailable.
	ErrClosed = fmt.Errorf("sim engine closed: %w", engine.ErrUnavailable)
	// ErrDraining: the engine drains for shutdown (Drain) and takes no
	// new sequence. It wraps engine.ErrUnavailable.
	ErrDraining = fmt.Errorf("sim engine draining: %w", engine.ErrUnavailable)
	// ErrUnknownModel: the engine does not serve the requested model
	// (engine.ErrUnknownModel, so callers need not know the engine).
	ErrUnknownModel = engine.ErrUnknownModel
	// ErrInvalid: the request can never be served (empty prompt, negative
	// max tokens, more blocks than the cache holds); engine.ErrInvalid.
	ErrInvalid = engine.ErrInvalid
)

// Load is the engine's instantaneous load.
type Load struct {
	Running, Waiting int
	// BlocksUsed counts GPU blocks referenced or reserved by sequences;
	// unreferenced cached blocks are free for reuse.
	BlocksUsed, BlocksTotal int64
	// CPUBlocksUsed counts the blocks in the CPU tier (all unreferenced
	// copies), out of CPUBlocksTotal.
	CPUBlocksUsed, CPUBlocksTotal int64
	// WaitingPrefillTokens counts the prompt tokens still to prefill:
	// whole prompts of queued sequences, the rest of partly prefilled ones.
	WaitingPrefillTokens int64
}

// Stats are cumulative counters of the step loop.
type Stats struct {
	Steps uint64
	// ModelledSeconds is the modelled time of all steps.
	ModelledSeconds float64
	// MaxBatch is the largest number of sequences run in one step.
	MaxBatch int
	// DecodeSteps and DecodeSeconds count the steps that only decoded
	// (no prefill chunk) and their modelled time.
	DecodeSteps   uint64
	DecodeSeconds float64

	// PromotedBlocks were copied from the CPU tier back to the GPU tier
	// at admission, costing PCIeSeconds of modelled time (included in
	// ModelledSeconds).
	PromotedBlocks uint64
	PCIeSeconds    float64
	// StoreLookups asked the shared tier for a sequence's next leading
	// blocks; StoreHitBlocks came back and entered the cache, costing
	// StoreFetchSeconds of modelled time (waited before queueing, not
	// part of ModelledSeconds). StoreErrors counts lookups that failed or
	// were bypassed (the blocks were then computed).
	StoreLookups      uint64
	StoreHitBlocks    uint64
	StoreFetchSeconds float64
	StoreErrors       uint64
	// StoreWrites counts blocks written to the shared tier; writes that
	// failed and blocks dropped because the write queue was full are
	// counted apart.
	StoreWrites       uint64
	StoreWriteErrors  uint64
	StoreWriteDropped uint64
	// WarmedBlocks entered the cache by warm-up (Warm); WarmedPrefixes
	// counts the prefixes the start-up warm-up found (at least one block
	// warmed, or all already cached) out of WarmupPrefixes it was given.
	WarmedBlocks   uint64
	WarmedPrefixes uint64
	WarmupPrefixes uint64
	// HotTouches counts uses of reused prefixes recorded in the shared
	// tier's hot-prefix tracker (transfer.HotTracker); HotTouchErrors
	// failed, HotTouchDropped were dropped because the queue was full.
	// HotWriteBlocks counts blocks of hot prefixes queued for writing to
	// the shared tier so that workers that join can warm them.
	HotTouches      uint64
	HotTouchErrors  uint64
	HotTouchDropped uint64
	HotWriteBlocks  uint64

	// Pushes counts the KV pushes Prefill started to a decode worker,
	// PushFailures those that failed; PushBlocks and PushBytes are what
	// the successful ones moved.
	Pushes       uint64
	PushFailures uint64
	PushBlocks   uint64
	PushBytes    uint64
	// TransfersReceived counts the pushes this worker received to their
	// end (Finish), TransferFailures those that broke off;
	// ReceivedBlocks entered the cache, RejectedBlocks were dropped as
	// corrupt.
	TransfersReceived uint64
	TransferFailures  uint64
	ReceivedBlocks    uint64
	RejectedBlocks    uint64
}

// Engine is a simulated LLM engine: vLLM-style continuous batching with
// chunked prefill and a paged prefix cache, timed by a CostModel. New
// starts its step loop; Close stops it. Its methods are safe for
// concurrent use.
type Engine struct {
	cfg    Config
	cost   CostModel
	cache  *Cache
	hub    hub
	models map[string]bool

	mu       sync.Mutex
	closed   bool
	draining bool
	incoming []*seq // Generate → step loop

	wakeCh chan struct{} // capacity 1
	quit   chan struct{}
	wg     sync.WaitGroup

	blockBytes int       // payload bytes of one block in transfers
	bufs       sync.Pool // of *[]byte of blockBytes: payloads written to the store
	xfers      xfers     // transfers received

	store  transfer.Store // shared tier, or nil
	writes chan storeWrite
	hot    transfer.HotTracker // the store's, or nil
	// touches feeds the toucher (hot.go); warmDone is closed when the
	// start-up warm-up has ended (at once without one).
	touches  chan hotTouch
	warmDone chan struct{}
	fig      cost.Figures // what Info reports (CostParams), in modelled seconds
	ctx      context.Context
	cancel   context.CancelFunc

	running, waiting atomic.Int64
	waitingPrefill   atomic.Int64
	statsMu          sync.Mutex
	stats            Stats

	lora *loraSlots

	// Step loop only.
	queue    []*seq // admitted order: FCFS
	run      []*seq
	loraSeen []string // the adapters of a step's batch
}

// New validates cfg and starts an engine.
func New(cfg Config) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("sim config: %w", err)
	}
	cm, err := cfg.costModel()
	if err != nil {
		return nil, fmt.Errorf("sim config: %w", err)
	}
	capacity := cfg.Tiers.GPUBlocks
	if capacity == 0 {
		capacity = cm.BlockCapacity(BlockTokens)
	}
	e := &Engine{
		cfg:    cfg,
		cost:   cm,
		models: make(map[string]bool, len(cfg.Models)),
		wakeCh: make(chan struct{}, 1),
		quit:   make(chan struct{}),

		blockBytes: kvblock.Size(cm.KVBytesPerToken(), BlockTokens, cfg.KVScale),
		store:      cfg.Tiers.Store,
		fig:        cfg.figures(cm),
		warmDone:   make(chan struct{}),
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.hub.init(cfg.WatchBuffer)
	cc := CacheConfig{GPUBlocks: capacity, CPUBlocks: cfg.Tiers.cpuBlocks(cm), Emit: e.hub.publishCache}
	if e.store != nil {
		e.writes = make(chan storeWrite, cfg.Tiers.StoreQueue)
		cc.Write, cc.WriteThrough = e.queueWrite, cfg.Tiers.StorePolicy == PolicyWriteThrough
	}
	e.cache = NewTieredCache(cc)
	for _, m := range cfg.Models {
		e.models[m] = true
	}
	e.lora = newLoRASlots(cfg.LoRA, e.quit, e.loraLoadTime)
	e.wg.Add(2)
	go e.loop()
	go e.reportLoad()
	warming := false
	if e.store != nil {
		e.wg.Add(1)
		go e.writer()
		if e.hot = transfer.Tracker(e.store); e.hot != nil {
			e.touches = make(chan hotTouch, hotQueue)
			e.wg.Add(1)
			go e.toucher()
		}
		if cfg.Warmup.TopK > 0 && (cfg.Warmup.Keys != nil || e.hot != nil) {
			warming = true
			e.wg.Add(1)
			go e.warmup()
		}
	}
	if !warming {
		close(e.warmDone)
	}
	return e, nil
}

// Config returns the engine's configuration, defaults applied.
func (e *Engine) Config() Config { return e.cfg }

// CostModel returns the engine's cost model.
func (e *Engine) CostModel() CostModel { return e.cost }

// Cache returns the engine's prefix cache, for inspection.
func (e *Engine) Cache() *Cache { return e.cache }

// Load returns the current load.
func (e *Engine) Load() Load {
	return Load{
		Running:     int(e.running.Load()),
		Waiting:     int(e.waiting.Load()),
		BlocksUsed:  e.cache.Used(),
		BlocksTotal: e.cache.Capacity(),

		CPUBlocksUsed:        e.cache.CPUUsed(),
		CPUBlocksTotal:       e.cache.CPUCapacity(),
		WaitingPrefillTokens: e.waitingPrefill.Load(),
	}
}

// Stats returns the step loop's counters.
func (e *Engine) Stats() Stats {
	e.statsMu.Lock()
	defer e.statsMu.Unlock()
	return e.stats
}

// Close stops the step loop, fails every outstanding sequence with
// ErrClosed and ends every Watch subscription. It is idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if !e.closed {
		e.closed = true
		close(e.quit)
		e.cancel()
	}
	e.mu.Unlock()
	e.wg.Wait()
	return nil
}

// Generate queues req and returns its stream. It fails with
// ErrUnknownModel, ErrInvalid or ErrClosed (wrapped) without generating
// anything. Cancelling ctx, or closing the stream, removes the sequence
// and releases its blocks; Recv then returns ctx's error.
func (e *Engine) Generate(ctx context.Context, req *engine.Request) (engine.Stream, error) {
	s, err := e.newSeq(ctx, req, false)
	if err != nil {
		return nil, err
	}
	return e.startAdapter(ctx, s)
}

// startAdapter is start for a sequence that may name an adapter: it runs
// once the adapter is in a slot, loaded if need be, which it keeps until
// its stream ends.
func (e *Engine) startAdapter(ctx context.Context, s *seq) (engine.Stream, error) {
	if s.adapter == "" {
		return e.start(ctx, s)
	}
	release, err := e.lora.acquire(ctx, s.adapter)
	if err != nil {
		return nil, err
	}
	st, err := e.start(ctx, s)
	if err != nil {
		release()
		return nil, err
	}
	return loraStream{st, release}, nil
}

// newSeq validates req and builds its sequence; prefillOnly sequences stop
// once their prompt is computed (Prefill).
func (e *Engine) newSeq(ctx context.Context, req *engine.Request, prefillOnly bool) (*seq, error) {
	if req == nil {
		return nil, fmt.Errorf("nil request: %w", ErrInvalid)
	}
	_, isAdapter := e.lora.adapter(req.Model)
	if !e.models[req.Model] && !isAdapter {
		return nil, fmt.Errorf("model %q: %w", req.Model, ErrUnknownModel)
	}
	if req.Prompt == "" {
		return nil, fmt.Errorf("empty prompt: %w", ErrInvalid)
	}
	if req.MaxTokens < 0 {
		return nil, fmt.Errorf("max tokens %d: %w", req.MaxTokens, ErrInvalid)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	salt := blockkey.Seed(req.Model, req.Tenant)
	s := &seq{
		id:     req.ID,
		ns:     transfer.Namespace{Model: req.Model, Salt: salt},
		keys:   blockkey.Append(nil, salt, req.Prompt, blockkey.DefaultBlockChars),
		prompt: blockkey.Tokens(blockkey.Chars(req.Prompt)),
		limit:  req.MaxTokens,
		hash:   promptHash(req.Prompt),
		wake:   e.wake,
	}
	if isAdapter {
		s.adapter = req.Model
	}
	if prefillOnly {
		s.pre = &prefillJob{done: make(chan struct{})}
		s.blocks = int64((s.prompt + BlockTokens - 1) / BlockTokens)
		if s.blocks > e.cache.Capacity() {
			return nil, fmt.Errorf("%d prompt tokens need %d blocks, capacity %d: %w",
				s.prompt, s.blocks, e.cache.Capacity(), ErrInvalid)
		}
		return s, nil
	}
	if s.limit == 0 {
		s.limit = e.cfg.DefaultMaxTokens
	}
	s.nat = naturalLength(s.hash)
	for _, st := range req.Stop {
		if st != "" {
			s.stopper.stop = append(s.stopper.stop, st)
		}
	}
	gen := min(s.limit, s.nat)
	s.blocks = int64((s.prompt + gen + BlockTokens - 1) / BlockTokens)
	if s.blocks > e.cache.Capacity() {
		return nil, fmt.Errorf("%d prompt and %d completion tokens need %d blocks, capacity %d: %w",
			s.prompt, gen, s.blocks, e.cache.Capacity(), ErrInvalid)
	}
	return s, nil
}

// start queues a generating sequence and returns its stream.
func (e *Engine) start(ctx context.Context, s *seq) (engine.Stream, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := e.fetch(ctx, s); err != nil {
		return nil, err
	}
	st := newStream(s)
	s.st = st
	if err := e.enqueue(s); err != nil {
		return nil, err
	}
	st.stop = context.AfterFunc(ctx, func() {
		st.fail(ctx.Err())
		s.cancel()
	})
	e.wake()
	return st, nil
}

// enqueue hands s to the step loop.
func (e *Engine) enqueue(s *seq) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if e.draining {
		return ErrDraining
	}
	s.queued = time.Now()
	e.setPending(s, s.prompt)
	e.incoming = append(e.incoming, s)
	e.waiting.Add(1)
	return nil
}

func (e *Engine) wake() {
	select {
	case e.wakeCh <- struct{}{}:
	default:
	}
}

// loop is the step loop: admit, schedule, sleep the modelled step time,
// emit. It runs until Close.
func (e *Engine) loop() {
	defer e.wg.Done()
	defer e.shutdown()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		// A step lasts its modelled time from when the loop starts
		// planning it; completing it (emitting its tokens) comes after.
		start := time.Now()
		e.mu.Lock()
		e.queue = append(e.queue, e.incoming...)
		clear(e.incoming)
		e.incoming = e.incoming[:0]
		e.mu.Unlock()
		e.dropCancelled()

		dt, batch, decodeOnly := e.schedule()
		if batch == 0 {
			select {
			case <-e.wakeCh:
				continue
			case <-e.quit:
				return
			}
		}
		deadline := start.Add(time.Duration(dt / e.cfg.TimeScale * float64(time.Second)))
		if !sleepUntil(deadline, timer, e.quit, nil) {
			return
		}
		e.complete()
		e.statsMu.Lock()
		e.stats.Steps++
		e.stats.ModelledSeconds += dt
		e.stats.MaxBatch = max(e.stats.MaxBatch, batch)
		if decodeOnly {
			e.stats.DecodeSteps++
			e.stats.DecodeSeconds += dt
		}
		e.statsMu.Unlock()
	}
}

// dropCancelled removes cancelled sequences and releases their blocks.
func (e *Engine) dropCancelled() {
	e.queue = slices.DeleteFunc(e.queue, func(s *seq) bool {
		if s.cancelled.Load() {
			e.waiting.Add(-1)
			e.setPending(s, 0)
			s.end(context.Canceled)
			return true
		}
		return false
	})
	e.run = slices.DeleteFunc(e.run, func(s *seq) bool {
		if s.cancelled.Load() {
			e.release(s)
			s.end(context.Canceled)
			return true
		}
		return false
	})
}

// handOver ends a prefill-only sequence whose prompt is computed: it
// leaves the batch, frees its partial block, and hands its full blocks,
// still referenced, to its Prefill call, which releases them after the
// push. Step loop only.
func (e *Engine) handOver(s *seq) {
	e.cache.Release(nil, s.reserved)
	s.reserved = 0
	e.running.Add(-1)
	e.setPending(s, 0)
	s.pre.prefilled = time.Now()
	s.pre.handed = true
	close(s.pre.done)
}

func (e *Engine) release(s *seq) {
	e.cache.Release(s.keys[:s.held], s.reserved)
	s.held, s.reserved = 0, 0
	e.running.Add(-1)
	e.setPending(s, 0)
}

// setPending sets the prompt tokens s still has to prefill, as counted in
// Load.WaitingPrefillTokens. Step loop, or before s is handed to it.
func (e *Engine) setPending(s *seq, n int) {
	e.waitingPrefill.Add(int64(n - s.pending))
	s.pending = n
}

// schedule plans one step like vLLM's scheduler: running sequences first
// (one decode token each, or their next prefill chunk), then waiting ones
// in arrival order while they fit in Batching.MaxRunning, the cache and the token
// budget. It returns the step's modelled seconds, how many sequences take
// part, and whether none of them prefills.
func (e *Engine) schedule() (seconds float64, batch int, decodeOnly bool) {
	budget := e.cfg.Batching.MaxBatchedTokens
	decodes, decodeCtx := 0, 0
	prefill := 0.0
	for _, s := range e.run {
		s.chunk, s.decode = 0, false
		if budget == 0 {
			continue
		}
		if s.prefilled() {
			s.decode = true
			decodes++
			decodeCtx += s.context()
			budget--
			continue
		}
		s.chunk = min(s.prompt-s.computed, budget)
		budget -= s.chunk
		prefill += e.cost.PrefillSeconds(s.chunk, s.computed)
	}
	admitted, promoted := 0, 0
	for _, s := range e.queue {
		if budget == 0 || len(e.run) >= e.cfg.Batching.MaxRunning {
			break
		}
		h, ok := e.cache.Acquire(s.ns, s.keys, s.blocks-int64(len(s.keys)))
		if !ok {
			break // first come, first served: no overtaking
		}
		hits := h.N
		s.hits, s.held = hits, hits
		if s.pre != nil {
			s.pre.admitted = time.Now()
		}
		s.reserved = s.blocks - int64(hits)
		s.cached = min(hits*BlockTokens, s.prompt-1)
		s.tierTokens(h)
		if hits > 0 && !s.transferred {
			e.touch(s.ns, s.keys[:hits])
		}
		promoted += h.CPU
		s.computed = s.cached
		e.setPending(s, s.prompt-s.computed)
		s.chunk, s.decode = min(s.prompt-s.computed, budget), false
		budget -= s.chunk
		prefill += e.cost.PrefillSeconds(s.chunk, s.computed)
		e.run = append(e.run, s)
		admitted++
	}
	if admitted > 0 {
		clear(e.queue[:admitted])
		e.queue = e.queue[admitted:]
		e.waiting.Add(-int64(admitted))
		e.running.Add(int64(admitted))
	}
	for _, s := range e.run {
		if s.chunk > 0 || s.decode {
			batch++
		}
	}
	if batch == 0 {
		return 0, 0, false
	}
	// Blocks promoted from the CPU tier are copied over PCIe before the
	// step computes (synchronously, as vLLM's swap-in).
	pcie := e.pcieSeconds(promoted)
	if promoted > 0 {
		e.statsMu.Lock()
		e.stats.PromotedBlocks += uint64(promoted)
		e.stats.PCIeSeconds += pcie
		e.statsMu.Unlock()
	}
	return e.cost.DecodeStepSeconds(decodes, decodeCtx) + prefill + pcie + e.loraStepSeconds(), batch, decodes == batch
}

// complete applies the step: prefill chunks enter the cache (full blocks
// are committed and announced), and every sequence that finished its
// prefill or decoded emits a token.
func (e *Engine) complete() {
	e.run = slices.DeleteFunc(e.run, func(s *seq) bool {
		if s.cancelled.Load() {
			e.release(s)
			s.end(context.Canceled)
			return true
		}
		if s.chunk > 0 {
			s.computed += s.chunk
			e.setPending(s, s.prompt-s.computed)
			if full := min(len(s.keys), s.computed/BlockTokens); full > s.held {
				e.cache.Commit(s.ns, s.keys[s.held:full])
				s.reserved -= int64(full - s.held)
				s.held = full
			}
			if !s.prefilled() {
				return false
			}
			if s.pre != nil {
				e.handOver(s)
				return true
			}
		} else if !s.decode {
			return false
		}
		if s.emit() {
			e.release(s)
			return true
		}
		return false
	})
}

// shutdown fails every outstanding sequence and subscription. Step loop,
// on exit.
func (e *Engine) shutdown() {
	e.mu.Lock()
	e.queue = append(e.queue, e.incoming...)
	e.incoming = nil
	e.mu.Unlock()
	for _, s := range e.queue {
		s.end(ErrClosed)
		e.waiting.Add(-1)
		e.setPending(s, 0)
	}
	for _, s := range e.run {
		e.release(s)
		s.end(ErrClosed)
	}
	e.queue, e.run = nil, nil
	e.hub.close(ErrClosed)
}
