// Command fakevllm starts a fleet of fake vLLM engines (workers/vllm/vllmtest:
// vLLM's HTTP API, /tokenize, /metrics and ZeroMQ KV events, a prefix cache
// of its own, prefill and decode times modelled by workers/engine/cost) and
// prints a baton serve configuration of them, so that baton serve and baton
// bench --target can run against engines that speak vLLM's protocols
// without a GPU. They are not vLLM: say so beside any figure they produce.
//
//	go run ./bench/cmd/fakevllm -n 4 -time-scale 10 -config /tmp/fleet.yaml &
//	baton serve --config /tmp/fleet.yaml --strategy kv_aware &
//	baton bench --target http://127.0.0.1:8080 --workers 4 --speedup 10 --strategies kv_aware
//
// On SIGINT or SIGTERM it prints each engine's counters to stderr and
// exits; a new run starts cold.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "fakevllm:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fakevllm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	n := fs.Int("n", 4, "fake vLLM engines to start")
	dp := fs.Int("dp", 1, "data-parallel ranks of each engine (vLLM's --data-parallel-size), each with its own KV cache; above 1, ports are free ones")
	host := fs.String("host", "127.0.0.1", "host the engines listen on")
	port := fs.Int("port", 0, "first port: engine i listens on port+3i (HTTP), port+3i+1 (KV events) and port+3i+2 (replay); 0 picks free ports")
	served := fs.String("served-model-name", "", "model name served (default: the preset's name)")
	preset := fs.String("model-preset", cost.DefaultModel, "modelled model: "+strings.Join(names(cost.Models), ", "))
	gpu := fs.String("gpu", cost.DefaultGPU, "modelled GPU: "+strings.Join(names(cost.GPUs), ", "))
	scale := fs.Float64("time-scale", 1, "run the modelled clock this many times faster than real time (baton bench --speedup should match)")
	blockSize := fs.Int("block-size", 16, "tokens a KV block")
	kvBlocks := fs.Int("kv-blocks", 0, "GPU KV capacity of each engine in blocks (default: from the modelled GPU's memory)")
	maxRunning := fs.Int("max-running", 256, "running sequences of each engine at most; the rest wait")
	encoding := fs.String("encoding", "tagged-maps", "KV event encoding: array-like, tagged-maps, maps")
	noParent := fs.String("no-parent", "nil", "how events write a sequence's first block's parent: nil (vLLM), zero (0, as llm-d's Go publishers), absent (maps leave the key out)")
	storedFields := fs.Int("stored-fields", 0, "BlockStored fields written, as older vLLM: 5 (0.9, through lora_id), 6 (and medium), 7 (and lora_name); 0 all")
	zeroBlockSize := fs.Bool("zero-block-size", false, "write block_size 0 in events, as llm-d's inference simulator does")
	fixedInts := fs.Bool("fixed-ints", false, "write hashes and token ids as full-width msgpack integers, as Go's msgpack structs do")
	bytesHashes := fs.Bool("bytes-hashes", false, "write block hashes as bytes, as vLLM's ExternalBlockHash")
	omitNil := fs.Bool("omit-nil", false, "leave nil fields out of map events")
	metricsQuery := fs.String("metrics-query", "names", "how /metrics answers a query naming series (name[]=…): names (only those, as vLLM in one API server process), ignored (the whole page, as older prometheus_client), empty (an empty page, as vLLM's multiprocess registry with several API servers), refused (400)")
	listen := fs.String("listen", "127.0.0.1:8080", "listen address written into the configuration for baton serve")
	strategy := fs.String("strategy", "kv_aware", "strategy written into the configuration")
	configPath := fs.String("config", "", "also write the configuration to `file`")
	churn := fs.Float64("churn", 0, "besides requests, store this many new KV `blocks` a second over the fleet (each a fresh prompt of -churn-prompt-blocks, engines in turn), publishing their events and those of the blocks they evict")
	churnPrompt := fs.Int("churn-prompt-blocks", 32, "blocks of each prompt -churn stores")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the fleet, from start to interrupt, to `file`")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	if *n < 1 {
		return fmt.Errorf("-n: must be at least 1, got %d", *n)
	}
	if *churn < 0 {
		return fmt.Errorf("-churn: must not be negative, got %g", *churn)
	}
	if *churnPrompt < 1 {
		return fmt.Errorf("-churn-prompt-blocks: must be at least 1, got %d", *churnPrompt)
	}
	if *dp < 1 {
		return fmt.Errorf("-dp: must be at least 1, got %d", *dp)
	}
	enc, err := parseEncoding(*encoding)
	if err != nil {
		return err
	}
	variant := kveventstest.Variant{StoredFields: *storedFields, ZeroBlockSize: *zeroBlockSize,
		FixedInts: *fixedInts, BytesHashes: *bytesHashes, OmitNil: *omitNil}
	if variant.NoParent, err = parseNoParent(*noParent); err != nil {
		return err
	}
	mq, ok := map[string]vllmtest.MetricsQuery{"names": vllmtest.QueryNames, "ignored": vllmtest.QueryIgnored,
		"empty": vllmtest.QueryEmpty, "refused": vllmtest.QueryRefused}[*metricsQuery]
	if !ok {
		return fmt.Errorf("-metrics-query: must be names, ignored, empty or refused, got %q", *metricsQuery)
	}
	if *storedFields != 0 && (*storedFields < kveventstest.FieldsLoRAID || *storedFields > kveventstest.FieldsLoRAName) {
		return fmt.Errorf("-stored-fields: must be 0, 5, 6 or 7, got %d", *storedFields)
	}
	var engines []engine
	defer func() {
		for _, e := range engines {
			e.close()
		}
	}()
	for i := range *n {
		cfg := vllmtest.Config{Model: *served, Cost: cost.Config{Model: *preset, GPU: *gpu}, TimeScale: *scale,
			BlockSize: *blockSize, GPUBlocks: *kvBlocks, MaxRunning: *maxRunning, Encoding: enc,
			EventsVariant: variant, MetricsQuery: mq}
		addr := func(k int) string {
			if *port == 0 {
				return net.JoinHostPort(*host, "0")
			}
			return net.JoinHostPort(*host, strconv.Itoa(*port+3*i+k))
		}
		cfg.HTTPAddr, cfg.EventsAddr, cfg.ReplayAddr = addr(0), addr(1), addr(2)
		if *dp > 1 {
			d, err := vllmtest.NewDP(cfg, *dp)
			if err != nil {
				return fmt.Errorf("engine %d: %w", i, err)
			}
			e := engine{url: d.URL, close: d.Close}
			for r := range d.Size() {
				e.ranks = append(e.ranks, d.Rank(r))
			}
			engines = append(engines, e)
			continue
		}
		e, err := vllmtest.New(cfg)
		if err != nil {
			return fmt.Errorf("engine %d: %w", i, err)
		}
		engines = append(engines, engine{url: e.URL, ranks: []*vllmtest.Server{e}, close: e.Close})
	}
	var b strings.Builder
	writeConfig(&b, engines, *listen, *strategy, *preset, *gpu, *scale)
	fmt.Fprint(stdout, b.String())
	if *configPath != "" {
		if err := os.WriteFile(*configPath, []byte(b.String()), 0o644); err != nil {
			return err
		}
	}
	fmt.Fprintf(stderr, "fakevllm: %d fake vLLM engines serving; interrupt to stop\n", len(engines))
	if *churn > 0 {
		var ranks []*vllmtest.Server
		for _, e := range engines {
			ranks = append(ranks, e.ranks...)
		}
		start := time.Now()
		n := churnLoop(ctx, ranks, *churn, *churnPrompt, *blockSize)
		d := time.Since(start)
		fmt.Fprintf(stderr, "fakevllm: churn stored %d blocks in %s: %.0f a second of %g asked\n", n, d.Round(time.Millisecond), float64(n)/d.Seconds(), *churn)
	}
	<-ctx.Done()
	for i, e := range engines {
		for r, rk := range e.ranks {
			st := rk.Stats()
			hit := 0.0
			if st.PromptTokens > 0 {
				hit = float64(st.CachedTokens) / float64(st.PromptTokens)
			}
			name := fmt.Sprintf("fake-vllm-%d", i)
			if len(e.ranks) > 1 {
				name += "/dp" + strconv.Itoa(r)
			}
			fmt.Fprintf(stderr, "%s: %d requests, %d prompt tokens, %d cached (%.3f), %d tokenize calls, %d blocks stored, %d removed\n",
				name, st.Requests, st.PromptTokens, st.CachedTokens, hit, st.Tokenizes, st.BlocksStored, st.BlocksRemoved)
		}
	}
	return nil
}

