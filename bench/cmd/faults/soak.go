package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

type soakOptions struct {
	streams   int
	duration  time.Duration
	interval  time.Duration
	timeScale float64
	deadline  time.Duration
	demoArgs  string
	prompts   int
}

func (o *soakOptions) register(fs *flag.FlagSet) {
	fs.IntVar(&o.streams, "streams", 2000, "soak: streams held open at once, each client sending one after another")
	fs.DurationVar(&o.duration, "duration", 10*time.Minute, "soak: how long the load runs")
	fs.DurationVar(&o.interval, "interval", 5*time.Second, "soak: between scrapes of the demo's /metrics")
	fs.Float64Var(&o.timeScale, "soak-time-scale", 0.25, "soak: the demo workers' --time-scale (below 1 slows the tokens, so that many streams stay open on few cores)")
	fs.DurationVar(&o.deadline, "soak-deadline", 2*time.Minute, "soak: a request's client-side deadline")
	fs.IntVar(&o.prompts, "soak-prompts", 0, "soak: send only this many distinct prompts, so that every cache and index stops growing at once (0: each prompt new)")
	fs.StringVar(&o.demoArgs, "demo-args", "", "soak: more `flags` for baton demo, space-separated (e.g. \"--kv-blocks 2048 --cpu-blocks 4096\": caches that fill within a minute)")
}

type sample struct {
	at              float64 // seconds since the load started
	goroutines, rss float64
	heap            float64 // go_memstats_heap_inuse_bytes
	live            float64 // heap live after the last GC: go_memstats_next_gc_bytes ÷ 2 (GOGC 100)
	clientOpen      int64
}

func runSoak(ctx context.Context, dir string, o options, log *slog.Logger) (string, error) {
	so := o.soak
	load0 := loadAvg()
	port, err := freePort()
	if err != nil {
		return "", err
	}
	addr := loopback(port)
	base := "http://" + addr
	// Room for every stream: no queueing, no 429 the load does not explain.
	cfg := filepath.Join(dir, "demo.yaml")
	perWorker := so.streams // either decode worker may take them all
	if err := os.WriteFile(cfg, fmt.Appendf(nil, "log_level: warn\nmax_in_flight: %d\nmax_queue: %d\nmax_connections: %d\nrequest_timeout: 5m\n",
		perWorker, so.streams, 2*so.streams+100), 0o644); err != nil {
		return "", err
	}
	args := append([]string{"demo", "--listen", addr, "--config", cfg,
		"--max-running", strconv.Itoa(so.streams), "--time-scale", strconv.FormatFloat(so.timeScale, 'g', -1, 64)},
		strings.Fields(so.demoArgs)...)
	p := newProc(dir, "demo", o.bin, args...)
	if err := p.start(); err != nil {
		return "", err
	}
	defer p.stop(30 * time.Second)
	if err := waitReady(ctx, p, base, 4, 60*time.Second); err != nil {
		return "", err
	}
	idle, err := scrape(ctx, base)
	if err != nil {
		return "", err
	}
	log.Info("soak", "streams", so.streams, "duration", so.duration, "time_scale", so.timeScale)
	rec := &recorder{}
	c := newClient([]string{base}, model, so.deadline, so.streams, rec)
	c.prompts = so.prompts
	defer c.close()
	loadCtx, stopLoad := context.WithTimeout(ctx, so.duration)
	defer stopLoad()
	var wg sync.WaitGroup
	start := time.Now()
	for i := range so.streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(i), 9))
			// Spread the start over 10s, not a thundering herd.
			sleep(loadCtx, time.Duration(r.Int64N(int64(10*time.Second))))
			for loadCtx.Err() == nil {
				c.do(context.WithoutCancel(loadCtx), "steady", c.body(r, true, 64+r.IntN(193)), true, false)
			}
		}()
	}
	var samples []sample
	tick := time.NewTicker(so.interval)
	defer tick.Stop()
	for loadCtx.Err() == nil {
		select {
		case <-tick.C:
		case <-loadCtx.Done():
			continue
		}
		m, err := scrape(ctx, base)
		if err != nil {
			log.Warn("soak scrape", "err", err)
			continue
		}
		s := sample{at: time.Since(start).Seconds(), goroutines: gauge(m, "go_goroutines"), rss: gauge(m, "process_resident_memory_bytes"),
			heap: gauge(m, "go_memstats_heap_inuse_bytes"), live: gauge(m, "go_memstats_next_gc_bytes") / 2,
			clientOpen: rec.sent.Load() - int64(len(rec.snapshot()))}
		samples = append(samples, s)
		log.Info("soak sample", "t", time.Duration(s.at*float64(time.Second)).Round(time.Second), "goroutines", s.goroutines, "rss_mib", mib(s.rss), "heap_mib", mib(s.heap), "live_mib", mib(s.live), "open", s.clientOpen)
	}
	took := time.Since(start)
	wg.Wait()
	c.close() // the server's goroutines of idle keep-alive connections go too
	sleep(ctx, 5*time.Second)
	end, _ := scrape(ctx, base)
	load1 := loadAvg()
	return soakReport(so, rec, samples, idle, end, took, load0, load1), nil
}

