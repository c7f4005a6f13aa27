package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/bench"
	"github.com/batonllm/baton/bench/vsim"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/routing"
)

// benchCmd runs baton bench: one workload replayed against each strategy.
func benchCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("bench", "[flags]\n\nReplays one workload against each routing strategy, side by side.")
	wl := fs.String("workload", "long-context", "workload: "+strings.Join(workload.Names, ", "))
	n := fs.Int("requests", 0, "requests to send (default: 1200 for synthetic workloads, 1000 trace records)")
	strategiesFlag := fs.String("strategies", "random,least_outstanding,prefix_aware,kv_aware", "comma-separated strategies, each run on the identical request sequence")
	workers := fs.Int("workers", 7, "simulated workers per fleet (with -target: the fleet size for the ideal share)")
	target := fs.String("target", "", "base `URL` of a running baton to bench instead of an in-process fleet, or the comma-separated URLs of its replicas (request i to the i-th mod their number)")
	rate := fs.Float64("rate", 0, "Poisson arrival rate, modelled requests/s (default: calibrated to -load for synthetic workloads; the trace's timestamps for traces)")
	load := fs.Float64("load", 0.7, "target utilization the default rate is calibrated to (synthetic workloads)")
	maxLoRAs := fs.Int("max-loras", 0, "LoRA adapter slots of each simulated worker, for workloads naming adapters (default 4)")
	speedup := fs.Float64("speedup", 1, "time compression: arrivals and the simulated engines' clock (TimeScale) run this many times faster")
	conc := fs.Int("concurrency", 0, "cap on requests in flight (0: open loop)")
	seed := fs.Uint64("seed", 1, "seed of the workload, the arrivals and the in-process scheduler's random choices")
	out := fs.String("out", "bench/out", "`directory` for report.md, report.json, summary.csv and the PNG plots")
	trace := fs.String("trace", "", "trace file (default: mooncake_conversation_trace.jsonl or azure2023_conv.csv in $BATON_TRACES or a shared/traces folder beside the working directory or a parent)")
	docs := fs.Int("docs", 200, "long-context: shared documents")
	pop := fs.String("popularity", "uniform", "long-context: document popularity, uniform or zipf")
	convs := fs.Int("conversations", 32, "sharegpt: conversations open at once (each request continues a random one)")
	model := fs.String("model", "llama-3.1-8b", "model preset of the simulated workers (and the model requested)")
	gpu := fs.String("gpu", "h100", "GPU preset of the simulated workers")
	cpuBlocks := fs.Int64("cpu-blocks", 0, "CPU KV tier of each simulated worker in blocks (0: none, as in SageMaker's study; -1: the simulator's default host-memory tier)")
	kvBlocks := fs.Int64("kv-blocks", 0, "KV capacity of each simulated worker in 16-token blocks (default: from GPU memory)")
	threshold := fs.Int("concurrency-threshold", 0, "prefix_aware spill threshold (default 16)")
	prefixLen := fs.Int("prefix-length", 0, "characters prefix_aware hashes (default 4096)")
	fleetsFlag := fs.String("fleets", "colocated", "comma-separated in-process fleets each strategy runs on, one column each: colocated (--workers role-both workers; columns labelled by the strategy), colocated:N (columns strategy/colocated:N), disagg:P:D (P prefill + D decode workers; columns strategy/disagg:P:D)")
	sharedTier := fs.Bool("shared-tier", false, "the workers of each in-process fleet share a fresh in-process KV tier (kvstore.NewMemory), the path kv_aware fetches prefixes from Redis by (off: GPU caches only, as in SageMaker's study)")
	sharedTierBytes := fs.Int64("shared-tier-bytes", 0, "capacity of the --shared-tier store in bytes of the simulator's scaled blocks (default 1 GiB)")
	shareRedis := fs.String("share-redis", "", "Redis `host:port` the in-process replicas of --replicas share what they learn through (replicas.redis), each fleet on a stream of its own; empty: each replica learns alone")
	replicasFlag := fs.String("replicas", "1", "comma-separated numbers of scheduler replicas each strategy runs with on each in-process fleet, one column each (e.g. 1,2,4): N schedulers configured alike in front of the same workers, request i sent to replica i mod N")
	sharePeers := fs.Bool("share-peers", false, "the in-process replicas of --replicas also send their decisions straight to each other (replicas.peers), each on a loopback port of its own; alone, or beside --share-redis")
	replicasFirst := fs.Bool("replicas-first", false, "send every request to the first of the --replicas (or the first --target URL): the others run beside it, following the engines and sharing, and decide nothing; a control for what N schedulers cost the machine apart from splitting the decisions")
	shareLag := fs.Duration("share-lag", 0, "with --virtual and --replicas: the modelled time from one replica's decision to its application on the others (what --share-redis's stream takes); negative: the replicas share nothing")
	shareLate := fs.Float64("share-late", 1, "with --virtual and --share-lag: the part of the replicas' decisions, drawn at random, whose sharing takes --share-lag; the rest reach the others at once (in real time, what baton_replica_sync_unseen_seconds counts of the decisions received), 0–1")
	shareCorrections := fs.Bool("share-corrections", false, "with --virtual and --replicas: the replicas also share each request's time to first token beside its estimate, so that they correct their estimates alike (baton serve's replicas do not)")
	quiet := fs.Bool("quiet", false, "no progress lines on stderr")
	virtual := fs.Bool("virtual", false, "replay on the virtual clock (bench/vsim: the scheduler's routing and the simulated engines' scheduling, no gRPC, no wall clock) instead of in-process fleets: the same report in seconds, without the network's milliseconds; --speedup and --concurrency do not apply")
	dispatch := fs.String("dispatch", "", "with --virtual: `median,p90[,per-token[,spacing]]` of the modelled time from a request's arrival to its engine's queue (HTTP, hashing, gRPC, parsing, and the CPU they wait for), e.g. 5.1ms,16.4ms,77ns,0.51ms: simultaneous arrivals taken up spacing apart in a random order, per-token for each prompt token before the pick, then a log-normal draw per request (default: none)")
	perRequest := fs.Bool("per-request", false, "also write requests.jsonl to --out: each request's column, worker, X-Baton-Route (kv_aware's predicted hit), prompt and cached tokens, TTFT, end-to-end time and error, in modelled seconds for --virtual and wall seconds otherwise")
	limitsOnly := fs.Bool("limits-only", false, "print the request sequence's hit-rate bounds (infinite cache, Belady's MIN over the fleet's capacity) and pooled-LRU reference, and run nothing")
	memProfile := fs.String("memprofile", "", "write a heap profile (what the run holds at its end, and what it allocated) to `file`, for go tool pprof")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run (scheduler and in-process fleet) to `file`, for go tool pprof")
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	// Options read 0 as "the default": a flag given as 0 asks for
	// something else, and is refused. The workload's flags are checked
	// here, the rest by Options.Validate.
	set := setFlags(fs)
	switch {
	case *speedup == 0:
		return fmt.Errorf("--speedup: must be positive, got %v", *speedup)
	case *n < 0 || set["requests"] && *n == 0:
		return fmt.Errorf("--requests: must be at least 1, got %d", *n)
	case set["rate"] && *rate == 0:
		return fmt.Errorf("--rate: must be positive, got %v", *rate)
	case !(*load > 0):
		return fmt.Errorf("--load: must be positive, got %v", *load)
	case *docs < 1:
		return fmt.Errorf("--docs: must be at least 1, got %d", *docs)
	case *convs < 1:
		return fmt.Errorf("--conversations: must be at least 1, got %d", *convs)
	case set["kv-blocks"] && *kvBlocks == 0:
		return fmt.Errorf("--kv-blocks: must be at least 1, got %d", *kvBlocks)
	case set["shared-tier-bytes"] && *sharedTierBytes == 0:
		return fmt.Errorf("--shared-tier-bytes: must be positive, got %d", *sharedTierBytes)
	case set["concurrency-threshold"] && *threshold == 0:
		return fmt.Errorf("--concurrency-threshold: must be %d–%d, got %d", routing.MinConcurrencyThreshold, routing.MaxConcurrencyThreshold, *threshold)
	case set["prefix-length"] && *prefixLen == 0:
		return fmt.Errorf("--prefix-length: must be %d–%d, got %d", frontend.MinPrefixLength, frontend.MaxPrefixLength, *prefixLen)
	}
	var strats []string
	for _, s := range strings.Split(*strategiesFlag, ",") {
		if s = strings.TrimSpace(s); s != "" {
			strats = append(strats, s)
		}
	}
	fleets, err := bench.ParseFleets(*fleetsFlag, *workers)
	if err != nil {
		return fmt.Errorf("--fleets: %w", err)
	}
	var replicas []int
	for _, v := range strings.Split(*replicasFlag, ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("--replicas: %q is not a number of replicas", v)
		}
		replicas = append(replicas, n)
	}
	o := bench.Options{Strategies: strats, Replicas: replicas, Target: *target, Workers: *workers, Model: *model, GPU: *gpu,
		KVBlocks: *kvBlocks, CPUBlocks: *cpuBlocks, ConcurrencyThreshold: *threshold, PrefixLength: *prefixLen,
		Speedup: *speedup, Rate: *rate, Concurrency: *conc, Seed: *seed, Fleets: fleets,
		SharedTier: *sharedTier, SharedTierBytes: *sharedTierBytes, MaxLoRAs: *maxLoRAs, ShareRedis: *shareRedis, SharePeers: *sharePeers, ReplicasFirst: *replicasFirst, Virtual: *virtual}
	if err := o.Validate(); err != nil {
		return err
	}
	w, err := buildWorkload(*wl, *n, *seed, *trace, *docs, *pop, *convs)
	if err != nil {
		return err
	}
	// The hit-rate bounds (an infinite cache; Belady's MIN over the
	// fleet's capacity) and the pooled-LRU reference.
	capacity, err := bench.FleetBlocks(o, fleets)
	if err != nil {
		return err
	}
	if *limitsOnly {
		limits := bench.ComputeLimits(w, *model, capacity)
		fmt.Fprintln(stdout, limits.Sentence())
		return nil
	}
	if !*quiet {
		o.Progress = stderr
	}
	if *virtual && (*target != "" || *conc != 0 || *sharedTier || *shareRedis != "" || *sharePeers || *replicasFirst) {
		return errors.New("--virtual: simulates in-process fleets in open loop without a shared tier, its replicas sharing as --share-lag says; drop --target, --concurrency, --shared-tier, --share-redis, --share-peers and --replicas-first")
	}
	if (*shareLag != 0 || *shareCorrections || set["share-late"]) && !*virtual {
		return errors.New("--share-lag, --share-late, --share-corrections: model the replicas' sharing on the virtual clock; add --virtual (in real time, --share-redis)")
	}
	if !(*shareLate > 0 && *shareLate <= 1) {
		return fmt.Errorf("--share-late: a part of the decisions, more than 0 and at most 1, got %v", *shareLate)
	}
	var disp vsim.Dispatch
	if *dispatch != "" {
		if !*virtual {
			return errors.New("--dispatch: models the real path's delays on the virtual clock; add --virtual")
		}
		if disp, err = parseDispatch(*dispatch); err != nil {
			return fmt.Errorf("--dispatch: %w", err)
		}
	}
	var calib string
	if o.Rate == 0 && !w.Timed {
		c, err := bench.Calibrate(w, *model, *gpu, *workers, *load, 0, *kvBlocks)
		if err != nil {
			return err
		}
		o.Rate = c.Rate
		calib = c.String()
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	// The virtual clock does not slow down when the bounds take the
	// other core meanwhile; a fleet on the wall clock would.
	limitsDone := make(chan bench.Limits, 1)
	computeLimits := func() { limitsDone <- bench.ComputeLimits(w, *model, capacity) }
	if *virtual {
		go computeLimits()
	} else {
		computeLimits()
	}
	var rep *bench.Report
	if *virtual {
		rep, err = virtualBench(ctx, o, w, disp, vsimShare{lag: *shareLag, late: *shareLate, corrections: *shareCorrections})
	} else {
		rep, err = bench.Run(ctx, o, w)
	}
	if err != nil {
		return err
	}
	if *memProfile != "" {
		if err := writeHeapProfile(*memProfile); err != nil {
			return fmt.Errorf("--memprofile: %w", err)
		}
	}
	rep.Command = "baton bench " + strings.Join(args, " ")
	rep.Calibration = calib
	limits := <-limitsDone
	rep.Limits = &limits
	rep.PerRequest = *perRequest
	rep.Markdown(stdout)
	files, err := rep.WriteFiles(*out)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "baton bench: wrote %s\n", strings.Join(files, ", "))
	return nil
}