// churnLoop stores rate blocks a second, in fresh prompts of promptBlocks
// blocks, on the ranks in turn, every 10 ms what is due, until ctx ends.
// It returns the blocks stored.
func churnLoop(ctx context.Context, ranks []*vllmtest.Server, rate float64, promptBlocks, blockSize int) int64 {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	start := time.Now()
	prompt := make([]uint32, promptBlocks*blockSize)
	var stored int64
	var seq uint32
	next := 0
	for {
		select {
		case <-ctx.Done():
			return stored
		case <-tick.C:
		}
		due := int64(rate*time.Since(start).Seconds()) - stored
		for ; due >= int64(promptBlocks); due -= int64(promptBlocks) {
			seq++
			// A first block of no other prompt's: as a block's hash
			// chains its parent's, every block is new.
			prompt[0] = seq
			for i := 1; i < len(prompt); i++ {
				prompt[i] = uint32(i)
			}
			ranks[next].Churn(prompt)
			next = (next + 1) % len(ranks)
			stored += int64(promptBlocks)
		}
	}
}

// engine is one fake vLLM: its front URL and its data-parallel ranks (one
// without data parallelism).
type engine struct {
	url   string
	ranks []*vllmtest.Server
	close func()
}

// writeConfig writes baton serve's configuration of the engines.
func writeConfig(w io.Writer, engines []engine, listen, strategy, preset, gpu string, scale float64) {
	fmt.Fprintf(w, "# %d fake vLLM engines (bench/cmd/fakevllm), not vLLM: %s on %s modelled by\n", len(engines), preset, gpu)
	fmt.Fprintf(w, "# workers/engine/cost at time scale %g; cost figures are in real seconds.\n", scale)
	fmt.Fprintf(w, "listen: %s\nstrategy: %s\nworkers:\n", listen, strategy)
	for i, en := range engines {
		e := en.ranks[0]
		f := e.Figures()
		fmt.Fprintf(w, "  - name: fake-vllm-%d\n    kind: vllm\n    address: %s\n    models: [%s]\n", i, en.url, e.Model())
		if len(en.ranks) > 1 {
			fmt.Fprintf(w, "    data_parallel_size: %d\n", len(en.ranks))
		}
		fmt.Fprintf(w, "    events: %s\n    events_replay: %s\n    events_topic: %s\n", e.EventsEndpoint(), e.ReplayEndpoint(), e.Topic())
		fmt.Fprintf(w, "    metrics_path: /metrics\n    metrics_interval: 250ms\n    block_size: %d\n", e.BlockSize())
		fmt.Fprintf(w, "    cost:\n      flops: %.4g\n      decode_step_seconds: %.4g\n      hbm_bytes_per_second: %.4g\n      layers: %d\n      hidden: %d\n      kv_bytes_per_block: %d\n",
			f.FLOPS, f.DecodeStepSeconds, f.HBMBytesPerSecond, f.Layers, f.Hidden, f.KVBytesPerBlock)
	}
}

func parseEncoding(s string) (kveventstest.Encoding, error) {
	for _, e := range []kveventstest.Encoding{kveventstest.ArrayLike, kveventstest.TaggedMaps, kveventstest.Maps} {
		if e.String() == s {
			return e, nil
		}
	}
	return 0, errors.New("-encoding: must be array-like, tagged-maps or maps, got " + strconv.Quote(s))
}

func parseNoParent(s string) (kveventstest.NoParent, error) {
	switch s {
	case "nil":
		return kveventstest.ParentNil, nil
	case "zero":
		return kveventstest.ParentZero, nil
	case "absent":
		return kveventstest.ParentAbsent, nil
	}
	return 0, errors.New("-no-parent: must be nil, zero or absent, got " + strconv.Quote(s))
}

func names[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
