package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/engine/cost"
	"github.com/batonllm/baton/workers/sim"
)

// simFlags are the simulated engine's flags, shared by worker and demo.
type simFlags struct {
	model, gpu, served   string
	tp                   int
	mfu, timeScale       float64
	blocks               int64
	maxRunning, maxBatch int
	role                 string
	kvScale              int
	cpuBlocks            int64
	storePolicy          string
	redis                string
	redisTLS             [3]string // --redis-ca-file, --redis-cert-file, --redis-key-file
	warmupTopK           int
	loraModules          string // --lora-modules name=MiB,...
	maxLoRAs             int
	store                transfer.Store // set by the caller from redis
}

func (f *simFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.model, "model-preset", "llama-3.1-8b", "model whose cost is simulated: llama-3.1-8b, llama-3.1-70b")
	fs.StringVar(&f.gpu, "gpu", "h100", "GPU preset: h100, h200")
	fs.IntVar(&f.tp, "tp", 0, "tensor-parallel degree (default 1)")
	fs.Float64Var(&f.mfu, "mfu", 0, "fraction of peak FLOP/s prefill reaches (default 0.5)")
	fs.Float64Var(&f.timeScale, "time-scale", 1, "run the modelled clock this many times faster than real time")
	fs.StringVar(&f.served, "served-model-name", "", "comma-separated model names served (default: the preset's name)")
	fs.Int64Var(&f.blocks, "kv-blocks", 0, "GPU KV capacity in blocks of 16 tokens (default: from GPU memory minus weights)")
	fs.IntVar(&f.maxRunning, "max-running", 0, "maximum running sequences (default 256)")
	fs.IntVar(&f.maxBatch, "max-batched-tokens", 0, "token budget of one engine step (default 8192)")
	fs.IntVar(&f.kvScale, "kv-scale", 0, "divide real KV block sizes by this for transfers, so loopback fleets stay small (default 64; 1 = real sizes)")
	fs.Int64Var(&f.cpuBlocks, "cpu-blocks", 0, "CPU (host memory) KV tier in blocks of 16 tokens (default: 256 GiB of real KV; -1 = no CPU tier)")
	fs.StringVar(&f.storePolicy, "store-policy", sim.PolicyDemotion, "when blocks are written to the shared tier: demotion (when they leave the local tiers) or write-through")
	fs.IntVar(&f.warmupTopK, "warmup-top-k", 0, "at start, warm the KV cache with the blocks of the fleet's `N` hottest prefixes from the shared tier (e.g. 32; 0 = off); NOT_SERVING until done, within 10s")
	fs.StringVar(&f.redis, "redis", "", "shared KV tier: Redis `URL` (host:port or redis[s]://[user[:password]@]host[:port][/db]), behind a breaker; a refused password or certificate stops the start")
	fs.StringVar(&f.redisTLS[0], "redis-ca-file", "", "PEM CA certificate `file` that signs a rediss:// server's certificate (default: the system roots)")
	fs.StringVar(&f.redisTLS[1], "redis-cert-file", "", "PEM client certificate `file` for a rediss:// server that requires one (tls-auth-clients)")
	fs.StringVar(&f.redisTLS[2], "redis-key-file", "", "PEM private key `file` of --redis-cert-file")
	fs.StringVar(&f.loraModules, "lora-modules", "", "LoRA adapters of the first served model the worker can load, as `name=MiB,...` (their size, from which the load time over the host link is modelled)")
	fs.IntVar(&f.maxLoRAs, "max-loras", 0, "LoRA adapters held at once, the least recently used evicted past it (default 1)")
}

