package scheduler

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/internal/auth"
	"github.com/batonllm/baton/scheduler/internal/strictyaml"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/workers/engine"
)

// Worker kinds: how the scheduler talks to a worker.
const (
	// KindGRPC is a baton worker (baton worker), driven over the worker gRPC
	// API.
	KindGRPC = "grpc"
	// KindHTTP is any OpenAI-compatible HTTP engine (vLLM, SGLang,
	// llama.cpp's llama-server); its responses are relayed as they come.
	KindHTTP = "http"
	// KindVLLM and KindSGLang are those engines served as http ones, whose
	// load the scheduler also scrapes from their metrics and whose KV
	// cache events it follows (WorkerConfig.Events).
	KindVLLM   = "vllm"
	KindSGLang = "sglang"
	// KindLlamaCPP is llama.cpp's llama-server served as an http engine,
	// whose load and slots the scheduler also reads (/metrics or /slots,
	// /props) and whose requests set cache_prompt.
	KindLlamaCPP = "llamacpp"
)

// WorkerConfig is one statically configured worker.
type WorkerConfig struct {
	// Name identifies the worker in headers, metrics and logs. Default: its
	// address.
	Name string `yaml:"name"`
	// Address is host:port for grpc workers, a base URL (http://host:port)
	// for http, vllm and sglang engines. Required.
	Address string `yaml:"address"`
	// Kind is grpc (default), http, vllm, sglang or llamacpp.
	Kind string `yaml:"kind"`
	// Models the worker serves. Empty: any model (grpc workers are asked at
	// start).
	Models []string `yaml:"models"`
	// Role is both (prefill and decode: colocated serving), prefill or
	// decode. Empty: grpc workers are asked at start; http engines are both.
	Role string `yaml:"role"`
	// CachePrompts is the prompts an engine that publishes no KV cache
	// events keeps cached at once, which bounds what kv_aware learns it
	// holds: llama-server's slots (--parallel), or more with its
	// --cache-ram. Default 0: what the engine says (llama-server's
	// /props), else only its KV capacity bounds it.
	CachePrompts int `yaml:"cache_prompts"`
	// Cost is the engine's cost figures, as baton calibrate prints them,
	// from which kv_aware estimates its time to first token. Default: the
	// simulated engine's (Llama-3.1-8B on one H100), which kv_aware's
	// online correction then scales. Baton workers report their own.
	Cost CostConfig `yaml:"cost"`
	// MaxLoRAs is how many LoRA adapters (adapters:) the scheduler loads
	// onto the worker at once, evicting the least recently used past it:
	// vLLM's --max-loras, or a baton worker's lora.max_loras. Default 0:
	// it loads none there (the worker serves those it holds).
	MaxLoRAs int `yaml:"max_loras"`
	// TLS is how an http, vllm, sglang or llamacpp worker's https address
	// is reached: ca_file verifies the engine's certificate (a private
	// CA; default: the system roots), which must name server_name or
	// else the host of the address; cert_file and key_file are the
	// scheduler's client certificate, for an engine that requires one.
	// Every HTTP call to the engine uses it; its ZeroMQ KV events are
	// not encrypted. grpc workers use worker_tls.
	TLS tlsconf.Config `yaml:"tls"`

	EngineConfig `yaml:",inline"`

	// rank is the data-parallel rank this worker routes to, set by ranks.
	rank int
}

