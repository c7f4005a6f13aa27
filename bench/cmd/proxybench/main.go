// Command proxybench measures the latency baton serve adds in front of an
// OpenAI-compatible engine, side by side with a plain L7 proxy (HAProxy).
//
// One simulated worker (workers/sim) serves its own OpenAI HTTP endpoint
// as the stub engine, its modelled clock sped up so that compute is
// negligible (at the default -timescale a step sleeps nanoseconds; a
// lower one adds each one-token answer's modelled step, about 6 ms over
// the time scale). A `baton serve` child process routes to it as an http
// worker, as a user deploys it, and an HAProxy child process proxies to
// it, as does a third child, the least reverse proxy Go's net/http makes
// (go-proxy: the floor of baton's HTTP stack); for comparison, schedulers
// inside this process route to it as an http worker and over its gRPC API. Sequential streaming chat requests
// with max_tokens 1 then go round-robin to each path over keep-alive
// connections; each is timed to its first byte of body (the first event)
// and to its last (data: [DONE]). The report gives percentiles per path
// and each proxy's added latency, both as a difference of percentiles and
// as percentiles of the per-round difference to the direct request.
//
//	make bench-proxy    # go run ./bench/cmd/proxybench -baton bin/baton
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/batonllm/baton/bench/haproxy"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/sim"
)

const model = "llama-3.1-8b"

// Paths a request can take to the engine.
const (
	pathDirect      = "direct"
	pathHAProxy     = "haproxy"
	pathBaton       = "baton"        // baton serve in its own process, engine as an http worker
	pathBatonInproc = "baton-inproc" // the scheduler in this process, engine as an http worker
	pathBatonGRPC   = "baton-grpc"   // the scheduler in this process, the same engine over gRPC
	pathBatonB      = "baton-b"      // -baton-b: another build of baton serve, side by side
	pathGoProxy     = "go-proxy"     // the least a Go net/http reverse proxy does, in its own process
	pathGoRaw       = "go-raw"       // the least a Go proxy does without net/http's server or client, in its own process
)

var allPaths = []string{pathDirect, pathHAProxy, pathBaton, pathGoProxy, pathGoRaw, pathBatonInproc, pathBatonGRPC}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "proxybench:", err)
		os.Exit(1)
	}
}