// check rejects flag values out of range, naming the flag. In sim.Config
// zero means the default; typed on the command line it is out of range,
// unless the flag's help gives it a meaning.
func (f *simFlags) check(fs *flag.FlagSet) error {
	set := setFlags(fs)
	switch {
	case set["tp"] && f.tp < 1:
		return fmt.Errorf("--tp: must be at least 1, got %d", f.tp)
	case set["mfu"] && !(f.mfu > 0 && f.mfu <= 1):
		return fmt.Errorf("--mfu: must be in (0, 1], got %v", f.mfu)
	case !(f.timeScale > 0):
		return fmt.Errorf("--time-scale: must be positive, got %v", f.timeScale)
	case set["kv-blocks"] && f.blocks < 1:
		return fmt.Errorf("--kv-blocks: must be at least 1, got %d", f.blocks)
	case set["max-running"] && f.maxRunning < 1:
		return fmt.Errorf("--max-running: must be at least 1, got %d", f.maxRunning)
	case set["max-batched-tokens"] && f.maxBatch < 1:
		return fmt.Errorf("--max-batched-tokens: must be at least 1, got %d", f.maxBatch)
	case set["kv-scale"] && f.kvScale < 1:
		return fmt.Errorf("--kv-scale: must be at least 1, got %d", f.kvScale)
	case set["cpu-blocks"] && f.cpuBlocks < 1 && f.cpuBlocks != -1:
		return fmt.Errorf("--cpu-blocks: must be at least 1, or -1 for no CPU tier, got %d", f.cpuBlocks)
	case f.warmupTopK < 0:
		return fmt.Errorf("--warmup-top-k: must not be negative, got %d", f.warmupTopK)
	case set["max-loras"] && f.maxLoRAs < 1:
		return fmt.Errorf("--max-loras: must be at least 1, got %d", f.maxLoRAs)
	}
	if _, err := f.adapters(nil); err != nil {
		return err
	}
	flags := map[string]string{"models": "served-model-name", "role": "role", "time_scale": "time-scale",
		"kv_scale": "kv-scale", "cost.model": "model-preset", "cost.gpu": "gpu", "cost.tp": "tp", "cost.mfu": "mfu",
		"batching.max_running": "max-running", "batching.max_batched_tokens": "max-batched-tokens",
		"tiers.gpu_blocks": "kv-blocks", "tiers.cpu_blocks": "cpu-blocks", "tiers.store_policy": "store-policy",
		"warmup.top_k": "warmup-top-k", "lora.max_loras": "max-loras"}
	if err := f.config("").Validate(); err != nil {
		return renameField(err, func(field string) string {
			if name, ok := flags[field]; ok && fs.Lookup(name) != nil {
				return "--" + name
			}
			return ""
		})
	}
	return nil
}

// redisFlags maps RedisConfig's TLS fields to their flags.
var redisFlags = map[string]string{"redis.tls_ca_file": "--redis-ca-file", "redis.tls_cert_file": "--redis-cert-file", "redis.tls_key_file": "--redis-key-file"}

// openStore opens the Redis tier --redis names, behind a breaker, or
// returns nil without one. The caller closes it. opts observe the breaker.
// A server that refuses the password or the TLS settings is an error; one
// that does not answer is not (the breaker bypasses it until it does).
func (f *simFlags) openStore(opts ...kvstore.BreakerOption) (transfer.Store, error) {
	if f.redis == "" {
		if f.redisTLS != [3]string{} {
			return nil, errors.New("--redis-ca-file, --redis-cert-file, --redis-key-file: set without --redis")
		}
		return nil, nil
	}
	cfg, err := kvstore.ParseRedisURL(f.redis)
	if err != nil {
		return nil, fmt.Errorf("--redis: %w", err)
	}
	cfg.TLSCAFile, cfg.TLSCertFile, cfg.TLSKeyFile = f.redisTLS[0], f.redisTLS[1], f.redisTLS[2]
	r, err := kvstore.NewRedis(cfg)
	if err != nil {
		return nil, renameField(err, func(field string) string {
			if name, ok := redisFlags[field]; ok {
				return name
			}
			return "--redis"
		})
	}
	ctx, cancel := context.WithTimeout(context.Background(), redisCheckTimeout)
	err = r.Check(ctx)
	cancel()
	if errors.Is(err, kvstore.ErrRefused) {
		r.Close()
		return nil, fmt.Errorf("--redis: %w", err)
	}
	return kvstore.NewBreaker(r, kvstore.BreakerConfig{Name: "redis"}, opts...), nil
}

// redisCheckTimeout bounds the PING at start that checks the password and
// TLS settings.
const redisCheckTimeout = 2 * time.Second

func (f *simFlags) config(name string) sim.Config {
	c := sim.Config{
		Name: name, Role: f.role, TimeScale: f.timeScale, KVScale: f.kvScale,
		Cost:     cost.Config{Model: f.model, GPU: f.gpu, TP: f.tp, MFU: f.mfu},
		Batching: sim.Batching{MaxRunning: f.maxRunning, MaxBatchedTokens: f.maxBatch},
		Tiers:    sim.Tiers{GPUBlocks: f.blocks, CPUBlocks: f.cpuBlocks, StorePolicy: f.storePolicy, Store: f.store},
		Warmup:   sim.Warmup{TopK: f.warmupTopK},
	}
	if f.served != "" {
		c.Models = strings.Split(f.served, ",")
	}
	base := c.WithDefaults().Models[0]
	c.LoRA.Adapters, _ = f.adapters(&base)
	c.LoRA.MaxLoRAs = f.maxLoRAs
	return c
}

