// Command indexbench measures the scheduler's KV index (scheduler/kvindex)
// the way NVIDIA Dynamo measures its Flash Indexer: it replays a trace's
// block hashes as the cache events of W engines, plus one match query per
// request, offered at increasing rates, and reports the rate achieved
// against the rate offered, the saturation point, the query latency at
// each rate and the index's memory per block.
//
//	go run ./bench/cmd/indexbench -workers 8,64,256,1000 -blocks 1M,16M
//
// Each request of the trace (or of the synthetic fleet, -source
// synthetic) goes to a worker drawn at random. It makes a match query:
// with -query visit, every worker's match as kv_aware reads it (Visit of
// all W, each worker's load and cost besides its overlap); with -query
// overlaps, the sparse match Dynamo's indexer answers (Overlaps: the
// workers holding the prompt's first block and how much of it). Then,
// with -kind events, the worker's BlockStored
// event for the blocks it lacked and a BlockRemoved event for those its
// cache of blocks/W blocks evicts (its oldest prompts'); with -kind
// learned, the router's Predict of the request on the worker and its
// Finished. Each is one operation. The index is first filled until every
// worker's cache is full; then, for each offered rate, a fresh stretch of
// the stream is generated and replayed on one goroutine, operation i due
// at i/rate (an open loop: an operation due while the previous one runs
// waits, and its query's response time counts the wait).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler/kvindex"
)

type options struct {
	kinds      []string
	query      string
	workers    []int
	blocks     []int
	source     string
	trace      string
	start      float64 // first offered rate, ops/s
	steps      int
	maxOps     int
	minStep    time.Duration
	out        string
	seed       uint64
	procs      int
	keepUpAt   float64
	cpuprofile string
	plotFrom   string
	prof       *os.File // -cpuprofile's, once created
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "indexbench:", err)
		os.Exit(2)
	}
	if err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "indexbench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (options, error) {
	fs := flag.NewFlagSet("indexbench", flag.ContinueOnError)
	kinds := fs.String("kind", "events,learned", "index kinds: events (fed by cache events), learned (fed by Predict)")
	query := fs.String("query", "visit", "match query: visit (every worker's match, as kv_aware reads it) or overlaps (the holders' overlap only)")
	workers := fs.String("workers", "8,64,256,1000", "fleet sizes")
	blocks := fs.String("blocks", "1M,16M", "blocks the fleet's caches hold together (K, M suffixes)")
	src := fs.String("source", "mooncake", "mooncake (the trace, one copy per tenant) or synthetic")
	trace := fs.String("trace", "", "Mooncake trace (default: mooncake_conversation_trace.jsonl in $BATON_TRACES or a shared/traces folder beside the working directory or a parent)")
	start := fs.String("start", "16K", "first offered rate, ops/s; each next step doubles it")
	steps := fs.Int("steps", 8, "offered rates at most per configuration (stops past saturation)")
	maxOps := fs.Int("ops", 1_000_000, "operations per offered rate at most")
	minStep := fs.Duration("min-step", 500*time.Millisecond, "shortest step: fewer operations than -ops when the rate is low")
	out := fs.String("out", "bench/results/index", "folder for results.csv and the plots (empty: none)")
	seed := fs.Uint64("seed", 1, "random seed")
	procs := fs.Int("procs", 1, "GOMAXPROCS (the replay is one goroutine; 1 means one core, the garbage collector included)")
	prof := fs.String("cpuprofile", "", "write a CPU profile of the run from the first replay on (the first fill left out) to this file")
	from := fs.String("plot", "", "plot the results.csv files given (comma-separated) into -out instead of measuring")
	keep := fs.Float64("keep-up", 0.95, "an offered rate is kept up when achieved ≥ this fraction of it")
	if err := fs.Parse(args); err != nil {
		return options{}, err
	}
	o := options{query: *query, plotFrom: *from, cpuprofile: *prof, source: *src, trace: *trace, steps: *steps, maxOps: *maxOps, minStep: *minStep, out: *out, seed: *seed, procs: *procs, keepUpAt: *keep}
	for _, k := range strings.Split(*kinds, ",") {
		if k != "events" && k != "learned" {
			return o, fmt.Errorf("-kind: %q is neither events nor learned", k)
		}
		o.kinds = append(o.kinds, k)
	}
	var err error
	if o.workers, err = counts(*workers); err != nil {
		return o, fmt.Errorf("-workers: %v", err)
	}
	if o.blocks, err = counts(*blocks); err != nil {
		return o, fmt.Errorf("-blocks: %v", err)
	}
	r, err := counts(*start)
	if err != nil || len(r) != 1 {
		return o, fmt.Errorf("-start: want one rate, got %q", *start)
	}
	o.start = float64(r[0])
	switch {
	case o.query != "visit" && o.query != "overlaps":
		return o, fmt.Errorf("-query: %q is neither visit nor overlaps", o.query)
	case o.source != "mooncake" && o.source != "synthetic":
		return o, fmt.Errorf("-source: %q is neither mooncake nor synthetic", o.source)
	case o.steps < 1:
		return o, fmt.Errorf("-steps: %d is below 1", o.steps)
	case o.maxOps < 1000:
		return o, fmt.Errorf("-ops: %d is below 1000", o.maxOps)
	case o.procs < 1:
		return o, fmt.Errorf("-procs: %d is below 1", o.procs)
	case o.keepUpAt <= 0 || o.keepUpAt > 1:
		return o, fmt.Errorf("-keep-up: %v is not in (0, 1]", o.keepUpAt)
	}
	return o, nil
}