func run() error {
	n := flag.Int("n", 20000, "rounds: each sends one request down every path (a p99 of a few thousand rounds rests on a few dozen and moves by a third between runs)")
	warmup := flag.Int("warmup", 200, "rounds sent first and not counted")
	timeScale := flag.Float64("timescale", 1e6, "the simulated engine's TimeScale (its modelled clock's speed-up)")
	pathsFlag := flag.String("paths", strings.Join(allPaths, ","), "paths to measure, of "+strings.Join(allPaths, ","))
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole process (engine, proxies, client) to `file`")
	promptChars := flag.Int("prompt-chars", 0, "pad each prompt to about this many characters (an 8,000-token document is ~32,000)")
	memProfile := flag.String("memprofile", "", "write an allocation profile of the whole process to `file` at the end")
	haproxyBin := flag.String("haproxy", "", "HAProxy binary (default: haproxy on PATH, or /usr/sbin/haproxy)")
	batonBin := flag.String("baton", "", "baton binary run as `baton serve` (default: go build ./cmd/baton into a temporary directory)")
	batonB := flag.String("baton-b", "", "a second baton `binary` run as baton serve beside the first, as path baton-b (to compare two builds in one run)")
	batonProfile := flag.String("baton-cpuprofile", "", "write a CPU profile of the baton serve process over the measured rounds to `file`")
	countSyscalls := flag.Bool("syscalls", false, "count the system calls and context switches of each proxy's own process over the measured rounds, with perf stat (Linux)")
	timingsFile := flag.String("timings", "", "write each measured round's times (microseconds, a column per path: first byte and [DONE]) to `file` as CSV")
	batonMemProfile := flag.String("baton-memprofile", "", "write an allocation profile of the baton serve process, at the end, to `file`")
	minimal := flag.String("minimal-proxy", "", "internal: serve the go-proxy path on `address` (host:port) in front of -minimal-proxy-engine, and nothing else")
	minimalEngine := flag.String("minimal-proxy-engine", "", "internal: the engine URL of -minimal-proxy")
	raw := flag.Bool("minimal-proxy-raw", false, "internal: -minimal-proxy serves the go-raw path")
	flag.Parse()
	if *minimal != "" && *raw {
		return serveRawProxy(*minimal, *minimalEngine)
	}
	if *minimal != "" {
		return serveMinimalProxy(*minimal, *minimalEngine)
	}

	paths := strings.Split(*pathsFlag, ",")
	for _, p := range paths {
		if !slices.Contains(allPaths, p) {
			return fmt.Errorf("-paths: unknown path %q", p)
		}
	}
	if !slices.Contains(paths, pathDirect) {
		paths = append([]string{pathDirect}, paths...)
	}
	if *batonB != "" {
		paths = append(paths, pathBatonB)
	}

	w, err := sim.Start(sim.Config{Name: "stub", TimeScale: *timeScale}, "127.0.0.1:0", "127.0.0.1:0", nil)
	if err != nil {
		return fmt.Errorf("starting the simulated worker: %w", err)
	}
	defer w.Close()
	engineURL := "http://" + w.HTTPAddr

	urls := map[string]string{pathDirect: engineURL}
	pids := map[string]int{} // the process of each path that runs in its own
	var haproxyVersion string
	if slices.Contains(paths, pathHAProxy) {
		bin, err := haproxy.Binary(*haproxyBin)
		if err != nil {
			return err
		}
		hp, err := haproxy.Start(bin, func(bind string) string { return fmt.Sprintf(haproxyConfig, bind, w.HTTPAddr) })
		if err != nil {
			return err
		}
		defer hp.Stop()
		urls[pathHAProxy] = "http://" + hp.Addr
		pids[pathHAProxy] = hp.Pid()
		haproxyVersion = hp.Version
	}
	var bs *batonServe
	if slices.Contains(paths, pathBaton) {
		if bs, err = startBatonServe(*batonBin, engineURL, *batonProfile != "" || *batonMemProfile != ""); err != nil {
			return err
		}
		defer bs.stop()
		urls[pathBaton] = "http://" + bs.addr
		pids[pathBaton] = bs.cmd.Process.Pid
	}
	for _, p := range []string{pathGoProxy, pathGoRaw} {
		if !slices.Contains(paths, p) {
			continue
		}
		self, err := os.Executable()
		if err != nil {
			return err
		}
		addr, err := freeAddr()
		if err != nil {
			return err
		}
		gp := exec.Command(self, "-minimal-proxy", addr, "-minimal-proxy-engine", engineURL, "-minimal-proxy-raw="+strconv.FormatBool(p == pathGoRaw))
		gp.Stdout, gp.Stderr = os.Stderr, os.Stderr
		if err := gp.Start(); err != nil {
			return fmt.Errorf("starting %s: %w", p, err)
		}
		exited := make(chan struct{})
		go func() { gp.Wait(); close(exited) }()
		defer func() { gp.Process.Kill(); <-exited }()
		if err := waitListening(addr, exited); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		urls[p] = "http://" + addr
		pids[p] = gp.Process.Pid
	}
	if *batonB != "" {
		b, err := startBatonServe(*batonB, engineURL, false)
		if err != nil {
			return err
		}
		defer b.stop()
		urls[pathBatonB] = "http://" + b.addr
		pids[pathBatonB] = b.cmd.Process.Pid
	}
	for _, p := range []struct{ path, kind, addr string }{
		{pathBatonInproc, scheduler.KindHTTP, engineURL},
		{pathBatonGRPC, scheduler.KindGRPC, w.GRPCAddr},
	} {
		if !slices.Contains(paths, p.path) {
			continue
		}
		addr, stop, err := startScheduler(p.kind, p.addr)
		if err != nil {
			return err
		}
		defer stop()
		urls[p.path] = "http://" + addr
	}

	clients := map[string]*client{}
	for _, p := range paths {
		tr := &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}
		defer tr.CloseIdleConnections()
		clients[p] = &client{hc: &http.Client{Transport: tr}, base: urls[p], br: bufio.NewReader(nil)}
		if err := clients[p].waitReady(); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}

	fmt.Printf("proxybench: %d rounds (+%d warm-up) of streamed chat completions, max_tokens 1, request bodies of %d bytes, sequential, keep-alive\n",
		*n, *warmup, len(requestBody(0, *promptChars)))
	fmt.Printf("stub engine: baton's simulated worker (workers/sim, %s, TimeScale %g) on its own OpenAI HTTP endpoint %s\n", model, *timeScale, engineURL)
	fmt.Printf("paths: direct = client → engine; haproxy = client → %s → engine (mode http, http-reuse always);\n", orNone(haproxyVersion))
	fmt.Printf("       baton = client → baton serve, its own process (strategy random, kind: http worker) → engine;\n")
	fmt.Printf("       go-proxy = client → the least a Go net/http reverse proxy does (no parsing, no routing), its own process → engine;\n")
	fmt.Printf("       baton-inproc = the same scheduler as baton inside this process; baton-grpc = that scheduler → the same worker over gRPC\n")
	fmt.Printf("%s, GOMAXPROCS %d, %d CPUs\n\n", runtime.Version(), runtime.GOMAXPROCS(0), runtime.NumCPU())

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

	var profiled chan error
	stats := map[string]*perfStat{}
	if *countSyscalls {
		for p, pid := range pids {
			st, err := startPerfStat(pid)
			if err != nil {
				return fmt.Errorf("counting %s's system calls: %w", p, err)
			}
			defer st.close()
			stats[p] = st
		}
	}
	times := map[string][]timing{}
	cpuAtStart := map[string]time.Duration{}
	for round := -*warmup; round < *n; round++ {
		if round == 0 && *batonProfile != "" && bs != nil {
			profiled = make(chan error, 1)
			go func() { profiled <- bs.profile(*batonProfile, *n) }()
		}
		if round == 0 {
			for p, pid := range pids {
				cpuAtStart[p], _ = processCPU(pid)
			}
			for p, st := range stats {
				if err := st.command("enable"); err != nil {
					return fmt.Errorf("counting %s's system calls: %w", p, err)
				}
			}
		}
		body := requestBody(round, *promptChars)
		// Rotate which path goes first, so that none always follows
		// another's connection wake-ups.
		off := (round + *warmup) % len(paths)
		for i := range paths {
			p := paths[(i+off)%len(paths)]
			d, err := clients[p].timeRequest(body)
			if err != nil {
				return fmt.Errorf("%s, round %d: %w", p, round, err)
			}
			if round >= 0 {
				times[p] = append(times[p], d)
			}
		}
	}
	counts := map[string]map[string]float64{}
	for p, st := range stats {
		c, err := st.stop()
		if err != nil {
			return fmt.Errorf("counting %s's system calls: %w", p, err)
		}
		counts[p] = c
	}
	cpu := map[string]time.Duration{}
	for p, pid := range pids {
		if end, err := processCPU(pid); err == nil && cpuAtStart[p] > 0 {
			cpu[p] = end - cpuAtStart[p]
		}
	}
	fmt.Println("Time to the first byte of the body (the first event):")
	report(os.Stdout, paths, times, func(t timing) time.Duration { return t.first })
	fmt.Println("\nTime to data: [DONE]:")
	report(os.Stdout, paths, times, func(t timing) time.Duration { return t.done })
	reportCPU(os.Stdout, paths, cpu, *n)
	if *timingsFile != "" {
		if err := writeTimings(*timingsFile, paths, times); err != nil {
			return err
		}
	}
	reportSyscalls(os.Stdout, paths, counts, *n)
	if profiled != nil {
		if err := <-profiled; err != nil {
			return fmt.Errorf("baton serve's CPU profile: %w", err)
		}
	}
	if *batonMemProfile != "" && bs != nil {
		if err := bs.fetch("/debug/pprof/allocs", *batonMemProfile); err != nil {
			return fmt.Errorf("baton serve's allocation profile: %w", err)
		}
	}
	if *memProfile != "" {
		f, err := os.Create(*memProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
			return err
		}
	}
	return nil
}

