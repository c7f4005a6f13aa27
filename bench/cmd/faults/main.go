// Command faults runs baton's fault matrix: a disaggregated fleet of real
// processes on loopback (a throwaway redis-server as the shared KV tier,
// prefill and decode `baton worker`s, two `baton serve` replicas), a
// steady mixed load of streamed and non-streamed chat completions, and one
// fault at a time, then several at once, each in a window between a
// before and an after. For each it reports whether every request sent
// ended in an outcome the client saw (no hang past the client's deadline,
// no stream cut without [DONE] or an error event), the p99 latency before,
// during and after, the breaker transitions and the first replica's
// goroutines and RSS. With -soak it instead holds many streams open
// against `baton demo` and reports the slope of its RSS and goroutines.
//
//	make faults   # go run ./bench/cmd/faults -baton bin/baton
//	make soak     # go run ./bench/cmd/faults -soak -baton bin/baton
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/batonllm/baton/bench/haproxy"
)

const model = "llama-3.1-8b"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "faults:", err)
		os.Exit(1)
	}
}

type options struct {
	bin                   string
	only                  string
	clients               int
	before, during, after time.Duration
	deadline              time.Duration
	timeScale             float64
	out                   string
	keep                  bool
	lb                    bool   // the clients send to HAProxy in front of the replicas
	lbVersion             string // its version, once started
	soak                  soakOptions
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("faults", flag.ContinueOnError)
	var o options
	fs.StringVar(&o.bin, "baton", "", "baton `binary` to run (default: go build ./cmd/baton into the run's directory)")
	fs.StringVar(&o.only, "faults", "", "comma-separated fault `names` to run (default: all)")
	fs.IntVar(&o.clients, "clients", 6, "steady load: clients each sending one request after another")
	fs.DurationVar(&o.before, "before", 5*time.Second, "window before each fault")
	fs.DurationVar(&o.during, "during", 10*time.Second, "how long each fault lasts")
	fs.DurationVar(&o.after, "after", 6*time.Second, "window after each fault, once the fleet is whole again")
	fs.DurationVar(&o.deadline, "deadline", 20*time.Second, "a request's client-side deadline: past it, it is a hang")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "the workers' --time-scale")
	quick := fs.Bool("quick", false, "short windows (2s, 4s, 3s): the whole matrix in about two minutes")
	fs.StringVar(&o.out, "out", "", "also write the Markdown report to this `file`")
	fs.BoolVar(&o.keep, "keep", false, "keep the run's directory (processes' logs, config)")
	soak := fs.Bool("soak", false, "run the soak instead of the fault matrix")
	fs.BoolVar(&o.lb, "lb", false, "the clients send to an HAProxy in front of the replicas (round robin, /readyz checks; Debian's haproxy, installed when run as root) instead of to each replica in turn")
	o.soak.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *quick {
		o.before, o.during, o.after = 2*time.Second, 4*time.Second, 3*time.Second
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	dir, err := os.MkdirTemp("", "baton-faults-")
	if err != nil {
		return err
	}
	if o.keep {
		log.Info("run directory kept", "dir", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	if o.bin == "" {
		o.bin = filepath.Join(dir, "baton")
		log.Info("building baton", "out", o.bin)
		cmd := exec.CommandContext(ctx, "go", "build", "-o", o.bin, "./cmd/baton")
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("go build ./cmd/baton (run from the module's root): %w", err)
		}
	} else if o.bin, err = filepath.Abs(o.bin); err != nil {
		return err
	}
	var report string
	if *soak {
		report, err = runSoak(ctx, dir, o, log)
	} else {
		report, err = runMatrix(ctx, dir, o, log)
	}
	if report != "" {
		fmt.Fprint(stdout, report)
		if o.out != "" {
			if werr := os.WriteFile(o.out, []byte(report), 0o644); werr != nil && err == nil {
				err = werr
			}
		}
	}
	return err
}

// harness is a running matrix: the fleet, the load and the fault in hand.
type harness struct {
	f         *fleet
	rec       *recorder
	model     string
	deadline  time.Duration
	during    time.Duration
	hole      *blackHole
	mark      mark     // counters at the fault's start, for its check
	fresh     freshLog // corrupt-transfer's requests, to replay
	replayed  struct{ compared, differed int }
	stopBg    func()    // stops the load a fault started in the background
	restarted []metrics // the replicas' metrics when a fault's worker was restarted
}

// window is one fault's run: its times and the first replica's metrics.
type window struct {
	f                  fault
	note               string
	err                error
	t0, t1, t2, t3     time.Time // before, during, after start; the end
	recovery           time.Duration
	mBefore, mIn, mEnd metrics
	wBefore, wEnd      map[string]metrics // the workers'
	r1Before, r1End    metrics            // replica 1's, when there is one
}

func runMatrix(ctx context.Context, dir string, o options, log *slog.Logger) (string, error) {
	const prefill, decode = 2, 2
	faults := allFaults(prefill, decode)
	if o.only != "" {
		var sel []fault
		for _, name := range strings.Split(o.only, ",") {
			i := slices.IndexFunc(faults, func(f fault) bool { return f.name == name })
			if i < 0 {
				return "", fmt.Errorf("-faults: no fault %q", name)
			}
			sel = append(sel, faults[i])
		}
		faults = sel
	}
	load0 := loadAvg()
	started := time.Now()
	log.Info("starting the fleet", "prefill", prefill, "decode", decode, "replicas", 2, "dir", dir)
	var lb string
	if o.lb {
		var err error
		if lb, err = haproxy.Binary(""); err != nil {
			return "", err
		}
		for i := range faults {
			faults[i].what = strings.ReplaceAll(faults[i].what, clientsRetry, lbRetries)
		}
	}
	f, err := startFleet(ctx, dir, o.bin, prefill, decode, 2, o.timeScale, lb)
	if err != nil {
		return "", err
	}
	defer f.close()
	if f.lb != nil {
		o.lbVersion = f.lb.Version // what Start read of the binary
	}
	h := &harness{f: f, rec: &recorder{}, model: model, deadline: o.deadline, during: o.during}
	idle0, err := scrape(ctx, f.bases[0])
	if err != nil {
		return "", err
	}

	loadCtx, stopLoad := context.WithCancel(ctx)
	var loadWG sync.WaitGroup
	steady := newClient(f.clients, model, o.deadline, o.clients, h.rec)
	defer steady.close()
	for i := range o.clients {
		loadWG.Add(1)
		go steady.loop(loadCtx, uint64(i), "steady", &loadWG)
	}
	sleep(ctx, 3*time.Second) // warm the caches
	var wins []*window
	var runErr error
	for _, flt := range faults {
		if ctx.Err() != nil {
			break
		}
		log.Info("fault", "name", flt.name)
		w := &window{f: flt}
		wins = append(wins, w)
		w.t0 = time.Now()
		w.mBefore, _ = scrape(ctx, f.bases[0])
		w.wBefore = f.scrapeWorkers(ctx)
		if len(f.bases) > 1 {
			w.r1Before, _ = scrape(ctx, f.bases[1])
		}
		sleep(ctx, o.before)
		w.t1 = time.Now()
		w.mIn, _ = scrape(ctx, f.bases[0])
		w.note, w.err = flt.inject(ctx, h)
		sideCtx, stopSide := context.WithCancel(ctx)
		var sideWG sync.WaitGroup
		if flt.side != nil && w.err == nil {
			sideWG.Add(1)
			go func() { defer sideWG.Done(); flt.side(sideCtx, h) }()
		}
		sleep(ctx, o.during-time.Since(w.t1))
		stopSide()
		if w.err == nil {
			w.err = flt.recover(ctx, h)
		}
		sideWG.Wait()
		rs := time.Now()
		if err := f.waitAll(ctx, 30*time.Second); err != nil && w.err == nil {
			w.err = fmt.Errorf("fleet not whole again: %w", err)
		}
		w.t2 = time.Now()
		w.recovery = w.t2.Sub(rs)
		sleep(ctx, o.after)
		w.t3 = time.Now()
		w.mEnd, _ = scrape(ctx, f.bases[0])
		w.wEnd = f.scrapeWorkers(ctx)
		if len(f.bases) > 1 {
			w.r1End, _ = scrape(ctx, f.bases[1])
		}
		if flt.check != nil && w.err == nil {
			var note string
			note, w.err = flt.check(ctx, h, w)
			w.note = strings.Trim(w.note+"; "+note, "; ")
		}
		if w.err != nil {
			log.Error("fault", "name", flt.name, "err", w.err)
			runErr = fmt.Errorf("%s: %w", flt.name, w.err)
			break
		}
	}
	stopLoad()
	loadWG.Wait()
	steady.close()            // the server's goroutines of idle keep-alive connections go too
	sleep(ctx, 3*time.Second) // let the last streams' goroutines end
	idle1, _ := scrape(ctx, f.bases[0])
	tier := f.scrapeWorkers(ctx)
	load1 := loadAvg()
	return matrixReport(o, wins, h.rec, idle0, idle1, tier, load0, load1, time.Since(started)), runErr
}

func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// loadAvg returns /proc/loadavg's three averages.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func cpus() string { return fmt.Sprintf("%d CPUs, %s", runtime.NumCPU(), runtime.Version()) }