// EngineConfig holds the fields of vllm and sglang workers: where the
// scheduler reads their load and KV cache events. Workers of other kinds
// must leave it empty.
type EngineConfig struct {
	// Events is the engine's ZeroMQ KV event endpoint, as
	// tcp://10.0.0.7:5557 (the host of the engine's --kv-events-config
	// endpoint tcp://*:5557). Empty: the engine publishes none, and only
	// its load is known.
	Events string `yaml:"events"`
	// EventsReplay is the engine's replay endpoint (its replay_endpoint),
	// from which missed events are fetched. Empty: a gap drops what the
	// index knew of the engine's blocks until they are stored again.
	EventsReplay string `yaml:"events_replay"`
	// EventsTopic is the topic the engine publishes under (its topic);
	// default "", every message.
	EventsTopic string `yaml:"events_topic"`
	// EventsBind makes the scheduler listen on Events for the engine to
	// connect out to (an engine endpoint naming the scheduler's host)
	// rather than dial the engine.
	EventsBind bool `yaml:"events_bind"`
	// MetricsPath is where the engine serves Prometheus metrics. Default
	// /metrics.
	MetricsPath string `yaml:"metrics_path"`
	// MetricsInterval is the time between two scrapes of the metrics, which
	// give the engine's load (running and waiting requests, KV cache
	// usage). Default 250ms: a few decode steps' worth of staleness.
	MetricsInterval time.Duration `yaml:"metrics_interval"`
	// MetricsTimeout bounds one scrape. Default 1s.
	MetricsTimeout time.Duration `yaml:"metrics_timeout"`
	// BlockSize is the engine's tokens per KV block (vLLM's --block-size,
	// SGLang's --page-size). Default: the engine's metrics say (vLLM's
	// cache_config_info), else its events, else 16.
	BlockSize int `yaml:"block_size"`
	// TokenizePath is the engine's tokenize endpoint (vLLM's POST
	// /tokenize), from which a strategy that routes on keys gets a
	// request's tokens, to key it as the engine's events are keyed.
	// Default /tokenize; "none": requests are keyed by their text and match
	// only the scheduler's own predictions. Only the first vllm or sglang
	// worker's settings are used: the fleet's requests are keyed once.
	TokenizePath string `yaml:"tokenize_path"`
	// TokenizeTimeout bounds one tokenize call; past it the request is
	// keyed by its text. Default 250ms.
	TokenizeTimeout time.Duration `yaml:"tokenize_timeout"`
	// TokenizeCacheTokens bounds the tokens of recent prompts kept so that
	// a repeated prompt costs no call. Default 4Mi tokens (16 MiB); -1: no
	// cache.
	TokenizeCacheTokens int `yaml:"tokenize_cache_tokens"`
	// BootstrapHost and BootstrapPort are where an sglang prefill worker's
	// bootstrap server listens (its --disaggregation-bootstrap-port),
	// which its decode workers reach to pair with it. Default: the host
	// of its address, port 8998.
	BootstrapHost string `yaml:"bootstrap_host"`
	BootstrapPort int    `yaml:"bootstrap_port"`
	// DataParallelSize is a vllm engine's --data-parallel-size (an sglang
	// engine's --dp-size, of role both): its ranks keep KV caches of their
	// own, and baton routes to each as a worker named <name>/dp<rank>, by
	// the X-data-parallel-rank header, with the events of the rank
	// (published on the events and events_replay ports plus the rank) and
	// the load of its engine="<rank>" (sglang: dp_rank="<rank>") metrics.
	// In discovery.worker, every endpoint found is such an engine, its
	// ranks named <endpoint's name>/dp<rank>, joining and leaving
	// together. Default 1.
	DataParallelSize int `yaml:"data_parallel_size"`
}

// CostConfig is an engine's cost figures (see workers/engine/cost.Figures);
// each zero field keeps the default's.
type CostConfig struct {
	// FLOPS is the effective compute of a prefill, FLOP/s.
	FLOPS float64 `yaml:"flops"`
	// DecodeStepSeconds is one decode step at batch 1, short context.
	DecodeStepSeconds float64 `yaml:"decode_step_seconds"`
	// HBMBytesPerSecond is the bandwidth at which each step reads the KV
	// of the sequences decoded.
	HBMBytesPerSecond float64 `yaml:"hbm_bytes_per_second"`
	// Layers and Hidden are the model's, which the prefill formula uses;
	// KVBytesPerBlock is a block's KV bytes.
	Layers          int   `yaml:"layers"`
	Hidden          int   `yaml:"hidden"`
	KVBytesPerBlock int64 `yaml:"kv_bytes_per_block"`
	// MaxBatchedTokens is a step's token budget.
	MaxBatchedTokens int `yaml:"max_batched_tokens"`
}