// processCPU is the CPU time (user and system, every thread's, the
// exited ones' included) the process pid has used, from /proc (Linux).
func processCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// pid (comm) state ppid ...: comm may hold spaces; utime and stime
	// are the 14th and 15th fields, the 12th and 13th after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += v
	}
	const userHZ = 100 // the clock tick /proc counts in, on every Linux port Go runs on
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// reportCPU writes the CPU time each path's own process used per measured
// request (10 ms resolution over the whole run).
func reportCPU(w io.Writer, paths []string, cpu map[string]time.Duration, n int) {
	if len(cpu) == 0 || n == 0 {
		return
	}
	fmt.Fprintln(w, "\nCPU time of the proxy's process per request (user + system, all threads):")
	for _, p := range paths {
		if d, ok := cpu[p]; ok {
			fmt.Fprintf(w, "%10s  %4d µs\n", p, d.Microseconds()/int64(n))
		}
	}
}

func orNone(s string) string {
	if s == "" {
		return "HAProxy (not run)"
	}
	return s
}

// requestBody is round's request: a prompt of its own, so that no layer
// answers from a cache, padded to about chars characters.
func requestBody(round, chars int) []byte {
	prompt := fmt.Sprintf("Round %d: say one word about proxies.", round)
	if pad := chars - len(prompt); pad > 0 {
		prompt = strings.Repeat("lorem ipsum ", pad/12+1)[:pad] + prompt
	}
	return fmt.Appendf(nil, `{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":1,"stream":true}`, model, prompt)
}