// counts parses a comma-separated list of positive counts with optional
// K (×1,000) or M (×1,048,576 for blocks, as memory is counted; ×10⁶ is
// not needed apart) suffixes: 1M is 2²⁰.
func counts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mul := 1
		switch {
		case strings.HasSuffix(f, "K"):
			mul, f = 1000, strings.TrimSuffix(f, "K")
		case strings.HasSuffix(f, "M"):
			mul, f = 1<<20, strings.TrimSuffix(f, "M")
		}
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive count", f)
		}
		out = append(out, int(v*float64(mul)))
	}
	return out, nil
}

// tracesDir finds the shared traces as baton bench does.
func tracesDir() string {
	if d := os.Getenv("BATON_TRACES"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		return "."
	}
	for {
		d := filepath.Join(dir, "shared", "traces")
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			return d
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return filepath.Join("..", "shared", "traces")
		}
		dir = parent
	}
}

func run(w io.Writer, o options) error {
	if o.plotFrom != "" {
		var all []result
		for _, f := range strings.Split(o.plotFrom, ",") {
			rs, err := readCSV(f)
			if err != nil {
				return err
			}
			all = append(all, rs...)
		}
		files, err := plots(o.out, all)
		fmt.Fprintf(w, "wrote %s\n", strings.Join(files, ", "))
		return err
	}
	runtime.GOMAXPROCS(o.procs)
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		o.prof = f // started by the first replay (see measure)
		defer pprof.StopCPUProfile()
	}
	var recs []workload.MooncakeRecord
	if o.source == "mooncake" {
		path := o.trace
		if path == "" {
			path = filepath.Join(tracesDir(), "mooncake_conversation_trace.jsonl")
		}
		var err error
		if recs, err = workload.LoadTrace(path, 0, workload.ParseMooncake); err != nil {
			return err
		}
	}
	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Fprintf(w, "indexbench: source %s, query %s, GOMAXPROCS %d, %s, load average %s\n",
		o.source, o.query, o.procs, runtime.Version(), strings.Join(strings.Fields(string(load))[:min(3, len(strings.Fields(string(load))))], " "))
	fmt.Fprintf(w, "%-7s %5s %6s %9s %9s %8s %8s %9s | %9s %9s %6s %8s %8s %8s %9s %11s\n",
		"kind", "W", "blocks", "indexed", "entries", "B/entry", "B/block", "heap MiB",
		"offered", "achieved", "kept", "q p50µs", "q p99µs", "r p99µs", "per core", "blocks/core")
	var all []result
	for _, kind := range o.kinds {
		for _, b := range o.blocks {
			for _, nw := range o.workers {
				var src source
				if o.source == "mooncake" {
					per := newMooncake(recs, 1).distinct()
					src = newMooncake(recs, max(1, (2*b+per-1)/per))
				} else {
					src = newSynthetic(o.seed)
				}
				res, err := measure(w, o, kind, nw, b, src)
				if err != nil {
					return err
				}
				all = append(all, res)
			}
		}
	}
	if o.out == "" {
		return nil
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	if err := writeCSV(filepath.Join(o.out, "results.csv"), all); err != nil {
		return err
	}
	files, err := plots(o.out, all)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "wrote %s\n", strings.Join(append([]string{filepath.Join(o.out, "results.csv")}, files...), ", "))
	return nil
}

