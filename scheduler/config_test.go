package scheduler

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/routing"
)

func registry() *routing.Registry {
	r := &routing.Registry{}
	routing.RegisterBuiltins(r)
	return r
}

func TestConfigValidate(t *testing.T) {
	valid := func() Config {
		return Config{Workers: []WorkerConfig{{Address: "127.0.0.1:9000"}, {Name: "v", Address: "http://127.0.0.1:8000", Kind: KindHTTP},
			{Name: "e", Address: "http://127.0.0.1:8001", Kind: KindVLLM, EngineConfig: EngineConfig{Events: "tcp://127.0.0.1:5557"}}}}
	}
	if err := valid().Validate(registry()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	llama := valid()
	llama.Workers[1].Kind, llama.Workers[1].CachePrompts, llama.Workers[1].MetricsPath = KindLlamaCPP, 4, "/metrics"
	if err := llama.Validate(registry()); err != nil {
		t.Fatalf("valid config with a llamacpp worker: %v", err)
	}
	short := filepath.Join(t.TempDir(), "short")
	os.WriteFile(short, []byte("  fifteen bytes!\n"), 0o600)
	cases := []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"bad listen", func(c *Config) { c.Listen = "nope" }, "listen:"},
		{"peers secret file missing", func(c *Config) {
			c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", Addresses: []string{"a:1"}, SecretFile: filepath.Join(t.TempDir(), "none")}
		}, "replicas.peers.secret_file:"},
		{"peers secret short", func(c *Config) {
			c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", Addresses: []string{"a:1"}, SecretFile: short}
		}, "replicas.peers.secret_file:"},
		{"peers secret without listen", func(c *Config) { c.Replicas.Peers.SecretFile = short }, "replicas.peers.listen:"},
		{"peers without listen", func(c *Config) { c.Replicas.Peers.Addresses = []string{"127.0.0.1:9401"} }, "replicas.peers.listen:"},
		{"share_load without peers", func(c *Config) { off := false; c.Replicas.Peers.ShareLoad = &off }, "replicas.peers.listen:"},
		{"peers listen not host:port", func(c *Config) { c.Replicas.Peers = ReplicaPeersConfig{Listen: "9401", Addresses: []string{"a:1"}} }, "replicas.peers.listen:"},
		{"peers found no way", func(c *Config) { c.Replicas.Peers.Listen = ":9401" }, "replicas.peers.addresses:"},
		{"peers found two ways", func(c *Config) {
			c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", Addresses: []string{"a:1"}, DNS: discovery.DNSConfig{Name: "x", Port: 9401}}
		}, "replicas.peers.addresses:"},
		{"peer address", func(c *Config) { c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", Addresses: []string{"a"}} }, "replicas.peers.addresses[0]:"},
		{"peers dns", func(c *Config) {
			c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", DNS: discovery.DNSConfig{Name: "x"}}
		}, "replicas.peers.dns.port:"},
		{"replay below -1", func(c *Config) {
			c.Replicas.Peers = ReplicaPeersConfig{Listen: ":9401", Addresses: []string{"a:1"}}
			c.Replicas.Replay = -2
		}, "replicas.replay:"},
		{"unknown strategy", func(c *Config) { c.Strategy = "fastest" }, "strategy:"},
		{"bad log level", func(c *Config) { c.LogLevel = "loud" }, "log_level:"},
		{"drain timeout negative", func(c *Config) { c.DrainTimeout = -time.Second }, "drain_timeout:"},
		{"drain delay negative", func(c *Config) { c.DrainDelay = -time.Second }, "drain_delay:"},
		{"threshold too high", func(c *Config) { c.ConcurrencyThreshold = 2000 }, "concurrency_threshold:"},
		{"threshold negative", func(c *Config) { c.ConcurrencyThreshold = -1 }, "concurrency_threshold:"},
		{"prefix too short", func(c *Config) { c.PrefixLength = 100 }, "prefix_length:"},
		{"prefix too long", func(c *Config) { c.PrefixLength = 70000 }, "prefix_length:"},
		{"body limit tiny", func(c *Config) { c.MaxBodyBytes = 10 }, "max_body_bytes:"},
		{"too many retries", func(c *Config) { c.Retries = 9 }, "retries:"},
		{"empty model", func(c *Config) { c.Models = []string{""} }, "models[0]:"},
		{"queue", func(c *Config) { c.MaxQueue = -2 }, "max_queue:"},
		{"capacity", func(c *Config) { c.MaxInFlight = -1 }, "max_in_flight:"},
		{"queue timeout", func(c *Config) { c.QueueTimeout = -time.Second }, "queue_timeout:"},
		{"negative prompt limit", func(c *Config) { c.MaxPromptTokens = -1 }, "max_prompt_tokens:"},
		{"header limit tiny", func(c *Config) { c.MaxHeaderBytes = 100 }, "max_header_bytes:"},
		{"pool timing", func(c *Config) { c.Pool.HealthTimeout = time.Minute; c.Pool.HealthInterval = time.Second }, "pool.health_timeout:"},
		{"no workers", func(c *Config) { c.Workers = nil }, "workers:"},
		{"missing address", func(c *Config) { c.Workers[0].Address = "" }, "workers[0].address:"},
		{"bad kind", func(c *Config) { c.Workers[0].Kind = "ftp" }, "workers[0].kind:"},
		{"grpc address not host:port", func(c *Config) { c.Workers[0].Address = "localhost" }, "workers[0].address:"},
		{"http address not a URL", func(c *Config) { c.Workers[1].Address = "127.0.0.1:8000" }, "workers[1].address:"},
		{"duplicate names", func(c *Config) { c.Workers[1].Name = "127.0.0.1:9000" }, "workers[1].name:"},
		{"bad role", func(c *Config) { c.Workers[0].Role = "verifier" }, "workers[0].role:"},
		{"http prefill", func(c *Config) { c.Workers[1].Role = RolePrefill }, "workers[1].role:"},
		{"vllm prefill without a vllm decode worker", func(c *Config) { c.Workers[2].Role = RolePrefill }, "workers[2].role:"},
		{"vllm prefill, grpc decode", func(c *Config) { c.Workers[2].Role = RolePrefill; c.Workers[0].Role = RoleDecode }, "workers[2].kind:"},
		{"sglang prefill, vllm decode", func(c *Config) {
			c.Workers[2].Role = RoleDecode
			c.Workers = append(c.Workers, WorkerConfig{Name: "s", Address: "http://h:30000", Kind: KindSGLang, Role: RolePrefill})
		}, "workers[3].kind:"},
		{"grpc prefill, vllm decode", func(c *Config) { c.Workers[0].Role = RolePrefill; c.Workers[2].Role = RoleDecode }, "workers[0].kind:"},
		{"bootstrap port of a vllm worker", func(c *Config) { c.Workers[2].BootstrapPort = 8998 }, "workers[2].bootstrap_port:"},
		{"bootstrap port of a grpc worker", func(c *Config) { c.Workers[0].BootstrapPort = 8998 }, "workers[0].bootstrap_port:"},
		{"bootstrap port range", func(c *Config) { c.Workers[2].Kind = KindSGLang; c.Workers[2].BootstrapPort = 70000 }, "workers[2].bootstrap_port:"},
		{"llamacpp prefill", func(c *Config) { c.Workers[1].Kind = KindLlamaCPP; c.Workers[1].Role = RolePrefill }, "workers[1].role:"},
		{"llamacpp events", func(c *Config) { c.Workers[1].Kind = KindLlamaCPP; c.Workers[1].Events = "tcp://h:5557" }, "workers[1].events:"},
		{"llamacpp tokenize path", func(c *Config) { c.Workers[1].Kind = KindLlamaCPP; c.Workers[1].TokenizePath = "/tokenize" }, "workers[1].tokenize_path:"},
		{"llamacpp metrics path", func(c *Config) { c.Workers[1].Kind = KindLlamaCPP; c.Workers[1].MetricsPath = "metrics" }, "workers[1].metrics_path:"},
		{"negative cache prompts", func(c *Config) { c.Workers[1].CachePrompts = -1 }, "workers[1].cache_prompts:"},
		{"cache prompts of a grpc worker", func(c *Config) { c.Workers[0].CachePrompts = 2 }, "workers[0].cache_prompts:"},
		{"cost of a grpc worker", func(c *Config) { c.Workers[0].Cost.FLOPS = 1e15 }, "workers[0].cost:"},
		{"negative flops", func(c *Config) { c.Workers[1].Cost.FLOPS = -1 }, "workers[1].cost.flops:"},
		{"negative decode step", func(c *Config) { c.Workers[2].Cost.DecodeStepSeconds = -1 }, "workers[2].cost.decode_step_seconds:"},
		{"bootstrap host", func(c *Config) { c.Workers[2].Kind = KindSGLang; c.Workers[2].BootstrapHost = "http://h" }, "workers[2].bootstrap_host:"},
		{"sglang address not a URL", func(c *Config) { c.Workers[2].Kind = KindSGLang; c.Workers[2].Address = "h:8000" }, "workers[2].address:"},
		{"events not an endpoint", func(c *Config) { c.Workers[2].Events = "127.0.0.1:5557" }, "workers[2].events:"},
		{"replay not an endpoint", func(c *Config) { c.Workers[2].EventsReplay = "http://h:5558" }, "workers[2].events_replay:"},
		{"topic without events", func(c *Config) { c.Workers[2].Events = ""; c.Workers[2].EventsTopic = "kv" }, "workers[2].events:"},
		{"bind without events", func(c *Config) { c.Workers[2].Events = ""; c.Workers[2].EventsBind = true }, "workers[2].events:"},
		{"metrics path", func(c *Config) { c.Workers[2].MetricsPath = "metrics" }, "workers[2].metrics_path:"},
		{"metrics interval", func(c *Config) { c.Workers[2].MetricsInterval = time.Millisecond }, "workers[2].metrics_interval:"},
		{"metrics timeout", func(c *Config) { c.Workers[2].MetricsTimeout = -time.Second }, "workers[2].metrics_timeout:"},
		{"block size", func(c *Config) { c.Workers[2].BlockSize = -16 }, "workers[2].block_size:"},
		{"tokenize path", func(c *Config) { c.Workers[2].TokenizePath = "tokenize" }, "workers[2].tokenize_path:"},
		{"tokenize timeout", func(c *Config) { c.Workers[2].TokenizeTimeout = -time.Second }, "workers[2].tokenize_timeout:"},
		{"tokenize cache", func(c *Config) { c.Workers[2].TokenizeCacheTokens = -2 }, "workers[2].tokenize_cache_tokens:"},
		{"tokenize path of an http worker", func(c *Config) { c.Workers[1].TokenizePath = "/tokenize" }, "workers[1].tokenize_path:"},
		{"events of an http worker", func(c *Config) { c.Workers[1].EventsTopic = "kv" }, "workers[1].events_topic:"},
		{"block size of a grpc worker", func(c *Config) { c.Workers[0].BlockSize = 16 }, "workers[0].block_size:"},
		{"decode strategy", func(c *Config) { c.Disaggregation.DecodeStrategy = "fastest" }, "disaggregation.decode_strategy:"},
		{"min remote", func(c *Config) { c.Disaggregation.MinRemotePrefillTokens = -3 }, "disaggregation.min_remote_prefill_tokens:"},
		{"prefill retries", func(c *Config) { c.Disaggregation.PrefillRetries = 5 }, "disaggregation.prefill_retries:"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := valid()
			c.edit(&cfg)
			err := cfg.Validate(registry())
			if err == nil {
				t.Fatal("invalid config accepted")
			}
			if !strings.HasPrefix(err.Error(), c.field) {
				t.Errorf("error %q does not start with the field %q", err, c.field)
			}
		})
	}
}