// adapters parses --lora-modules into adapters of base (nil: not known
// yet, for checking).
func (f *simFlags) adapters(base *string) ([]engine.Adapter, error) {
	if f.loraModules == "" {
		return nil, nil
	}
	var out []engine.Adapter
	for _, m := range strings.Split(f.loraModules, ",") {
		name, mib, ok := strings.Cut(m, "=")
		n, err := strconv.ParseInt(mib, 10, 64)
		if !ok || name == "" || err != nil || n < 0 {
			return nil, fmt.Errorf("--lora-modules: %q is not name=MiB", m)
		}
		a := engine.Adapter{Name: name, Bytes: n << 20}
		if base != nil {
			a.Base = *base
		}
		out = append(out, a)
	}
	return out, nil
}

func worker(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("worker", "[flags]\n\nRuns a simulated engine worker.")
	var f simFlags
	f.register(fs)
	listen := fs.String("listen", "127.0.0.1:9000", "gRPC listen `address` (the worker API and gRPC health)")
	httpListen := fs.String("http-listen", "", "listen `address` of the worker's own OpenAI-compatible HTTP API (off when empty)")
	name := fs.String("name", "", "worker name (default: the listen address)")
	fs.StringVar(&f.role, "role", "both", "role in disaggregated serving: both (colocated), prefill or decode")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	metricsListen := fs.String("metrics-listen", "", "listen `address` of the worker's Prometheus /metrics (off when empty)")
	pprofListen := fs.String("pprof-listen", "", "loopback listen `address` of net/http/pprof under /debug/pprof/ (off when empty)")
	var tlsCfg tlsconf.Config
	fs.StringVar(&tlsCfg.CertFile, "tls-cert-file", "", "serve gRPC over TLS with this PEM certificate `file`, also presented to the workers KV blocks are pushed to; re-read when it changes")
	fs.StringVar(&tlsCfg.KeyFile, "tls-key-file", "", "PEM private key `file` of --tls-cert-file")
	fs.StringVar(&tlsCfg.CAFile, "tls-ca-file", "", "PEM CA certificate `file`: only clients (schedulers, workers pushing KV blocks) with a certificate it signed are served, and the workers KV blocks are pushed to must have one")
	fs.StringVar(&tlsCfg.ServerName, "tls-server-name", "", "`name` the certificates of the workers KV blocks are pushed to must hold (default: the host of their address)")
	var httpTLS tlsconf.Config
	fs.StringVar(&httpTLS.CertFile, "http-tls-cert-file", "", "serve --http-listen over HTTPS with this PEM certificate `file` (chain), re-read when it changes or on SIGHUP")
	fs.StringVar(&httpTLS.KeyFile, "http-tls-key-file", "", "PEM private key `file` of --http-tls-cert-file")
	fs.StringVar(&httpTLS.CAFile, "http-tls-ca-file", "", "PEM CA certificate `file`: --http-listen serves only clients with a certificate it signed")
	drainTimeout := fs.Duration("drain-timeout", 30*time.Second, "on SIGTERM or SIGINT, how long running sequences may finish (NOT_SERVING, new ones refused) before the worker writes its hottest blocks to the shared tier and exits")
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	if err := f.check(fs); err != nil {
		return err
	}
	if err := tlsCfg.Validate("tls", true); err != nil {
		return tlsFlagError("tls", err)
	}
	if err := httpTLS.Validate("http_tls", true); err != nil {
		return tlsFlagError("http-tls", err)
	}
	if httpTLS.Enabled() && *httpListen == "" {
		return errors.New("--http-tls-cert-file: set without --http-listen")
	}
	if *drainTimeout <= 0 {
		return fmt.Errorf("--drain-timeout: must be positive, got %s", *drainTimeout)
	}
	if *pprofListen != "" {
		if err := loopbackAddr(*pprofListen); err != nil {
			return fmt.Errorf("--pprof-listen: %w", err)
		}
	}
	log, err := newLogger(stderr, *logLevel)
	if err != nil {
		return err
	}
	if *name == "" {
		*name = *listen
	}
	// The breaker's transitions are logged and counted even without a
	// metrics listener: a Redis outage must leave a trace.
	metrics := sim.NewMetrics(log)
	if f.store, err = f.openStore(metrics.StoreOptions("redis")...); err != nil {
		return err
	}
	if f.store != nil {
		defer f.store.Close()
	}
	var startOpts []sim.StartOption
	var certs []*tlsconf.Certificate // what SIGHUP reloads
	if tlsCfg.Enabled() {
		server, cert, err := tlsconf.Server(tlsCfg, log)
		if err != nil {
			return tlsFlagError("tls", err)
		}
		client, ccert, err := tlsconf.Client(tlsCfg, log)
		if err != nil {
			return tlsFlagError("tls", err)
		}
		startOpts = append(startOpts, sim.WithTLS(server, client))
		certs = append(certs, cert)
		if ccert != nil {
			certs = append(certs, ccert)
		}
	}
	if httpTLS.Enabled() {
		server, cert, err := tlsconf.Server(httpTLS, log)
		if err != nil {
			return tlsFlagError("http-tls", err)
		}
		startOpts = append(startOpts, sim.WithHTTPTLS(server))
		certs = append(certs, cert)
	}
	w, err := sim.Start(f.config(*name), *listen, *httpListen, log, startOpts...)
	if err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	defer w.Close()
	metrics.Engine(w.Engine)
	defer reloadCertsOnHangup(certs, log)()
	var metricsSrv, pprofSrv *debugServer
	if *metricsListen != "" {
		if metricsSrv, err = serveDebug("metrics-listen", *metricsListen, metricsHandler(metrics), log); err != nil {
			return err
		}
		defer metricsSrv.Close()
	}
	if *pprofListen != "" {
		if pprofSrv, err = serveDebug("pprof-listen", *pprofListen, pprofHandler(), log); err != nil {
			return err
		}
		defer pprofSrv.Close()
	}
	log.Info("worker listening", "name", *name, "grpc", w.GRPCAddr, "tls", tlsCfg.Enabled(), "mutual_tls", tlsCfg.CAFile != "", "http", w.HTTPAddr, "http_tls", httpTLS.Enabled(), "model", f.model, "gpu", f.gpu, "time_scale", f.timeScale, "redis_tier", f.store != nil,
		"metrics", debugAddr(metricsSrv), "pprof", debugAddr(pprofSrv))
	go logWarmup(ctx, w.Engine, log)
	<-ctx.Done()
	log.Info("worker draining", "running", w.Engine.Load().Running, "waiting", w.Engine.Load().Waiting, "timeout", *drainTimeout)
	start := time.Now()
	dctx, cancel := context.WithTimeout(context.Background(), *drainTimeout)
	res := w.Drain(dctx)
	cancel()
	if res.Left > 0 {
		log.Warn("drain timed out; stopping with calls running", "left", res.Left)
	}
	log.Info("worker drained", "duration", time.Since(start).Round(time.Millisecond), "hot_blocks_written", res.HotBlocks)
	return nil
}

