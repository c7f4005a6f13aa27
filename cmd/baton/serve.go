package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// schedulerFlags are the flags serve and demo share; set ones override the
// config file.
type schedulerFlags struct {
	config    string
	listen    string
	strategy  string
	threshold int
	prefixLen int
	logLevel  string
	drain     time.Duration
	workers   workerList // serve's --worker flags
	tlsCert   string     // --tls-cert-file (serve, demo)
	tlsKey    string     // --tls-key-file (serve, demo)
	pprof     string     // --pprof-listen
}

// tlsFlags maps serve's TLS flags to their config fields.
var tlsFlags = map[string]string{"tls-cert-file": "tls.cert_file", "tls-key-file": "tls.key_file"}

// register defines the flags on fs, with the command's own defaults.
func (f *schedulerFlags) register(fs *flag.FlagSet, defaultListen, defaultStrategy string) {
	fs.StringVar(&f.config, "config", "", "YAML configuration `file` (see docs/configuration.md); set flags override it")
	fs.StringVar(&f.listen, "listen", defaultListen, "HTTP listen `address`")
	fs.StringVar(&f.strategy, "strategy", defaultStrategy, "routing strategy, by `name`: "+strings.Join(strategyNames(), ", "))
	fs.IntVar(&f.threshold, "concurrency-threshold", 0, "in-flight requests at which prefix_aware and kv_aware spill to a less busy worker, 1–1024 (default 16)")
	fs.IntVar(&f.prefixLen, "prefix-length", 0, "characters (bytes on /invocations) of routing text prefix_aware hashes, 1024–65536 (default 4096)")
	fs.StringVar(&f.logLevel, "log-level", "", "log level: debug, info, warn, error (default info)")
	fs.DurationVar(&f.drain, "drain-timeout", 0, "on SIGTERM or SIGINT, how long requests in flight may finish before they are interrupted (default 30s)")
	fs.StringVar(&f.pprof, "pprof-listen", "", "loopback listen `address` of net/http/pprof under /debug/pprof/ (off when empty)")
}

// servePprof serves net/http/pprof on --pprof-listen, if set, until the
// returned stop is called.
func (f *schedulerFlags) servePprof(log *slog.Logger) (stop func(), err error) {
	if f.pprof == "" {
		return func() {}, nil
	}
	if err := loopbackAddr(f.pprof); err != nil {
		return nil, fmt.Errorf("--pprof-listen: %w", err)
	}
	srv, err := serveDebug("pprof-listen", f.pprof, pprofHandler(), log)
	if err != nil {
		return nil, err
	}
	log.Info("pprof listening", "addr", srv.addr)
	return srv.Close, nil
}

// registerTLS defines the front end's TLS flags on fs.
func (f *schedulerFlags) registerTLS(fs *flag.FlagSet) {
	fs.StringVar(&f.tlsCert, "tls-cert-file", "", "serve HTTPS with this PEM certificate `file` (chain), re-read when it changes or on SIGHUP (config tls.cert_file)")
	fs.StringVar(&f.tlsKey, "tls-key-file", "", "PEM private key `file` of --tls-cert-file (config tls.key_file)")
}

// load reads the config file, if any, and applies the flags set on fs,
// the listen address and strategy also when the file leaves them unset.
func (f *schedulerFlags) load(fs *flag.FlagSet) (scheduler.Config, error) {
	var cfg scheduler.Config
	if f.config != "" {
		var err error
		if cfg, err = scheduler.LoadConfig(f.config); err != nil {
			return cfg, fmt.Errorf("--config: %w", err)
		}
	}
	set := setFlags(fs)
	if set["listen"] || cfg.Listen == "" {
		cfg.Listen = f.listen
	}
	if set["strategy"] || cfg.Strategy == "" {
		cfg.Strategy = f.strategy
	}
	// In the config file zero means "default"; on the command line it is a
	// value the user typed, and out of range.
	if set["concurrency-threshold"] {
		if f.threshold == 0 {
			return cfg, errors.New("--concurrency-threshold: must be 1–1024, got 0")
		}
		cfg.ConcurrencyThreshold = f.threshold
	}
	if set["prefix-length"] {
		if f.prefixLen == 0 {
			return cfg, errors.New("--prefix-length: must be 1024–65536, got 0")
		}
		cfg.PrefixLength = f.prefixLen
	}
	if set["log-level"] {
		cfg.LogLevel = f.logLevel
	}
	if set["drain-timeout"] {
		if f.drain <= 0 {
			return cfg, fmt.Errorf("--drain-timeout: must be positive, got %s", f.drain)
		}
		cfg.DrainTimeout = f.drain
	}
	if set["tls-cert-file"] {
		cfg.TLS.CertFile = f.tlsCert
	}
	if set["tls-key-file"] {
		cfg.TLS.KeyFile = f.tlsKey
	}
	cfg.Workers = append(cfg.Workers, f.workers.workers...)
	return cfg, nil
}