// tracesDir finds the shared traces: $BATON_TRACES, else a shared/traces
// folder beside the working directory or one of its parents (the project
// keeps its traces in ../shared/traces).
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

func buildWorkload(name string, n int, seed uint64, trace string, docs int, pop string, convs int) (*workload.Workload, error) {
	synthetic := n
	if synthetic == 0 {
		synthetic = 1200
	}
	records := n
	if records == 0 {
		records = 1000
	}
	switch name {
	case "long-context":
		cfg := workload.DefaultLongContext(docs)
		cfg.Popularity = pop
		return workload.LongContext(cfg, synthetic, seed)
	case "sharegpt":
		return workload.ShareGPT(workload.ShareGPTConfig{Active: convs}, synthetic, seed)
	case "agentic":
		return workload.Agentic(workload.AgenticConfig{}, synthetic, seed)
	case "lora":
		return workload.LoRA(workload.LoRAConfig{}, synthetic, seed)
	case "mooncake":
		// A trace given by --trace is named in the report; the default
		// one is the Mooncake conversation trace.
		if trace != "" {
			recs, err := workload.LoadTrace(trace, records, workload.ParseMooncake)
			if err != nil {
				return nil, err
			}
			return workload.MooncakeFile(recs, seed, filepath.Base(trace)), nil
		}
		recs, err := workload.LoadTrace(filepath.Join(tracesDir(), "mooncake_conversation_trace.jsonl"), records, workload.ParseMooncake)
		if err != nil {
			return nil, err
		}
		return workload.Mooncake(recs, seed), nil
	case "azure":
		if trace != "" {
			recs, err := workload.LoadTrace(trace, records, workload.ParseAzure)
			if err != nil {
				return nil, err
			}
			return workload.AzureFile(recs, seed, filepath.Base(trace)), nil
		}
		recs, err := workload.LoadTrace(filepath.Join(tracesDir(), "azure2023_conv.csv"), records, workload.ParseAzure)
		if err != nil {
			return nil, err
		}
		return workload.Azure(recs, seed), nil
	}
	return nil, fmt.Errorf("--workload: unknown %q (known: %s)", name, strings.Join(workload.Names, ", "))
}

