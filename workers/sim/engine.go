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
	statsMu          sync.Mutex
	stats            Stats

	lora *loraSlots

	// Step loop only, but for the batch's WaitingPrefill.
	batch    *Batch[*seq]
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
	e.batch = NewBatch(cfg.Batching, cm, e.cache, e.pcieSeconds, Hooks[*seq]{
		Admitted: e.admitted, Drop: e.dropped, Prefilled: e.handOver, Token: e.token})
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
		WaitingPrefillTokens: e.batch.WaitingPrefill(),
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
		Seq: Seq{
			NS:     transfer.Namespace{Model: req.Model, Salt: salt},
			Keys:   blockkey.Append(nil, salt, req.Prompt, blockkey.DefaultBlockChars),
			Prompt: blockkey.Tokens(blockkey.Chars(req.Prompt)),
		},
		id:    req.ID,
		limit: req.MaxTokens,
		hash:  promptHash(req.Prompt),
		wake:  e.wake,
	}
	if isAdapter {
		s.adapter = req.Model
	}
	if prefillOnly {
		s.pre = &prefillJob{done: make(chan struct{})}
		s.PrefillOnly = true
		s.Blocks = int64((s.Prompt + BlockTokens - 1) / BlockTokens)
		if s.Blocks > e.cache.Capacity() {
			return nil, fmt.Errorf("%d prompt tokens need %d blocks, capacity %d: %w",
				s.Prompt, s.Blocks, e.cache.Capacity(), ErrInvalid)
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
	s.Blocks = int64((s.Prompt + gen + BlockTokens - 1) / BlockTokens)
	if s.Blocks > e.cache.Capacity() {
		return nil, fmt.Errorf("%d prompt and %d completion tokens need %d blocks, capacity %d: %w",
			s.Prompt, gen, s.Blocks, e.cache.Capacity(), ErrInvalid)
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
	e.batch.SetPending(s, s.Prompt)
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
		e.batch.Queue = append(e.batch.Queue, e.incoming...)
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
	e.batch.Queue = slices.DeleteFunc(e.batch.Queue, func(s *seq) bool {
		if s.cancelled.Load() {
			e.waiting.Add(-1)
			e.batch.SetPending(s, 0)
			s.end(context.Canceled)
			return true
		}
		return false
	})
	e.batch.Run = slices.DeleteFunc(e.batch.Run, e.dropped)
}

// dropped releases and ends s if it was cancelled, and reports whether it
// was. Step loop only.
func (e *Engine) dropped(s *seq) bool {
	if !s.cancelled.Load() {
		return false
	}
	e.release(s)
	s.end(context.Canceled)
	return true
}

// handOver ends a prefill-only sequence whose prompt is computed, out of
// the batch with its partial block freed: it hands its full blocks, still
// referenced, to its Prefill call, which releases them after the push.
// Step loop only.
func (e *Engine) handOver(s *seq) {
	e.running.Add(-1)
	s.pre.prefilled = time.Now()
	s.pre.handed = true
	close(s.pre.done)
}

// release frees s's blocks as it leaves the batch. Step loop only.
func (e *Engine) release(s *seq) {
	e.batch.Release(s)
	e.running.Add(-1)
}

// schedule plans one step (Batch.Schedule) and adds the LoRA adapters'
// cost. It returns the step's modelled seconds, how many sequences take
// part, and whether none of them prefills.
func (e *Engine) schedule() (seconds float64, batch int, decodeOnly bool) {
	st := e.batch.Schedule()
	if st.Batch == 0 {
		return 0, 0, false
	}
	if st.Promoted > 0 {
		e.statsMu.Lock()
		e.stats.PromotedBlocks += uint64(st.Promoted)
		e.stats.PCIeSeconds += st.PCIeSeconds
		e.statsMu.Unlock()
	}
	return st.Seconds + e.loraStepSeconds(), st.Batch, st.Decodes == st.Batch
}

// admitted is s's admission to the batch: its cached tokens by tier, the
// use of its reused prefix, the load counters. Step loop only.
func (e *Engine) admitted(s *seq, h Hits) {
	if s.pre != nil {
		s.pre.admitted = time.Now()
	}
	s.tierTokens(h)
	if h.N > 0 && !s.transferred {
		e.touch(s.NS, s.Keys[:h.N])
	}
	e.waiting.Add(-1)
	e.running.Add(1)
}

// token emits s's latest token and, when that ends s, releases it. Step
// loop only.
func (e *Engine) token(s *seq) (done bool) {
	if s.emit() {
		e.release(s)
		return true
	}
	return false
}

// complete applies the step (Batch.Complete): prefill chunks enter the
// cache, and every sequence that finished its prefill or decoded emits a
// token; cancelled sequences are dropped first.
func (e *Engine) complete() { e.batch.Complete() }

// shutdown fails every outstanding sequence and subscription. Step loop,
// on exit.
func (e *Engine) shutdown() {
	e.mu.Lock()
	e.batch.Queue = append(e.batch.Queue, e.incoming...)
	e.incoming = nil
	e.mu.Unlock()
	for _, s := range e.batch.Queue {
		s.end(ErrClosed)
		e.waiting.Add(-1)
		e.batch.SetPending(s, 0)
	}
	for _, s := range e.batch.Run {
		e.release(s)
		s.end(ErrClosed)
	}
	e.batch.Queue, e.batch.Run = nil, nil
	e.hub.close(ErrClosed)
}