// Figures returns c over the default figures, and whether any was set.
func (c CostConfig) Figures() (kvindex.Cost, bool) {
	f := kvindex.DefaultCost
	if c == (CostConfig{}) {
		return f, false
	}
	if c.FLOPS > 0 {
		f.FLOPS = c.FLOPS
	}
	if c.DecodeStepSeconds > 0 {
		f.DecodeStepSeconds = c.DecodeStepSeconds
	}
	if c.HBMBytesPerSecond > 0 {
		f.HBMBytesPerSecond = c.HBMBytesPerSecond
	}
	if c.Layers > 0 {
		f.Layers = c.Layers
	}
	if c.Hidden > 0 {
		f.Hidden = c.Hidden
	}
	if c.KVBytesPerBlock > 0 {
		f.KVBytesPerBlock = c.KVBytesPerBlock
	}
	if c.MaxBatchedTokens > 0 {
		f.MaxBatchedTokens = c.MaxBatchedTokens
	}
	return f, true
}

// validate reports the first negative figure of c, prefixed with field.
func (c CostConfig) validate(field string) error {
	switch {
	case c.FLOPS < 0:
		return fmt.Errorf("%s.flops: must be positive, got %v", field, c.FLOPS)
	case c.DecodeStepSeconds < 0:
		return fmt.Errorf("%s.decode_step_seconds: must be positive, got %v", field, c.DecodeStepSeconds)
	case c.HBMBytesPerSecond < 0:
		return fmt.Errorf("%s.hbm_bytes_per_second: must be positive, got %v", field, c.HBMBytesPerSecond)
	case c.Layers < 0 || c.Hidden < 0:
		return fmt.Errorf("%s.layers: layers and hidden must be positive, got %d and %d", field, c.Layers, c.Hidden)
	case c.KVBytesPerBlock < 0:
		return fmt.Errorf("%s.kv_bytes_per_block: must be positive, got %d", field, c.KVBytesPerBlock)
	case c.MaxBatchedTokens < 0:
		return fmt.Errorf("%s.max_batched_tokens: must be positive, got %d", field, c.MaxBatchedTokens)
	}
	return nil
}

// TokenizeNone as a tokenize_path keys requests by their text.
const TokenizeNone = "none"

// validate reports the first invalid field of a vllm or sglang worker,
// prefixed with field.
func (c EngineConfig) validate(field string) error {
	for _, e := range []struct{ name, endpoint string }{{"events", c.Events}, {"events_replay", c.EventsReplay}} {
		if e.endpoint != "" && !strings.HasPrefix(e.endpoint, "tcp://") && !strings.HasPrefix(e.endpoint, "ipc://") {
			return fmt.Errorf("%s.%s: a ZeroMQ endpoint such as tcp://host:5557, got %q", field, e.name, e.endpoint)
		}
	}
	switch {
	case c.Events == "" && (c.EventsReplay != "" || c.EventsTopic != "" || c.EventsBind):
		return fmt.Errorf("%s.events: required with events_replay, events_topic or events_bind", field)
	case c.MetricsPath != "" && !strings.HasPrefix(c.MetricsPath, "/"):
		return fmt.Errorf("%s.metrics_path: must start with /, got %q", field, c.MetricsPath)
	case c.MetricsInterval < 0 || c.MetricsInterval > 0 && c.MetricsInterval < 10*time.Millisecond:
		return fmt.Errorf("%s.metrics_interval: must be at least 10ms, got %s", field, c.MetricsInterval)
	case c.MetricsTimeout < 0:
		return fmt.Errorf("%s.metrics_timeout: must be positive, got %s", field, c.MetricsTimeout)
	case c.BlockSize < 0 || c.BlockSize > 1<<16:
		return fmt.Errorf("%s.block_size: must be 1–65536 tokens, got %d", field, c.BlockSize)
	case c.TokenizePath != "" && c.TokenizePath != TokenizeNone && !strings.HasPrefix(c.TokenizePath, "/"):
		return fmt.Errorf("%s.tokenize_path: must start with / or be %q, got %q", field, TokenizeNone, c.TokenizePath)
	case c.TokenizeTimeout < 0:
		return fmt.Errorf("%s.tokenize_timeout: must be positive, got %s", field, c.TokenizeTimeout)
	case c.TokenizeCacheTokens < -1:
		return fmt.Errorf("%s.tokenize_cache_tokens: must be -1 (no cache) or positive, got %d", field, c.TokenizeCacheTokens)
	case c.BootstrapPort < 0 || c.BootstrapPort > 65535:
		return fmt.Errorf("%s.bootstrap_port: must be 1–65535, got %d", field, c.BootstrapPort)
	case strings.ContainsAny(c.BootstrapHost, "/ "):
		return fmt.Errorf("%s.bootstrap_host: a host name or address, got %q", field, c.BootstrapHost)
	}
	return nil
}