// parseDispatch reads --dispatch's "median,p90[,per-token[,spacing]]".
func parseDispatch(v string) (vsim.Dispatch, error) {
	parts := strings.Split(v, ",")
	if len(parts) < 2 || len(parts) > 4 {
		return vsim.Dispatch{}, fmt.Errorf("%q: want median,p90[,per-token[,spacing]], e.g. 5.1ms,16.4ms,77ns,0.51ms", v)
	}
	var d vsim.Dispatch
	for i, f := range []*time.Duration{&d.Median, &d.P90, &d.PerToken, &d.Spacing}[:len(parts)] {
		var err error
		if *f, err = time.ParseDuration(strings.TrimSpace(parts[i])); err != nil {
			return d, err
		}
	}
	if d.Median <= 0 {
		return d, fmt.Errorf("%q: median %v is not positive", v, d.Median)
	}
	if err := d.Validate(); err != nil {
		return d, fmt.Errorf("%q: %w", v, err)
	}
	return d, nil
}

// virtualBench is bench.Run on the virtual clock: each strategy and fleet
// replayed by bench/vsim, summarized as the bench summarizes real runs.
// vsimShare is how the virtual clock's replicas share (--share-lag,
// --share-late, --share-corrections).
type vsimShare struct {
	lag         time.Duration
	late        float64
	corrections bool
}