var doneLine = []byte("data: [DONE]")

// client sends one path's requests over its own keep-alive connections.
type client struct {
	hc   *http.Client
	base string
	br   *bufio.Reader // reused, so that the client allocates little
}

// timing is one request's: from sending it to reading the first byte of
// the response's body, and to reading its [DONE] event.
type timing struct{ first, done time.Duration }

// timeRequest posts body and times it. The rest of the body is read
// afterwards, untimed, so that the connection is reused.
func (c *client) timeRequest(body []byte) (timing, error) {
	var t timing
	start := time.Now()
	resp, err := c.hc.Post(c.base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return t, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
		return t, fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	br := c.br
	br.Reset(resp.Body)
	defer br.Reset(nil)
	if _, err := br.Peek(1); err != nil {
		return t, fmt.Errorf("empty stream: %w", err)
	}
	t.first = time.Since(start)
	content := false
	for {
		line, err := br.ReadSlice('\n')
		if bytes.HasPrefix(line, doneLine) {
			break
		}
		if bytes.Contains(line, []byte(`"content":`)) {
			content = true
		}
		if err != nil {
			return t, fmt.Errorf("stream ended before [DONE]: %w", err)
		}
	}
	t.done = time.Since(start)
	if _, err := io.Copy(io.Discard, br); err != nil {
		return t, err
	}
	if !content {
		return t, errors.New("no content chunk before [DONE]")
	}
	return t, nil
}

// waitReady sends requests until one succeeds (a scheduler routes only
// once its worker is known), for up to 10 s.
func (c *client) waitReady() error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := c.timeRequest(requestBody(-1<<20, 0))
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after 10s: %w", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startScheduler starts baton serve's scheduler with one worker of kind at
// addr, strategy random, logging at info as baton serve does by default
// (to stderr: nothing is logged per request at info).
func startScheduler(kind, addr string) (string, func(), error) {
	var reg routing.Registry
	routing.RegisterBuiltins(&reg)
	cfg := scheduler.Config{
		Listen:   "127.0.0.1:0",
		Strategy: "random",
		Workers:  []scheduler.WorkerConfig{{Name: "stub", Kind: kind, Address: addr, Models: []string{model}, Role: scheduler.RoleBoth}},
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	s, err := scheduler.New(cfg, &reg, log)
	if err != nil {
		return "", nil, fmt.Errorf("scheduler (%s worker): %w", kind, err)
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		s.Close()
		return "", nil, err
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	return l.Addr().String(), func() { s.Close(); <-served }, nil
}

// batonServe is a `baton serve` child process.
type batonServe struct {
	cmd       *exec.Cmd
	dir       string // the temporary build's, if any
	addr      string
	pprofAddr string
	exited    chan struct{}
}

// startBatonServe runs bin (built from ./cmd/baton when empty) as
// `baton serve` with engineURL as its one http worker, strategy random,
// logging at its default level (info: nothing per request), and returns
// once it accepts connections.
func startBatonServe(bin, engineURL string, pprof bool) (*batonServe, error) {
	b := &batonServe{exited: make(chan struct{})}
	if bin == "" {
		dir, err := os.MkdirTemp("", "proxybench-baton")
		if err != nil {
			return nil, err
		}
		b.dir = dir
		bin = filepath.Join(dir, "baton")
		build := exec.Command("go", "build", "-o", bin, "github.com/batonllm/baton/cmd/baton")
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("building baton: %w", err)
		}
	}
	var err error
	if b.addr, err = freeAddr(); err != nil {
		return nil, err
	}
	args := []string{"serve", "--listen", b.addr, "--strategy", "random", "--worker", "stub=" + engineURL}
	if pprof {
		if b.pprofAddr, err = freeAddr(); err != nil {
			return nil, err
		}
		args = append(args, "--pprof-listen", b.pprofAddr)
	}
	b.cmd = exec.Command(bin, args...)
	b.cmd.Stdout, b.cmd.Stderr = os.Stderr, os.Stderr
	if err := b.cmd.Start(); err != nil {
		os.RemoveAll(b.dir)
		return nil, fmt.Errorf("starting baton serve: %w", err)
	}
	go func() { b.cmd.Wait(); close(b.exited) }()
	if err := waitListening(b.addr, b.exited); err != nil {
		b.stop()
		return nil, fmt.Errorf("baton serve: %w", err)
	}
	return b, nil
}

// profile writes a CPU profile of the process over about the time n
// rounds take (1 ms each at most, and at least 5 s) to file.
func (b *batonServe) profile(file string, n int) error {
	return b.fetch(fmt.Sprintf("/debug/pprof/profile?seconds=%d", max(5, n/1000)), file)
}

// fetch writes what the process's pprof listener answers at path to file.
func (b *batonServe) fetch(path, file string) error {
	resp, err := http.Get("http://" + b.pprofAddr + path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// stop ends the process as a user would, with SIGINT, and waits for it.
func (b *batonServe) stop() {
	b.cmd.Process.Signal(os.Interrupt)
	select {
	case <-b.exited:
	case <-time.After(5 * time.Second):
		b.cmd.Process.Kill()
		<-b.exited
	}
	if b.dir != "" {
		os.RemoveAll(b.dir)
	}
}

// waitListening returns once addr accepts connections, or an error when
// exited is closed first or after 10 s.
func waitListening(addr string, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-exited:
			return errors.New("exited")
		case <-ctx.Done():
			return fmt.Errorf("does not listen on %s", addr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// serveMinimalProxy serves the go-proxy path: each request's body is read
// and posted to engine with Go's http.Client (keep-alive, as baton's
// engine client), and the response relayed with a flush after each read,
// with none of baton's parsing, routing, metrics or accounting: the floor
// of a proxy built on net/http, server and client.
func serveMinimalProxy(addr, engine string) error {
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true}}
	h := func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, engine+r.URL.Path, bytes.NewReader(body))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
		w.WriteHeader(resp.StatusCode)
		rc := http.NewResponseController(w)
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				if _, err := w.Write(buf[:n]); err != nil {
					return
				}
				rc.Flush()
			}
			if err != nil {
				return
			}
		}
	}
	return http.ListenAndServe(addr, http.HandlerFunc(h))
}