// result is one configuration's figures.
type result struct {
	kind            string
	workers, target int
	indexedWorkers  int
	blocks, entries int // blocks indexed (Len), (block, worker) entries held by the engines
	heap            uint64
	steps           []step
	saturation      float64 // the highest rate achieved
	perCore         float64 // past saturation, ops per CPU second
	blockPerCore    float64 // and block operations per CPU second
	// What the steps replayed: queries and writes (events, or Predict and
	// Finished), and their keys.
	queries, writes      int
	queryKeys, writeKeys int
}

type step struct {
	offered, achieved float64
	perCore           float64 // ops per second of the process's CPU time
	// blockPerCore counts block operations instead, as Dynamo's indexer
	// benchmark does: a query's keys, a stored or removed event's keys
	// (a learned-index write's keys too).
	blockPerCore  float64
	keptUp        bool
	q50, q99, r99 time.Duration // query service time p50/p99, response time p99
}

// op kinds.
const (
	opQuery uint8 = iota
	opStored
	opRemoved
	opPredict
	opFinished
)

type op struct {
	kind   uint8
	w      int32
	off, n int32
	seq    uint64
}

// bench is one configuration being measured.
type bench struct {
	kind    string
	x       *kvindex.Index
	names   []string
	indexed []bool
	engines []*engine // events kind
	src     source
	rng     uint64
	cap     int

	ops      []op
	keys     []uint64
	buf      []uint64
	st       []uint64
	rm       []uint64
	overlaps bool // the query is Overlaps, not Visit
	sink     sink
	out      []kvindex.Overlap
}

// sink reads what a router would of each match.
type sink struct{ gpu int }

func (s *sink) VisitMatch(_ int, m *kvindex.Match) { s.gpu = max(s.gpu, m.GPU+m.CPU) }

func (b *bench) rand(n int) int {
	b.rng = b.rng*6364136223846793005 + 1442695040888963407
	return int((b.rng >> 33) % uint64(n))
}

// gen appends the operations of the next request to b.ops; with queries
// false (the fill), it leaves out the query.
func (b *bench) gen(queries bool) {
	b.buf = b.src.next(b.buf[:0])
	w := b.rand(len(b.names))
	add := func(kind uint8, keys []uint64, seq uint64) {
		b.ops = append(b.ops, op{kind: kind, w: int32(w), off: int32(len(b.keys)), n: int32(len(keys)), seq: seq})
		b.keys = append(b.keys, keys...)
	}
	if queries {
		add(opQuery, b.buf, 0)
	}
	if !b.indexed[w] {
		return
	}
	if b.kind == "learned" {
		add(opPredict, b.buf, 0)
		add(opFinished, b.buf, 0)
		return
	}
	e := b.engines[w]
	b.st, b.rm = e.serve(b.buf, b.st[:0], b.rm[:0])
	if len(b.st) > 0 {
		e.seq++
		add(opStored, b.st, e.seq)
	}
	if len(b.rm) > 0 {
		e.seq++
		add(opRemoved, b.rm, e.seq)
	}
}

