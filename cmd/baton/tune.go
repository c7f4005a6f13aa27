package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/bench/tune"
	"github.com/batonllm/baton/bench/vsim"
	"github.com/batonllm/baton/bench/workload"
)

// tuneCmd runs baton tune: a search of fleet shapes and routing on the
// virtual clock.
func tuneCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tune", "[flags]\n\nSearches prefill:decode splits (colocated included), strategies, concurrency thresholds and\nmin_remote_prefill_tokens for goodput (requests/s meeting both latency targets), simulating\nbaton's routing and the simulated engines on a virtual clock: seconds per configuration.")
	wl := fs.String("workload", "mooncake", "workload: "+strings.Join(workload.Names, ", "))
	trace := fs.String("trace", "", "trace file (default: mooncake_conversation_trace.jsonl or azure2023_conv.csv in $BATON_TRACES or a shared/traces folder beside the working directory or a parent)")
	n := fs.Int("requests", 0, "requests (default: 1200 for synthetic workloads, 1000 trace records)")
	gpus := fs.Int("gpus", 8, "GPUs (one simulated worker each) to split between prefill and decode")
	gpuCounts := fs.String("gpu-counts", "", "comma-separated fleet sizes of the goodput-against-GPUs curve (default 1…--gpus)")
	sloTTFT := fs.Duration("slo-ttft-p90", 2*time.Second, "time-to-first-token target")
	sloITL := fs.Duration("slo-itl-p90", 50*time.Millisecond, "inter-token latency target")
	strategiesFlag := fs.String("strategies", "random,least_outstanding,prefix_aware,kv_aware", "comma-separated strategies searched")
	thresholds := fs.String("thresholds", "8,16,32", "comma-separated concurrency_threshold values searched (prefix_aware, kv_aware)")
	minRemote := fs.String("min-remote", "256,512,2048", "comma-separated min_remote_prefill_tokens values searched (disaggregated fleets)")
	top := fs.Int("top", 3, "best shapes whose thresholds and min_remote_prefill_tokens are searched")
	rate := fs.Float64("rate", 0, "Poisson arrival rate, requests/s (required for synthetic workloads; replaces a trace's timestamps)")
	rateScale := fs.Float64("rate-scale", 1, "multiplies the arrival rate (a trace's timestamps are divided by it)")
	seed := fs.Uint64("seed", 1, "seed of the workload, the arrivals and the strategies' random choices")
	model := fs.String("model", "llama-3.1-8b", "model preset of the simulated workers")
	gpu := fs.String("gpu", "h100", "GPU preset of the simulated workers")
	kvBlocks := fs.Int64("kv-blocks", 0, "KV capacity of each worker in 16-token blocks (default: from GPU memory)")
	cpuBlocks := fs.Int64("cpu-blocks", 0, "CPU KV tier of each worker in blocks (0: none; -1: the simulator's default)")
	docs := fs.Int("docs", 200, "long-context: shared documents")
	pop := fs.String("popularity", "uniform", "long-context: document popularity, uniform or zipf")
	convs := fs.Int("conversations", 32, "sharegpt: conversations open at once")
	dispatch := fs.String("dispatch", "", "`median,p90[,per-token[,spacing]]` of the modelled time from a request's arrival to its engine's queue, e.g. 5.1ms,16.4ms,77ns,0.51ms, as baton bench --virtual --dispatch (default: none)")
	parallel := fs.Int("parallel", 0, "simulations run at once (default: GOMAXPROCS)")
	out := fs.String("out", "bench/tune-out", "`directory` for report.md, candidates.csv, best.yaml and goodput.png")
	quiet := fs.Bool("quiet", false, "no progress lines on stderr")
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	set := setFlags(fs)
	switch {
	case *n < 0 || set["requests"] && *n == 0:
		return fmt.Errorf("--requests: must be at least 1, got %d", *n)
	case *rate < 0:
		return fmt.Errorf("--rate: must be positive, got %v", *rate)
	case !(*rateScale > 0):
		return fmt.Errorf("--rate-scale: must be positive, got %v", *rateScale)
	case *kvBlocks < 0:
		return fmt.Errorf("--kv-blocks: must be at least 1, got %d", *kvBlocks)
	case *cpuBlocks < -1:
		return fmt.Errorf("--cpu-blocks: must be at least -1 (0: none; -1: the simulator's default), got %d", *cpuBlocks)
	case *docs < 1:
		return fmt.Errorf("--docs: must be at least 1, got %d", *docs)
	case *convs < 1:
		return fmt.Errorf("--conversations: must be at least 1, got %d", *convs)
	case *parallel < 0:
		return fmt.Errorf("--parallel: must be at least 1, got %d", *parallel)
	}
	o := tune.Options{GPUs: *gpus, SLOTTFT: *sloTTFT, SLOITL: *sloITL, Top: *top, Parallel: *parallel,
		Strategies: splitList(*strategiesFlag),
		Base: vsim.Config{Model: *model, GPU: *gpu, KVBlocks: *kvBlocks, CPUBlocks: *cpuBlocks,
			Rate: *rate, RateScale: *rateScale, Seed: *seed}}
	var err error
	if *dispatch != "" {
		if o.Base.Dispatch, err = parseDispatch(*dispatch); err != nil {
			return fmt.Errorf("--dispatch: %w", err)
		}
	}
	if o.GPUCounts, err = intList("--gpu-counts", *gpuCounts); err != nil {
		return err
	}
	if o.Thresholds, err = intList("--thresholds", *thresholds); err != nil {
		return err
	}
	if o.MinRemote, err = intList("--min-remote", *minRemote); err != nil {
		return err
	}
	known := strategyNames()
	for _, s := range o.Strategies {
		if !slices.Contains(known, s) {
			return fmt.Errorf("--strategies: unknown %q (known: %s)", s, strings.Join(known, ", "))
		}
	}
	if err := o.Validate(); err != nil {
		return err
	}
	w, err := buildWorkload(*wl, *n, *seed, *trace, *docs, *pop, *convs)
	if err != nil {
		return err
	}
	if !w.Timed && *rate == 0 {
		return fmt.Errorf("--rate: required for the %s workload (its requests carry no arrival times)", *wl)
	}
	if !*quiet {
		o.Progress = stderr
	}
	rep, err := tune.Search(ctx, o, w)
	if err != nil {
		return err
	}
	rep.Command = "baton tune " + strings.Join(args, " ")
	rep.Markdown(stdout)
	files, err := rep.WriteFiles(*out)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "baton tune: %d configurations, %d simulated events in %.1f s (%.0f events/s); wrote %s\n",
		len(rep.Candidates), rep.Events, rep.Elapsed.Seconds(), float64(rep.Events)/rep.Elapsed.Seconds(), strings.Join(files, ", "))
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, x := range strings.Split(s, ",") {
		if x = strings.TrimSpace(x); x != "" {
			out = append(out, x)
		}
	}
	return out
}

func intList(flag, s string) ([]int, error) {
	var out []int
	for _, x := range splitList(s) {
		v, err := strconv.Atoi(x)
		if err != nil {
			return nil, fmt.Errorf("%s: %q is not a number", flag, x)
		}
		out = append(out, v)
	}
	return out, nil
}