// haproxyConfig proxies plain HTTP to one server, reusing server
// connections, without logging.
const haproxyConfig = `global
	maxconn 1024

defaults
	mode http
	timeout connect 5s
	timeout client 300s
	timeout server 300s
	timeout http-keep-alive 300s
	http-reuse always

frontend fe
	bind %s
	default_backend engine

backend engine
	server engine %s
`

// freeAddr returns a loopback address no one listens on (HAProxy binds
// it itself).
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// report prints each path's percentiles and what each proxy adds to the
// direct path, and baton's added latency over HAProxy's.
func report(out io.Writer, paths []string, timings map[string][]timing, of func(timing) time.Duration) {
	times := map[string][]time.Duration{}
	for p, ts := range timings {
		for _, t := range ts {
			times[p] = append(times[p], of(t))
		}
	}
	direct := times[pathDirect]
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "path\tp50\tp90\tp99\tadded p50\tadded p99\tper-round added p50\tper-round added p99\t")
	type added struct{ p50, p99, r50, r99 time.Duration }
	adds := map[string]added{}
	for _, p := range paths {
		t := times[p]
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t", p, us(pct(t, 50)), us(pct(t, 90)), us(pct(t, 99)))
		if p == pathDirect {
			fmt.Fprintln(tw, "\t\t\t\t")
			continue
		}
		diff := make([]time.Duration, len(t))
		for i := range t {
			diff[i] = t[i] - direct[i]
		}
		a := added{pct(t, 50) - pct(direct, 50), pct(t, 99) - pct(direct, 99), pct(diff, 50), pct(diff, 99)}
		adds[p] = a
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t\n", us(a.p50), us(a.p99), us(a.r50), us(a.r99))
	}
	tw.Flush()
	hp, ok := adds[pathHAProxy]
	if !ok {
		return
	}
	fmt.Fprintln(out)
	for _, p := range []string{pathBaton, pathBatonB, pathGoProxy, pathGoRaw, pathBatonInproc, pathBatonGRPC} {
		a, ok := adds[p]
		if !ok {
			continue
		}
		fmt.Fprintf(out, "%s added / haproxy added: p50 %s, p99 %s (per-round: p50 %s, p99 %s)\n",
			p, ratio(a.p50, hp.p50), ratio(a.p99, hp.p99), ratio(a.r50, hp.r50), ratio(a.r99, hp.r99))
	}
}