// exec runs op i; for a query it returns its service time.
func (b *bench) exec(ce *kvindex.CacheEvent, o *op) error {
	keys := b.keys[o.off : o.off+o.n]
	name := b.names[o.w]
	switch o.kind {
	case opQuery:
		if b.overlaps {
			b.out = b.x.Overlaps(keys, b.out[:0])
		} else {
			b.x.Visit(keys, b.names, &b.sink)
		}
	case opStored, opRemoved:
		ce.Kind = kvindex.Stored
		if o.kind == opRemoved {
			ce.Kind = kvindex.Removed
		}
		ce.Keys = keys
		if err := b.x.Apply(name, kvindex.Event{Seq: o.seq, Cache: ce}); err != nil {
			return err
		}
	case opPredict:
		b.x.Predict(name, keys)
	case opFinished:
		b.x.Finished(name, keys, kvindex.Usage{})
	}
	return nil
}

func measure(w io.Writer, o options, kind string, nw, target int, src source) (result, error) {
	res := result{kind: kind, workers: nw, target: target}
	b := &bench{kind: kind, src: src, rng: o.seed, cap: max(1, target/nw), overlaps: o.query == "overlaps"}
	b.x = kvindex.New(kvindex.Config{MaxBlocks: 2 * target})
	for i := range nw {
		name := fmt.Sprintf("w%04d", i)
		b.names = append(b.names, name)
		var err error
		if kind == "learned" {
			err = b.x.Learn(name, kvindex.Capacity{Blocks: int64(b.cap)})
		} else {
			err = b.x.Apply(name, kvindex.Event{Seq: 1, Snapshot: &kvindex.Snapshot{}})
			b.engines = append(b.engines, newEngine(b.cap))
		}
		switch {
		case err == nil:
			b.indexed = append(b.indexed, true)
			res.indexedWorkers++
		case errors.Is(err, kvindex.ErrTooManyWorkers):
			b.indexed = append(b.indexed, false)
		default:
			return res, err
		}
	}
	var ce kvindex.CacheEvent
	// The fill: writes only, until the engines' caches are full (events)
	// or as many keys as they hold, twice over, were predicted (learned).
	full := res.indexedWorkers * b.cap
	var predicted int
	for done := false; !done; {
		b.ops, b.keys = b.ops[:0], b.keys[:0]
		for len(b.ops) < 65536 {
			b.gen(false)
		}
		for i := range b.ops {
			if err := b.exec(&ce, &b.ops[i]); err != nil {
				return res, err
			}
			if b.ops[i].kind == opPredict {
				predicted += int(b.ops[i].n)
			}
		}
		if kind == "learned" {
			done = predicted >= 2*full
		} else {
			done = true
			for i, e := range b.engines {
				done = done && (e.full || !b.indexed[i])
			}
		}
	}
	if o.prof != nil {
		// Past the first fill: the profile is the replays' (and the
		// further configurations' fills); a profile under way stays.
		_ = pprof.StartCPUProfile(o.prof)
	}
	rate := o.start
	for range o.steps {
		s, err := b.step(&ce, rate, o)
		if err != nil {
			return res, err
		}
		for _, op := range b.ops {
			if op.kind == opQuery {
				res.queries++
				res.queryKeys += int(op.n)
			} else {
				res.writes++
				res.writeKeys += int(op.n)
			}
		}
		res.steps = append(res.steps, s)
		res.saturation = max(res.saturation, s.achieved)
		res.perCore = max(res.perCore, s.perCore)
		res.blockPerCore = max(res.blockPerCore, s.blockPerCore)
		if !s.keptUp {
			break
		}
		rate *= 2
	}
	res.blocks = b.x.Len()
	if kind == "events" {
		for i, e := range b.engines {
			if b.indexed[i] {
				res.entries += len(e.refs)
			}
		}
	}
	// The index's heap: what the garbage collector frees once it is gone.
	b.ops, b.keys = nil, nil
	x := b.x
	runtime.GC()
	var with, without runtime.MemStats
	runtime.ReadMemStats(&with)
	runtime.KeepAlive(x)
	b.x = nil
	runtime.GC()
	runtime.ReadMemStats(&without)
	runtime.KeepAlive(b)
	res.heap = with.HeapAlloc - min(with.HeapAlloc, without.HeapAlloc)
	report(w, &res)
	debug.FreeOSMemory()
	return res, nil
}