func TestConfigValidateEnginePairs(t *testing.T) {
	for _, kind := range []string{KindVLLM, KindSGLang} {
		cfg := Config{Workers: []WorkerConfig{
			{Name: "p0", Address: "http://p0:8000", Kind: kind, Role: RolePrefill},
			{Name: "p1", Address: "http://p1:8000", Kind: kind, Role: RolePrefill},
			{Name: "d0", Address: "http://d0:8000", Kind: kind, Role: RoleDecode},
			{Name: "w0", Address: "http://w0:8000", Kind: KindHTTP},
		}}
		if kind == KindSGLang {
			cfg.Workers[0].BootstrapPort = 9000
			cfg.Workers[1].BootstrapHost = "10.0.0.8"
		}
		if err := cfg.Validate(registry()); err != nil {
			t.Errorf("%s prefill and decode workers: %v", kind, err)
		}
	}
}

func TestLoadConfigRejectsUnknownFields(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(path, []byte("strategy: prefix_aware\nconcurency_threshold: 4\nworkers: [{address: '127.0.0.1:1'}]\n"), 0o600)
	_, err := LoadConfig(path)
	if err == nil || !strings.Contains(err.Error(), "concurency_threshold") {
		t.Fatalf("got %v, want an error naming the unknown field", err)
	}
}