// writeTimings writes one row per measured round: for each path, its
// time to the first byte and to [DONE], in microseconds.
func writeTimings(file string, paths []string, times map[string][]timing) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	var head []string
	for _, p := range paths {
		head = append(head, p+"_first_us", p+"_done_us")
	}
	w.Write(head)
	for i := range times[paths[0]] {
		row := make([]string, 0, len(head))
		for _, p := range paths {
			t := times[p][i]
			row = append(row, strconv.FormatInt(t.first.Microseconds(), 10), strconv.FormatInt(t.done.Microseconds(), 10))
		}
		w.Write(row)
	}
	w.Flush()
	if err := w.Error(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// pct returns the p-th percentile of d (nearest rank), without changing d.
func pct(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(p/100*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func us(d time.Duration) string {
	return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond))
}

func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", float64(a)/float64(b))
}

// serveRawProxy serves the go-raw path: the go-proxy path's work on a
// connection loop of its own (one goroutine a connection, requests parsed
// by http.ReadRequest, the response written chunked straight to the
// connection) and baton's engine client (httpengine.PlainHTTP): the floor
// of a Go proxy without net/http's server or its Transport.
func serveRawProxy(addr, engine string) error {
	rt := httpengine.PlainHTTP(&http.Transport{})
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go serveRawConn(c, rt, engine)
	}
}

func serveRawConn(c net.Conn, rt http.RoundTripper, engine string) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 4<<10)
	bw := bufio.NewWriterSize(c, 4<<10)
	buf := make([]byte, 32<<10)
	for {
		r, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		req, err := http.NewRequest(http.MethodPost, engine+r.URL.Path, bytes.NewReader(body))
		if err != nil {
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := rt.RoundTrip(req)
		if err != nil {
			return
		}
		fmt.Fprintf(bw, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n",
			resp.StatusCode, http.StatusText(resp.StatusCode), resp.Header.Get("Content-Type"))
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				bw.WriteString(strconv.FormatInt(int64(n), 16))
				bw.WriteString("\r\n")
				bw.Write(buf[:n])
				bw.WriteString("\r\n")
				if bw.Flush() != nil {
					resp.Body.Close()
					return
				}
			}
			if err != nil {
				break
			}
		}
		resp.Body.Close()
		if _, err := bw.WriteString("0\r\n\r\n"); err != nil || bw.Flush() != nil {
			return
		}
	}
}

// perfEvents are what -syscalls counts: every system call, those a proxy
// makes per request by name, and the process's context switches.
var perfEvents = []struct{ event, column string }{
	{"raw_syscalls:sys_enter", "syscalls"},
	{"syscalls:sys_enter_read", "read"},
	{"syscalls:sys_enter_recvfrom", "recvfrom"},
	{"syscalls:sys_enter_write", "write"},
	{"syscalls:sys_enter_sendto", "sendto"},
	{"syscalls:sys_enter_epoll_pwait", "epoll_pwait"},
	{"syscalls:sys_enter_epoll_wait", "epoll_wait"},
	{"syscalls:sys_enter_futex", "futex"},
	{"syscalls:sys_enter_nanosleep", "nanosleep"},
	{"context-switches", "context switches"},
}