// tlsFlagError names worker's TLS flag in a tlsconf error that names its
// field (tls.cert_file, http_tls.cert_file or cert_file: --prefix-cert-file).
func tlsFlagError(prefix string, err error) error {
	return renameField(err, func(field string) string {
		if i := strings.LastIndexByte(field, '.'); i >= 0 {
			field = field[i+1:]
		}
		return "--" + prefix + "-" + strings.ReplaceAll(field, "_", "-")
	})
}

// reloadCertsOnHangup reads certs again on each SIGHUP, as baton serve
// does, until the returned stop is called. Without certs SIGHUP keeps its
// default action.
func reloadCertsOnHangup(certs []*tlsconf.Certificate, log *slog.Logger) (stop func()) {
	if len(certs) == 0 {
		return func() {}
	}
	return onHangup(func() {
		var failed bool
		for _, c := range certs {
			if err := c.Reload(); err != nil {
				failed = true
				log.Error("tls certificate not reloaded; the previous one stays", "err", err)
			}
		}
		if !failed {
			log.Info("TLS certificates reloaded on SIGHUP")
		}
	})
}

// debugAddr returns s's bound address, or "" without s.
func debugAddr(s *debugServer) string {
	if s == nil {
		return ""
	}
	return s.addr
}

// logWarmup logs what the start-up warm-up warmed, once it ends (if the
// worker has one).
func logWarmup(ctx context.Context, e *sim.Engine, log *slog.Logger) {
	cfg := e.Config()
	if cfg.Warmup.TopK == 0 || cfg.Tiers.Store == nil {
		return
	}
	select {
	case <-e.WarmupDone():
	case <-ctx.Done():
		return
	}
	st := e.Stats()
	log.Info("warm-up done", "top_k", cfg.Warmup.TopK, "prefixes_listed", st.WarmupPrefixes,
		"prefixes_warmed", st.WarmedPrefixes, "blocks_warmed", st.WarmedBlocks)
}