// step replays a fresh stretch of the stream offered at rate ops/s.
func (b *bench) step(ce *kvindex.CacheEvent, rate float64, o options) (step, error) {
	n := min(o.maxOps, max(1000, int(rate*o.minStep.Seconds())))
	b.ops, b.keys = b.ops[:0], b.keys[:0]
	for len(b.ops) < n {
		b.gen(true)
	}
	lat := make([]time.Duration, 0, n/2)
	resp := make([]time.Duration, 0, n/2)
	runtime.GC()
	interval := float64(time.Second) / rate
	cpu0 := cpuTime()
	start := time.Now()
	for i := range b.ops {
		op := &b.ops[i]
		due := start.Add(time.Duration(float64(i) * interval))
		if i%16 == 0 {
			if d := time.Until(due); d > 200*time.Microsecond {
				time.Sleep(d - 100*time.Microsecond)
			} else {
				for time.Now().Before(due) {
				}
			}
		}
		if op.kind != opQuery {
			if err := b.exec(ce, op); err != nil {
				return step{}, err
			}
			continue
		}
		t0 := time.Now()
		b.exec(ce, op)
		t1 := time.Now()
		lat = append(lat, t1.Sub(t0))
		resp = append(resp, max(t1.Sub(due), t1.Sub(t0)))
	}
	elapsed := time.Since(start)
	s := step{offered: rate, achieved: float64(len(b.ops)) / elapsed.Seconds()}
	if busy := cpuTime() - cpu0; busy > 0 && !s.keptUpAt(o.keepUpAt) {
		s.perCore = float64(len(b.ops)) / busy.Seconds()
		keys := 0
		for i := range b.ops {
			keys += int(b.ops[i].n)
		}
		s.blockPerCore = float64(keys) / busy.Seconds()
	}
	s.keptUp = s.keptUpAt(o.keepUpAt)
	slices.Sort(lat)
	slices.Sort(resp)
	s.q50, s.q99, s.r99 = pct(lat, 0.5), pct(lat, 0.99), pct(resp, 0.99)
	return s, nil
}

func (s step) keptUpAt(f float64) bool { return s.achieved >= f*s.offered }

// cpuTime returns the CPU time the process has used. With GOMAXPROCS 1 the
// replay and the garbage collector share one core, and past saturation
// ops per CPU second is what one core sustains, however many cores the
// machine's other processes leave it.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func pct(xs []time.Duration, p float64) time.Duration {
	if len(xs) == 0 {
		return 0
	}
	return xs[min(len(xs)-1, int(p*float64(len(xs))))]
}