// slope fits y = a + b·t by least squares over the samples after the
// first fifth (the ramp), returning b per minute.
func slope(s []sample, y func(sample) float64) float64 {
	s = s[len(s)/5:]
	if len(s) < 2 {
		return math.NaN()
	}
	var st, sy, stt, sty float64
	for _, x := range s {
		t := x.at / 60
		st, sy, stt, sty = st+t, sy+y(x), stt+t*t, sty+t*y(x)
	}
	n := float64(len(s))
	return (n*sty - st*sy) / (n*stt - st*st)
}

func soakReport(so soakOptions, rec *recorder, samples []sample, idle, end metrics, took time.Duration, load0, load1 string) string {
	res := rec.snapshot()
	n := countOutcomes(res)
	var b strings.Builder
	fmt.Fprintf(&b, "Fleet: `baton demo` (one process: scheduler, 2 prefill + 2 decode of baton's simulated workers, %s preset, --time-scale %g, --max-running %d, in-process shared tier%s), max_in_flight %d.\n\n",
		model, so.timeScale, so.streams, extra(so.demoArgs), so.streams)
	fmt.Fprintf(&b, "Load: %d clients each holding one streamed chat completion open after another (a 2,400-character document of 16 plus a question %s, max_tokens 64–256) for %s; client deadline %s. %s; load average %s at the start, %s at the end.\n\n",
		so.streams, questions(so.prompts), took.Round(time.Second), so.deadline, cpus(), load0, load1)
	var mean float64
	for _, s := range samples {
		mean += float64(s.clientOpen)
	}
	if len(samples) > 0 {
		mean /= float64(len(samples))
	}
	fmt.Fprintf(&b, "| requests | ok | errors | streams open (mean of samples) | goroutines slope /min | RSS slope MiB/min | heap in use slope MiB/min | live heap slope MiB/min | goroutines first → last sample | RSS MiB first → last | heap in use MiB first → last | live heap MiB first → last | idle before → 5s after |\n")
	fmt.Fprintf(&b, "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|\n")
	var first, last sample
	if len(samples) > 0 {
		first, last = samples[len(samples)/5], samples[len(samples)-1]
	}
	fmt.Fprintf(&b, "| %d | %d | %d | %.0f | %+.1f | %+.2f | %+.2f | %+.2f | %.0f → %.0f | %s → %s | %s → %s | %s → %s | goroutines %.0f → %.0f, RSS %s → %s MiB |\n",
		len(res), n[outOK], len(res)-n[outOK], mean,
		slope(samples, func(s sample) float64 { return s.goroutines }),
		slope(samples, func(s sample) float64 { return s.rss / (1 << 20) }),
		slope(samples, func(s sample) float64 { return s.heap / (1 << 20) }),
		slope(samples, func(s sample) float64 { return s.live / (1 << 20) }),
		first.goroutines, last.goroutines, mib(first.rss), mib(last.rss), mib(first.heap), mib(last.heap), mib(first.live), mib(last.live),
		gauge(idle, "go_goroutines"), gauge(end, "go_goroutines"), mib(gauge(idle, "process_resident_memory_bytes")), mib(gauge(end, "process_resident_memory_bytes")))
	fmt.Fprintf(&b, "\nThe live heap is half of go_memstats_next_gc_bytes (the heap goal at GOGC 100): what the last GC kept, steadier than the heap in use, which includes the garbage not yet collected.")
	fmt.Fprintf(&b, " Slopes are least-squares fits over the %d samples after the first fifth (the ramp), every %s. Sent %d, ended %d.\n", len(samples)-len(samples)/5, so.interval, rec.sent.Load(), len(res))
	if d := details(res, 6); d != "" {
		fmt.Fprintf(&b, "\nErrors: %s\n", d)
	}
	return b.String()
}

func extra(args string) string {
	if args == "" {
		return ""
	}
	return ", " + args
}

func questions(prompts int) string {
	if prompts > 0 {
		return fmt.Sprintf("of %d, so %d distinct prompts", prompts, prompts)
	}
	return "of its own"
}