func virtualBench(ctx context.Context, o bench.Options, w *workload.Workload, disp vsim.Dispatch, share vsimShare) (*bench.Report, error) {
	shareLag, shareCorrections := share.lag, share.corrections
	fleets := o.Fleets
	if len(fleets) == 0 {
		fleets = []bench.Fleet{{Workers: o.Workers}}
	}
	clock := "virtual clock: bench/vsim"
	if disp.Median > 0 {
		clock += fmt.Sprintf("; dispatch delays log-normal, median %v, p90 %v", disp.Median, disp.P90)
	}
	rep := &bench.Report{Workload: w.Name, Describe: w.Describe + " (" + clock + ")", Requests: len(w.Requests),
		Workers: o.Workers, Speedup: 1, Rate: o.Rate, Seed: o.Seed, Model: o.Model, GPU: o.GPU}
	for _, f := range fleets {
		rep.Fleets = append(rep.Fleets, f.String())
	}
	if arr, err := bench.Arrivals(w, o.Rate, o.Seed); err == nil && len(arr) > 1 && arr[len(arr)-1] > 0 {
		rep.OfferedRate = float64(len(arr)-1) / arr[len(arr)-1]
	}
	replicas := o.Replicas
	if len(replicas) == 0 {
		replicas = []int{1}
	}
	for _, s := range o.Strategies {
		for _, f := range fleets {
			for _, n := range replicas {
				c := vsim.Config{Model: o.Model, GPU: o.GPU, Workers: f.Workers, Prefill: f.Prefill, Decode: f.Decode,
					Strategy: s, ConcurrencyThreshold: o.ConcurrencyThreshold, PrefixLength: o.PrefixLength,
					KVBlocks: o.KVBlocks, CPUBlocks: o.CPUBlocks, Rate: o.Rate, Seed: o.Seed, Dispatch: disp,
					Replicas: n, ShareLag: shareLag, ShareLate: share.late, ShareCorrections: shareCorrections}
				if f.Disaggregated() {
					c.Workers = 0
				}
				res, err := vsim.Run(ctx, c, w)
				if err != nil {
					return nil, err
				}
				sr := bench.Summarize(bench.ReplicasColumn(&o, s, f, n), res.Requests, max(c.Workers, c.Decode))
				sr.Virtual = true
				sr.Fleet = f.String()
				switch {
				case n > 1 && shareLag < 0:
					sr.Fleet += fmt.Sprintf(", %d scheduler replicas sharing nothing", n)
				case n > 1 && shareCorrections:
					sr.Fleet += fmt.Sprintf(", %d scheduler replicas sharing each decision and time to first token %v after it", n, shareLag)
				case n > 1 && share.late < 1:
					sr.Fleet += fmt.Sprintf(", %d scheduler replicas sharing %.3g of the decisions %v after them, the rest at once", n, share.late, shareLag)
				case n > 1:
					sr.Fleet += fmt.Sprintf(", %d scheduler replicas sharing each decision %v after it", n, shareLag)
				}
				if o.Progress != nil {
					fmt.Fprintf(o.Progress, "baton bench: %s on the virtual clock: %d events, %.0f s modelled\n", sr.Strategy, res.Events, res.Duration)
				}
				rep.Strategies = append(rep.Strategies, *sr)
			}
		}
	}
	return rep, nil
}

// writeHeapProfile writes the heap profile, after a collection, to file.
func writeHeapProfile(file string) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	runtime.GC()
	if err := pprof.WriteHeapProfile(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