// Worker roles.
const (
	RoleBoth    = "both"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// DisaggConfig tunes disaggregated prefill/decode, which is on when the
// fleet has prefill workers. The zero value means every default.
type DisaggConfig struct {
	// DecodeStrategy picks the decode worker; the top-level strategy picks
	// the prefill worker. Default least_outstanding: decode is
	// memory-bound, so load matters more than prefix there.
	DecodeStrategy string `yaml:"decode_strategy"`
	// MinRemotePrefillTokens: a prompt with fewer tokens left to compute
	// is prefilled on its decode worker and nothing is transferred.
	// Default 512: on the llama-3.1-8b/h100 preset a 512-token prefill
	// takes about 12 ms, two decode steps of the batch it would stall,
	// while the remote path costs two extra calls and a transfer of 64 MiB
	// of KV (about 1.3 ms at 50 GB/s) — below that, the stall is cheaper
	// than the coordination. Set 1 to always transfer.
	MinRemotePrefillTokens int `yaml:"min_remote_prefill_tokens"`
	// TransferTimeout bounds a KV push and the decode worker's wait for
	// it; past it the decode worker recomputes what it lacks. Default 5s.
	TransferTimeout time.Duration `yaml:"transfer_timeout"`
	// PrefillRetries is how many other prefill workers a request tries
	// when its prefill fails, before it prefills on the decode worker.
	// 0–4; default 1; -1 for none.
	PrefillRetries int `yaml:"prefill_retries"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c DisaggConfig) WithDefaults() DisaggConfig {
	if c.DecodeStrategy == "" {
		c.DecodeStrategy = "least_outstanding"
	}
	if c.MinRemotePrefillTokens == 0 {
		c.MinRemotePrefillTokens = 512
	}
	if c.TransferTimeout == 0 {
		c.TransferTimeout = 5 * time.Second
	}
	if c.PrefillRetries == 0 {
		c.PrefillRetries = 1
	} else if c.PrefillRetries < 0 {
		c.PrefillRetries = 0
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c DisaggConfig) Validate(strategies *routing.Registry) error {
	c = c.WithDefaults()
	switch {
	case !slices.Contains(strategies.Names(), c.DecodeStrategy):
		return fmt.Errorf("disaggregation.decode_strategy: unknown strategy %q (known: %s)", c.DecodeStrategy, strings.Join(strategies.Names(), ", "))
	case c.MinRemotePrefillTokens < 1 || c.MinRemotePrefillTokens > 1<<20:
		return fmt.Errorf("disaggregation.min_remote_prefill_tokens: must be 1–1048576, got %d", c.MinRemotePrefillTokens)
	case c.TransferTimeout < 0:
		return fmt.Errorf("disaggregation.transfer_timeout: must be positive, got %s", c.TransferTimeout)
	case c.PrefillRetries > 4:
		return fmt.Errorf("disaggregation.prefill_retries: must be at most 4, got %d", c.PrefillRetries)
	}
	return nil
}

// Config is the scheduler's whole configuration, as read from YAML. The
// zero value of each field means its default.
type Config struct {
	// Listen is the HTTP listen address. Default 127.0.0.1:8080.
	Listen string `yaml:"listen"`
	// Strategy names the routing strategy: random (default), round_robin,
	// least_outstanding, prefix_aware or kv_aware.
	Strategy string `yaml:"strategy"`
	// LogLevel is debug, info (default), warn or error.
	LogLevel string `yaml:"log_level"`
	// DrainTimeout bounds a graceful shutdown (SIGTERM): how long the
	// requests in flight may run once the scheduler stops accepting new
	// ones; those still running then end with a stream_interrupted error.
	// Default 30s. A pod's terminationGracePeriodSeconds must exceed it
	// plus DrainDelay and any preStop delay.
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// DrainDelay is how long a draining scheduler keeps accepting requests
	// while /readyz already answers 503, so that load balancers see it
	// first. Default 0: on Kubernetes a preStop sleep does this.
	DrainDelay time.Duration `yaml:"drain_delay"`
	// ScrapesPerSecond bounds the scrapes of vllm and sglang workers'
	// metrics this scheduler starts a second, all workers together: past
	// scrapes_per_second × metrics_interval workers, every worker's
	// interval stretches to workers / scrapes_per_second (1,000 workers at
	// the default 250ms, 2,000 at 500ms). A scrape of a vLLM page costs
	// about 0.2 ms of CPU. With replicas.peers.share_load, the workers
	// are counted in the share of the turns this replica scraped itself
	// over the last second (the others' relayed reports cover the rest).
	// Default 4000; -1: no bound.
	ScrapesPerSecond int `yaml:"scrapes_per_second"`

	routing.Params  `yaml:",inline"`
	frontend.Config `yaml:",inline"`

	// Pool tunes health checks and breakers.
	Pool pool.Config `yaml:"pool"`
	// Disaggregation tunes prefill/decode disaggregation.
	Disaggregation DisaggConfig `yaml:"disaggregation"`
	// Auth turns on API keys and their per-key limits. Default: none,
	// every request is served.
	Auth auth.Config `yaml:"auth"`
	// TLS serves the HTTP API over HTTPS with cert_file and key_file, read
	// again when they change or on SIGHUP; ca_file also requires client
	// certificates it signed. Default: plain HTTP.
	TLS tlsconf.Config `yaml:"tls"`
	// WorkerTLS connects to grpc workers over TLS: ca_file verifies their
	// certificates, which must name server_name or else the host of each
	// worker's address; cert_file and key_file are the scheduler's client
	// certificate, for workers that require one (mutual TLS). Default:
	// plaintext, for loopback or a trusted network.
	WorkerTLS tlsconf.Config `yaml:"worker_tls"`
	// Workers is the static worker list.
	Workers []WorkerConfig `yaml:"workers"`
	// Discovery finds the workers instead: by DNS or Kubernetes
	// EndpointSlices. Default: the static workers list.
	Discovery DiscoveryConfig `yaml:"discovery"`
	// Profiles are custom routing strategies built from the pipeline's
	// parts (filters, weighted scorers, a picker); strategy and
	// disaggregation.decode_strategy may name them.
	Profiles []routing.ProfileConfig `yaml:"profiles"`
	// Replicas shares what this scheduler learns with the other replicas
	// in front of the same workers. Default: none.
	Replicas ReplicasConfig `yaml:"replicas"`
	// Adapters are the LoRA adapters served as models of their own names:
	// a request for one goes to a worker that holds it, or it is loaded
	// onto one whose max_loras allows.
	Adapters []AdapterConfig `yaml:"adapters"`

	// IndexNow is the KV index's clock (kvindex.Config.Now), by which its
	// predictions lapse and its records decay; nil means time.Now. Tests
	// set it.
	IndexNow func() time.Time `yaml:"-"`
	// Rand is the strategies' source of randomness (routing.Deps.Rand);
	// nil means math/rand/v2's. Benchmarks seed it, so that runs repeat.
	Rand func(n uint64) uint64 `yaml:"-"`
}

// RegisterProfiles returns a copy of strategies with c's custom profiles
// registered. Its errors name the field, as "profiles[0].scorers[1].name".
func (c Config) RegisterProfiles(strategies *routing.Registry) (*routing.Registry, error) {
	r := strategies.Clone()
	for i, pc := range c.Profiles {
		if err := r.RegisterProfile(pc); err != nil {
			return nil, fmt.Errorf("profiles[%d].%w", i, err)
		}
	}
	return r, nil
}

// Defaults of Config fields.
const (
	DefaultListen       = "127.0.0.1:8080"
	DefaultStrategy     = "random"
	DefaultDrainTimeout = 30 * time.Second
)

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if c.Strategy == "" {
		c.Strategy = DefaultStrategy
	}
	if c.LogLevel == "" {
		c.LogLevel = "info"
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.Discovery.Mode == "" {
		c.Discovery.Mode = DiscoveryStatic
	}
	for i := range c.Workers {
		w := &c.Workers[i]
		if w.Kind == "" {
			w.Kind = KindGRPC
		}
		if w.Name == "" {
			w.Name = w.Address
		}
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c Config) Validate(strategies *routing.Registry) error {
	c = c.WithDefaults()
	strategies, err := c.RegisterProfiles(strategies)
	if err != nil {
		return err
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("listen: %v", err)
	}
	if !slices.Contains(strategies.Names(), c.Strategy) {
		return fmt.Errorf("strategy: unknown strategy %q (known: %s)", c.Strategy, strings.Join(strategies.Names(), ", "))
	}
	if err := c.Replicas.validate(); err != nil {
		return err
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return fmt.Errorf("log_level: must be debug, info, warn or error, got %q", c.LogLevel)
	}
	if c.DrainTimeout < 0 {
		return fmt.Errorf("drain_timeout: must be positive, got %s", c.DrainTimeout)
	}
	if c.ScrapesPerSecond < -1 || c.ScrapesPerSecond > 1_000_000 {
		return fmt.Errorf("scrapes_per_second: must be -1 (no bound), 0 (default 4000) or up to 1000000, got %d", c.ScrapesPerSecond)
	}
	if c.DrainDelay < 0 {
		return fmt.Errorf("drain_delay: must not be negative, got %s", c.DrainDelay)
	}
	if err := c.Params.Validate(); err != nil {
		return err
	}
	if err := c.Config.Validate(); err != nil {
		return err
	}
	if err := c.Pool.Validate(); err != nil {
		return fmt.Errorf("pool.%v", err)
	}
	if err := c.Disaggregation.Validate(strategies); err != nil {
		return err
	}
	if err := c.Auth.Validate(); err != nil {
		return fmt.Errorf("auth.%w", err)
	}
	if c.TLS.ServerName != "" {
		return errors.New("tls.server_name: the front end is a server; worker_tls.server_name names the workers")
	}
	if err := c.TLS.Validate("tls", true); err != nil {
		return err
	}
	if err := c.WorkerTLS.Validate("worker_tls", false); err != nil {
		return err
	}
	workers, fieldOf, err := c.Discovery.workersToValidate(c.Workers)
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for i, w := range workers {
		field := fieldOf(i)
		k := kindOf(w.Kind)
		switch {
		case w.Address == "":
			return fmt.Errorf("%s.address: required", field)
		case k == nil:
			return fmt.Errorf("%s.kind: must be %s, got %q", field, kindList("or", nil), w.Kind)
		case seen[w.Name]:
			return fmt.Errorf("%s.name: %q is used by another worker", field, w.Name)
		case w.Role != "" && w.Role != RoleBoth && w.Role != RolePrefill && w.Role != RoleDecode:
			return fmt.Errorf("%s.role: must be %s, %s or %s, got %q", field, RoleBoth, RolePrefill, RoleDecode, w.Role)
		case !canPD(k) && (w.Role == RolePrefill || w.Role == RoleDecode):
			return fmt.Errorf("%s.role: %s engines serve colocated (role both) only; %s ones also prefill or decode, got %q", field, w.Kind, kindList("and", canPD), w.Role)
		case !k.Bootstrap && (w.BootstrapHost != "" || w.BootstrapPort != 0):
			return fmt.Errorf("%s.bootstrap_port: only %s workers have a bootstrap server (kind is %s)", field, kindList("and", hasBootstrap), w.Kind)
		}
		if err := validateRanks(w, field); err != nil {
			return err
		}
		switch {
		case w.CachePrompts < 0:
			return fmt.Errorf("%s.cache_prompts: must be 0 (what the engine says) or more, got %d", field, w.CachePrompts)
		case w.CachePrompts > 0 && k.SelfReported:
			return fmt.Errorf("%s.cache_prompts: %s workers report their cache; only %s workers have it", field, w.Kind, kindList("and", configuredCost))
		case w.Cost != (CostConfig{}) && k.SelfReported:
			return fmt.Errorf("%s.cost: %s workers report their own cost figures", field, w.Kind)
		}
		if err := w.Cost.validate(field + ".cost"); err != nil {
			return err
		}
		if err := w.EngineConfig.validateFor(k, field); err != nil {
			return err
		}
		seen[w.Name] = true
		if !k.URL {
			if _, _, err := net.SplitHostPort(w.Address); err != nil {
				return fmt.Errorf("%s.address: %v", field, err)
			}
		} else if !strings.HasPrefix(w.Address, "http://") && !strings.HasPrefix(w.Address, "https://") {
			return fmt.Errorf("%s.address: the address of %s engines is a URL such as http://host:8000, got %q", field, w.Kind, w.Address)
		}
		if w.TLS != (tlsconf.Config{}) {
			switch {
			case !k.URL:
				return fmt.Errorf("%s.tls: %s workers are reached with worker_tls", field, w.Kind)
			case !strings.HasPrefix(w.Address, "https://"):
				return fmt.Errorf("%s.tls: set, but the address %q is not https://", field, w.Address)
			}
			if err := w.TLS.Validate(field+".tls", false); err != nil {
				return err
			}
		}
	}
	if err := c.validateAdapters(); err != nil {
		return err
	}
	return validatePairs(c.Workers)
}

// validatePairs checks that every prefill worker can hand its KV blocks
// to every decode worker: they must be of one kind, each kind moving
// blocks by its own protocol (baton's transfer, vLLM's NixlConnector,
// SGLang's bootstrap server). Roles left to grpc workers to say are not
// known here.
func validatePairs(workers []WorkerConfig) error {
	for i, p := range workers {
		if p.Role != RolePrefill {
			continue
		}
		decoders := 0
		for _, d := range workers {
			if d.Role != RoleDecode {
				continue
			}
			if d.Kind != p.Kind {
				return fmt.Errorf("workers[%d].kind: a %s prefill worker cannot hand its KV cache to %s decode worker %q; prefill and decode workers must be of one kind", i, p.Kind, d.Kind, d.Name)
			}
			decoders++
		}
		if k := kindOf(p.Kind); decoders == 0 && k != nil && !k.DescribesRole {
			return fmt.Errorf("workers[%d].role: a %s prefill worker needs %s workers with role decode", i, p.Kind, p.Kind)
		}
	}
	return nil
}

// beyond returns what c sets that a worker of kind k does not have: the
// metrics settings for a kind whose load is scraped, and the rest for a
// kind that publishes KV events.
func (c EngineConfig) beyond(k *engine.Kind) EngineConfig {
	switch {
	case k.Events:
		return EngineConfig{}
	case k.Scrape != nil:
		c.MetricsPath, c.MetricsInterval, c.MetricsTimeout = "", 0, 0
	}
	return c
}

// validateFor checks c as the settings of a worker of kind k.
func (c EngineConfig) validateFor(k *engine.Kind, field string) error {
	if rest := c.beyond(k); rest != (EngineConfig{}) {
		if k.Scrape != nil {
			return fmt.Errorf("%s.%s: %s workers have only metrics_path, metrics_interval and metrics_timeout", field, rest.firstSet(), k.Name)
		}
		return fmt.Errorf("%s.%s: only %s workers have it (kind is %s)", field, rest.firstSet(), kindList("and", hasEvents), k.Name)
	}
	if k.Events || k.Scrape != nil {
		return c.validate(field)
	}
	return nil
}

// firstSet returns the YAML name of c's first field that is set.
func (c EngineConfig) firstSet() string {
	v := reflect.ValueOf(c)
	for i := range v.NumField() {
		if !v.Field(i).IsZero() {
			name, _, _ := strings.Cut(v.Type().Field(i).Tag.Get("yaml"), ",")
			return name
		}
	}
	return ""
}

// LoadConfig reads a YAML configuration file. Its errors name the field by
// its path (pool.breaker_failures, workers[1].address) and its line; unknown
// fields are errors that suggest the closest known one.
func LoadConfig(path string) (Config, error) {
	var c Config
	b, err := os.ReadFile(path)
	if err != nil {
		return c, err
	}
	if err := strictyaml.Unmarshal(b, &c); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}