func report(w io.Writer, r *result) {
	perEntry, perBlock := "—", "—"
	if r.entries > 0 {
		perEntry = fmt.Sprintf("%.1f", float64(r.heap)/float64(r.entries))
	}
	if r.blocks > 0 {
		perBlock = fmt.Sprintf("%.1f", float64(r.heap)/float64(r.blocks))
	}
	entries := "—"
	if r.kind == "events" {
		entries = si(float64(r.entries))
	}
	for i, s := range r.steps {
		head := fmt.Sprintf("%-7s %5d %6s %9s %9s %8s %8s %9.0f", r.kind, r.workers, si(float64(r.target)),
			fmt.Sprintf("%s/%d", si(float64(r.blocks)), r.indexedWorkers), entries, perEntry, perBlock, float64(r.heap)/(1<<20))
		if i > 0 {
			head = strings.Repeat(" ", len(head))
		}
		kept := "yes"
		if !s.keptUp {
			kept = "no"
		}
		perCore, blockPerCore := "", ""
		if s.perCore > 0 {
			perCore, blockPerCore = si(s.perCore), si(s.blockPerCore)
		}
		fmt.Fprintf(w, "%s | %9s %9s %6s %8.1f %8.1f %8.1f %9s %11s\n", head, si(s.offered), si(s.achieved), kept,
			us(s.q50), us(s.q99), us(s.r99), perCore, blockPerCore)
	}
	fmt.Fprintf(w, "%-7s %5d %6s saturation %s ops/s (%s per CPU second, %s block operations); ops: %.0f%% queries of %.1f keys, writes of %.1f keys\n",
		r.kind, r.workers, si(float64(r.target)), si(r.saturation), si(r.perCore), si(r.blockPerCore),
		100*float64(r.queries)/float64(max(1, r.queries+r.writes)), float64(r.queryKeys)/float64(max(1, r.queries)),
		float64(r.writeKeys)/float64(max(1, r.writes)))
}

func us(d time.Duration) float64 { return float64(d) / 1e3 }

// si writes n with a K or M suffix (M: 10⁶, but for block counts that are
// powers of two, which read as Mi).
func si(n float64) string {
	switch {
	case n >= 1<<20 && int(n)%(1<<20) == 0:
		return fmt.Sprintf("%dM", int(n)>>20)
	case n >= 1e6:
		return fmt.Sprintf("%.2fM", n/1e6)
	case n >= 1e3:
		return fmt.Sprintf("%.0fK", n/1e3)
	}
	return fmt.Sprintf("%.0f", n)
}

func writeCSV(path string, all []result) error {
	var sb strings.Builder
	sb.WriteString("kind,workers,target_blocks,indexed_workers,blocks,entries,heap_bytes,offered,achieved,kept_up,query_p50_us,query_p99_us,response_p99_us,per_core,block_per_core\n")
	for _, r := range all {
		for _, s := range r.steps {
			fmt.Fprintf(&sb, "%s,%d,%d,%d,%d,%d,%d,%.0f,%.0f,%t,%.2f,%.2f,%.2f,%.0f,%.0f\n", r.kind, r.workers, r.target,
				r.indexedWorkers, r.blocks, r.entries, r.heap, s.offered, s.achieved, s.keptUp, us(s.q50), us(s.q99), us(s.r99), s.perCore, s.blockPerCore)
		}
	}
	return os.WriteFile(path, []byte(sb.String()), 0o644)
}

// readCSV reads back what writeCSV wrote (files written before the
// block_per_core column too).
func readCSV(path string) ([]result, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var all []result
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n")[1:] {
		f := strings.Split(line, ",")
		if len(f) != 14 && len(f) != 15 {
			return nil, fmt.Errorf("%s line %d: %d fields, want 15", path, i+2, len(f))
		}
		n := make([]float64, len(f))
		for j, v := range f {
			if j == 0 || j == 9 {
				continue
			}
			if n[j], err = strconv.ParseFloat(v, 64); err != nil {
				return nil, fmt.Errorf("%s line %d: %v", path, i+2, err)
			}
		}
		s := step{offered: n[7], achieved: n[8], keptUp: f[9] == "true", perCore: n[13],
			q50: time.Duration(n[10] * 1e3), q99: time.Duration(n[11] * 1e3), r99: time.Duration(n[12] * 1e3)}
		if len(n) == 15 {
			s.blockPerCore = n[14]
		}
		if k := len(all) - 1; k >= 0 && all[k].kind == f[0] && all[k].workers == int(n[1]) && all[k].target == int(n[2]) {
			all[k].steps = append(all[k].steps, s)
			continue
		}
		all = append(all, result{kind: f[0], workers: int(n[1]), target: int(n[2]), indexedWorkers: int(n[3]),
			blocks: int(n[4]), entries: int(n[5]), heap: uint64(n[6]), steps: []step{s}})
	}
	return all, nil
}