// perfStat is a perf stat attached to a process, its counters enabled
// and disabled through a control FIFO, so that they cover the measured
// rounds only.
type perfStat struct {
	cmd      *exec.Cmd
	dir, out string
	ctl, ack *os.File
	log      bytes.Buffer
	exited   chan struct{}
}

func startPerfStat(pid int) (*perfStat, error) {
	dir, err := os.MkdirTemp("", "proxybench-perf")
	if err != nil {
		return nil, err
	}
	st := &perfStat{dir: dir, out: filepath.Join(dir, "stat"), exited: make(chan struct{})}
	ctl, ack := filepath.Join(dir, "ctl"), filepath.Join(dir, "ack")
	for _, f := range []string{ctl, ack} {
		if err := syscall.Mkfifo(f, 0o600); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	// Opened read-write, a FIFO opens without waiting for perf's end.
	if st.ctl, err = os.OpenFile(ctl, os.O_RDWR, 0); err == nil {
		st.ack, err = os.OpenFile(ack, os.O_RDWR, 0)
	}
	if err != nil {
		st.close()
		return nil, err
	}
	events := make([]string, len(perfEvents))
	for i, e := range perfEvents {
		events[i] = e.event
	}
	st.cmd = exec.Command("perf", "stat", "-x", ",", "-o", st.out, "-D", "-1", "--control", "fifo:"+ctl+","+ack,
		"-e", strings.Join(events, ","), "-p", strconv.Itoa(pid))
	st.cmd.Stdout, st.cmd.Stderr = &st.log, &st.log // "Events enabled", or why it failed
	if err := st.cmd.Start(); err != nil {
		st.close()
		return nil, fmt.Errorf("starting perf: %w", err)
	}
	go func() { st.cmd.Wait(); close(st.exited) }()
	return st, nil
}

// command sends perf a control command (enable, disable) and waits for
// its acknowledgement.
func (st *perfStat) command(c string) error {
	if _, err := st.ctl.WriteString(c + "\n"); err != nil {
		return err
	}
	st.ack.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 16)
	n, err := st.ack.Read(buf)
	if err != nil {
		return fmt.Errorf("perf did not acknowledge %s: %w (%s)", c, err, bytes.TrimSpace(st.log.Bytes()))
	}
	if strings.Trim(string(buf[:n]), "\x00\n") != "ack" {
		return fmt.Errorf("perf answered %q to %s", buf[:n], c)
	}
	return nil
}

// stop disables the counters, ends perf and returns its counts by
// perfEvents' column.
func (st *perfStat) stop() (map[string]float64, error) {
	if err := st.command("disable"); err != nil {
		return nil, err
	}
	st.cmd.Process.Signal(os.Interrupt)
	<-st.exited
	b, err := os.ReadFile(st.out)
	if err != nil {
		return nil, err
	}
	counts := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		// value,unit,event,...; "<not counted>" values are left out.
		f := strings.Split(line, ",")
		if len(f) < 3 || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		for _, e := range perfEvents {
			if e.event == f[2] {
				counts[e.column] = v
			}
		}
	}
	if len(counts) == 0 {
		return nil, fmt.Errorf("perf stat counted nothing:\n%s", b)
	}
	return counts, nil
}

func (st *perfStat) close() {
	if st.cmd != nil && st.cmd.Process != nil {
		select {
		case <-st.exited:
		default:
			st.cmd.Process.Kill()
			<-st.exited
		}
	}
	if st.ctl != nil {
		st.ctl.Close()
	}
	if st.ack != nil {
		st.ack.Close()
	}
	os.RemoveAll(st.dir)
}

// reportSyscalls writes, per path with its own process, the system calls
// and context switches of that process per measured request.
func reportSyscalls(w io.Writer, paths []string, counts map[string]map[string]float64, n int) {
	if len(counts) == 0 || n == 0 {
		return
	}
	fmt.Fprintln(w, "\nSystem calls and context switches of the proxy's process per request (perf stat):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "path\t")
	for _, e := range perfEvents {
		fmt.Fprintf(tw, "%s\t", e.column)
	}
	fmt.Fprintln(tw)
	for _, p := range paths {
		c, ok := counts[p]
		if !ok {
			continue
		}
		fmt.Fprintf(tw, "%s\t", p)
		for _, e := range perfEvents {
			fmt.Fprintf(tw, "%.2f\t", c[e.column]/float64(n))
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}