// check validates cfg as the scheduler will. Its error names the flag
// that set the bad field, or the config file and the field. A demo adds
// its workers later: withoutWorkers skips the rule that there be some.
func (f *schedulerFlags) check(fs *flag.FlagSet, cfg scheduler.Config, withoutWorkers bool) error {
	if withoutWorkers && len(cfg.Workers) == 0 {
		cfg.Workers = []scheduler.WorkerConfig{{Address: "127.0.0.1:1"}}
	}
	err := cfg.Validate(strategies())
	if err == nil {
		return nil
	}
	set := setFlags(fs)
	fromFile := len(cfg.Workers) - len(f.workers.workers)
	err = renameField(err, func(field string) string {
		if i, ok := workerIndex(field); ok && i >= fromFile {
			return fmt.Sprintf("--worker %s", f.workers.raw[i-fromFile])
		}
		if field == "workers" && fs.Lookup("worker") != nil {
			return "--worker"
		}
		for name, f := range tlsFlags {
			if (set["tls-cert-file"] || set["tls-key-file"]) && field == f {
				return "--" + name
			}
		}
		for _, name := range []string{"listen", "strategy", "concurrency-threshold", "prefix-length", "log-level", "drain-timeout"} {
			if set[name] && field == strings.ReplaceAll(name, "-", "_") {
				return "--" + name
			}
		}
		return ""
	})
	if f.config != "" && !strings.HasPrefix(err.Error(), "--") {
		return fmt.Errorf("--config: %s: %w", f.config, err)
	}
	return err
}

// workerIndex returns i of a field workers[i] or workers[i].name.
func workerIndex(field string) (int, bool) {
	rest, ok := strings.CutPrefix(field, "workers[")
	if !ok {
		return 0, false
	}
	n, _, ok := strings.Cut(rest, "]")
	if !ok {
		return 0, false
	}
	i, err := strconv.Atoi(n)
	return i, err == nil
}

// workerList is a repeatable --worker flag: [name=]address, with an
// http:// address meaning an OpenAI-compatible HTTP engine.
type workerList struct {
	workers []scheduler.WorkerConfig
	raw     []string // the flags' values, for errors
}

func (l *workerList) String() string { return fmt.Sprint(len(l.workers), " workers") }

func (l *workerList) Set(v string) error {
	l.raw = append(l.raw, v)
	var w scheduler.WorkerConfig
	if name, addr, ok := strings.Cut(v, "="); ok {
		w.Name, v = name, addr
	}
	w.Address = v
	w.Kind = scheduler.KindGRPC
	if strings.HasPrefix(v, "http://") || strings.HasPrefix(v, "https://") {
		w.Kind = scheduler.KindHTTP
	}
	l.workers = append(l.workers, w)
	return nil
}

// strategyNames lists every built-in strategy.
func strategyNames() []string {
	return strategies().Names()
}

func strategies() *routing.Registry {
	r := &routing.Registry{}
	routing.RegisterBuiltins(r)
	return r
}

func serve(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("serve", "[flags]\n\nRuns the scheduler in front of the workers of --config and --worker.")
	var f schedulerFlags
	f.register(fs, scheduler.DefaultListen, scheduler.DefaultStrategy)
	fs.Var(&f.workers, "worker", "a worker, `[name=]host:port` (baton gRPC) or [name=]http://host:port (OpenAI-compatible engine); repeatable, added to the config's workers")
	f.registerTLS(fs)
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	cfg, err := f.load(fs)
	if err != nil {
		return err
	}
	if err := f.check(fs, cfg, false); err != nil {
		return err
	}
	log, err := newLogger(stderr, cfg.WithDefaults().LogLevel)
	if err != nil {
		return err
	}
	stopPprof, err := f.servePprof(log)
	if err != nil {
		return err
	}
	defer stopPprof()
	return runScheduler(ctx, cfg, stdout, stderr, nil)
}

// runScheduler runs a scheduler until ctx is done, then drains it. ready,
// if not nil, is called with the bound address once it listens.
func runScheduler(ctx context.Context, cfg scheduler.Config, stdout, stderr io.Writer, ready func(addr string)) error {
	log, err := newLogger(stderr, cfg.WithDefaults().LogLevel)
	if err != nil {
		return err
	}
	s, err := scheduler.New(cfg, strategies(), log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	defer s.Close()
	cfg = cfg.WithDefaults()
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	log.Info("scheduler listening", "addr", l.Addr().String(), "tls", s.TLS(), "strategy", cfg.Strategy, "workers", len(cfg.Workers), "discovery", cfg.WithDefaults().Discovery.Mode)
	if ready != nil {
		ready(l.Addr().String())
	}
	stopReload := reloadOnHangup(s, log)
	defer stopReload()
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	s.Drain()
	return <-errc
}

// reloadOnHangup reloads s's API keys and TLS certificates on each SIGHUP
// until the returned stop is called.
func reloadOnHangup(s *scheduler.Scheduler, log *slog.Logger) (stop func()) {
	return onHangup(func() {
		if s.ReloadCertificates() == nil && s.TLS() {
			log.Info("TLS certificates reloaded on SIGHUP")
		} // a failed reload logs its own error
		switch {
		case s.Auth == nil:
			log.Info("SIGHUP ignored: no API keys configured")
		case s.ReloadKeys() == nil:
			log.Info("API keys reloaded on SIGHUP")
		} // a failed reload logs its own error
	})
}

// onHangup calls reload on each SIGHUP, one call at a time, until the
// returned stop is called; stop returns once no call runs.
func onHangup(reload func()) (stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		for {
			select {
			case <-hup:
				reload()
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(hup)
		close(done)
		<-exited
	}
}
