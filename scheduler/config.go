package scheduler

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/batonllm/baton/scheduler/frontend"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
)

// Worker kinds: how the scheduler talks to a worker.
const (
	// KindGRPC is a baton worker (baton worker), driven over the worker gRPC
	// API.
	KindGRPC = "grpc"
	// KindHTTP is any OpenAI-compatible HTTP engine (vLLM, SGLang,
	// llama.cpp's llama-server); its responses are relayed as they come.
	KindHTTP = "http"
)

// WorkerConfig is one statically configured worker.
type WorkerConfig struct {
	// Name identifies the worker in headers, metrics and logs. Default: its
	// address.
	Name string `yaml:"name"`
	// Address is host:port for grpc workers, a base URL (http://host:port)
	// for http engines. Required.
	Address string `yaml:"address"`
	// Kind is grpc (default) or http.
	Kind string `yaml:"kind"`
	// Models the worker serves. Empty: any model (grpc workers are asked at
	// start).
	Models []string `yaml:"models"`
	// Role is both (prefill and decode: colocated serving), prefill or
	// decode. Empty: grpc workers are asked at start; http engines are both.
	Role string `yaml:"role"`
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

	routing.Params  `yaml:",inline"`
	frontend.Config `yaml:",inline"`

	// Pool tunes health checks and breakers.
	Pool pool.Config `yaml:"pool"`
	// Disaggregation tunes prefill/decode disaggregation.
	Disaggregation DisaggConfig `yaml:"disaggregation"`
	// Workers is the static worker list.
	Workers []WorkerConfig `yaml:"workers"`
}

// Defaults of Config fields.
const (
	DefaultListen   = "127.0.0.1:8080"
	DefaultStrategy = "random"
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
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("listen: %v", err)
	}
	if !slices.Contains(strategies.Names(), c.Strategy) {
		return fmt.Errorf("strategy: unknown strategy %q (known: %s)", c.Strategy, strings.Join(strategies.Names(), ", "))
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.LogLevel)); err != nil {
		return fmt.Errorf("log_level: %v", err)
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
	if len(c.Workers) == 0 {
		return errors.New("workers: at least one worker is required")
	}
	seen := map[string]bool{}
	for i, w := range c.Workers {
		field := fmt.Sprintf("workers[%d]", i)
		switch {
		case w.Address == "":
			return fmt.Errorf("%s.address: required", field)
		case w.Kind != KindGRPC && w.Kind != KindHTTP:
			return fmt.Errorf("%s.kind: must be %s or %s, got %q", field, KindGRPC, KindHTTP, w.Kind)
		case seen[w.Name]:
			return fmt.Errorf("%s.name: %q is used by another worker", field, w.Name)
		case w.Role != "" && w.Role != RoleBoth && w.Role != RolePrefill && w.Role != RoleDecode:
			return fmt.Errorf("%s.role: must be %s, %s or %s, got %q", field, RoleBoth, RolePrefill, RoleDecode, w.Role)
		case w.Kind == KindHTTP && (w.Role == RolePrefill || w.Role == RoleDecode):
			return fmt.Errorf("%s.role: an http engine serves colocated (role both) only, got %q", field, w.Role)
		}
		seen[w.Name] = true
		if w.Kind == KindGRPC {
			if _, _, err := net.SplitHostPort(w.Address); err != nil {
				return fmt.Errorf("%s.address: %v", field, err)
			}
		} else if !strings.HasPrefix(w.Address, "http://") && !strings.HasPrefix(w.Address, "https://") {
			return fmt.Errorf("%s.address: an http engine's address is a URL such as http://host:8000, got %q", field, w.Address)
		}
	}
	return nil
}

// LoadConfig reads a YAML configuration file. Unknown fields are errors.
func LoadConfig(path string) (Config, error) {
	var c Config
	b, err := os.ReadFile(path)
	if err != nil {
		return c, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		return c, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}