// The example configuration of docs/configuration.md must load and
// validate, field for field, so the documentation cannot drift from the
// code.
func TestReadmeConfigLoads(t *testing.T) {
	doc, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)## Configuration file.*?```yaml\n(.*?)```").FindSubmatch(doc)
	if m == nil {
		t.Fatal("docs/configuration.md has no yaml block under 'Configuration file'")
	}
	path := filepath.Join(t.TempDir(), "readme.yaml")
	os.WriteFile(path, m[1], 0o600)
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(registry()); err != nil {
		t.Fatal(err)
	}
	if cfg.Strategy != "prefix_aware" || cfg.ConcurrencyThreshold != 16 || cfg.PrefixLength != 4096 ||
		cfg.RequestTimeout != 10*time.Minute || cfg.Pool.BreakerOpenTimeout != 10*time.Second || len(cfg.Workers) != 3 ||
		cfg.Workers[0].Role != RolePrefill || cfg.Workers[2].Kind != KindHTTP ||
		cfg.Disaggregation.MinRemotePrefillTokens != 512 || cfg.Disaggregation.TransferTimeout != 5*time.Second {
		t.Errorf("docs/configuration.md config decoded as %+v", cfg)
	}
}

// FuzzLoadConfig: no configuration file, however malformed, panics the
// loader or the validation; an accepted one names at least one worker.
func FuzzLoadConfig(f *testing.F) {
	f.Add([]byte("strategy: prefix_aware\nworkers: [{address: '127.0.0.1:1'}]\n"))
	f.Add([]byte("pool: {health_interval: 1s, health_timeout: 2s}\nworkers: [{address: 'http://x:1', kind: http, role: prefill}]\n"))
	f.Add([]byte("disaggregation: {min_remote_prefill_tokens: -4}\nmax_queue: -1\n"))
	f.Add([]byte("replicas: {peers: {listen: ':9401', addresses: ['a:1'], secret_file: /nonexistent}}\nworkers: [{address: '127.0.0.1:1'}]\n"))
	f.Add([]byte("strategy: two\nprofiles: [{name: two, filters: [available, model], scorers: [{name: a, type: prefix, options: {concurrency_threshold: 2}}, {name: b, type: prefix, weight: 0.5}], picker: {type: max}}]\nworkers: [{address: '127.0.0.1:1'}]\n"))
	reg := registry()
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		path := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(path)
		if err != nil {
			return
		}
		if cfg.Validate(reg) == nil && len(cfg.Workers) == 0 {
			t.Fatal("a configuration without workers validated")
		}
	})
}
