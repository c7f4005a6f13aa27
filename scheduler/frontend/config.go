package frontend

import (
	"fmt"
	"time"

	"github.com/batonllm/baton/workers/openai"
)

// Limits and defaults of Config fields.
const (
	MinPrefixLength     = 1024
	MaxPrefixLength     = 65536
	DefaultPrefixLength = 4096
	DefaultRetries      = 2
	DefaultTimeout      = 10 * time.Minute
	DefaultMaxQueue     = 256
	DefaultMaxInFlight  = 256
	DefaultQueueTimeout = 30 * time.Second
	DefaultReadTimeout  = time.Minute
	DefaultIdleTimeout  = 2 * time.Minute
	// writeTimeoutSlack is how much longer than request_timeout a
	// non-streamed response may take to write by default.
	writeTimeoutSlack = 30 * time.Second
)

// Config tunes the front end. The zero value means every default.
type Config struct {
	// Models lists the model names served; a request for another gets a
	// 404. Empty: any model is accepted and workers decide.
	Models []string `yaml:"models"`
	// PrefixLength is how much of the routing text prefix_aware hashes:
	// characters on the OpenAI routes, bytes on /invocations. 1,024–65,536;
	// default 4,096.
	PrefixLength int `yaml:"prefix_length"`
	// MaxBodyBytes limits request bodies; larger ones get a 413. Default
	// 6 MiB.
	MaxBodyBytes int64 `yaml:"max_body_bytes"`
	// Retries is how many other workers a request tries when its worker
	// fails before the first token. 0–8; default 2. Set -1 for none.
	Retries int `yaml:"retries"`
	// RequestTimeout bounds a request from arrival to last byte; past it
	// the client gets a 504 (or an error event if streaming began).
	// Default 10m.
	RequestTimeout time.Duration `yaml:"request_timeout"`
	// MaxInFlight is a worker's capacity: the most requests the scheduler
	// keeps in flight on one worker. A request whose worker is full goes to
	// the least-loaded worker with room, and waits in the scheduler's queue
	// when every worker is full. Default 256, vLLM's max_num_seqs: past it
	// an engine only queues, and the scheduler queue lets a request go to
	// whichever worker frees up first. (The concurrency threshold is not a
	// capacity: it only makes prefix_aware and kv_aware spill.)
	MaxInFlight int `yaml:"max_in_flight"`
	// MaxQueue bounds the requests waiting in the scheduler when every
	// available worker is full; past it requests get a 429 with
	// Retry-After. Default 256; -1 disables the queue (such requests go to
	// the least-loaded worker at once).
	MaxQueue int `yaml:"max_queue"`
	// QueueTimeout bounds a request's wait in that queue; past it the
	// request gets a 429. Default 30s.
	QueueTimeout time.Duration `yaml:"queue_timeout"`
	// ReadTimeout bounds reading a request, from its arrival to the end of
	// its body; a client that stalls mid-body gets a 408 and its
	// connection is closed. Default 1m: a 6 MiB body over a slow link.
	ReadTimeout time.Duration `yaml:"read_timeout"`
	// WriteTimeout bounds a non-streamed exchange, from the request's
	// arrival to the last byte of its response, so that a client that
	// stops reading cannot hold a connection. Streams are bounded by
	// request_timeout only. Default request_timeout + 30s, which no
	// legitimate response reaches.
	WriteTimeout time.Duration `yaml:"write_timeout"`
	// IdleTimeout closes a kept-alive connection that carries no request
	// for this long. Default 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// MaxPromptTokens refuses (400, code context_length_exceeded) a
	// prompt longer than this many tokens, counted at 4 characters a
	// token, before it reaches a worker. 0 (the default): no limit but
	// max_body_bytes and the engines' own.
	MaxPromptTokens int `yaml:"max_prompt_tokens"`
	// MaxHeaderBytes bounds a request's header lines; larger get a 431.
	// Default 64 KiB: OpenAI clients send a few hundred bytes.
	MaxHeaderBytes int `yaml:"max_header_bytes"`
	// MaxConnections bounds the client connections held open at once;
	// past it a new connection waits in the kernel's accept queue until
	// one closes (as HAProxy's maxconn does), so that a flood of
	// connections cannot exhaust the scheduler's file descriptors. Idle
	// connections close after idle_timeout. Default 10,000; -1: no limit.
	MaxConnections int `yaml:"max_connections"`
}

// Default returns the configuration used for zero fields.
func Default() Config {
	return Config{
		PrefixLength:   DefaultPrefixLength,
		MaxBodyBytes:   openai.DefaultMaxBodyBytes,
		Retries:        DefaultRetries,
		RequestTimeout: DefaultTimeout,
		MaxQueue:       DefaultMaxQueue,
		MaxInFlight:    DefaultMaxInFlight,
		QueueTimeout:   DefaultQueueTimeout,
		ReadTimeout:    DefaultReadTimeout,
		WriteTimeout:   DefaultTimeout + writeTimeoutSlack,
		IdleTimeout:    DefaultIdleTimeout,
		MaxHeaderBytes: DefaultMaxHeaderBytes,
		MaxConnections: DefaultMaxConnections,
	}
}

// DefaultMaxConnections is Config.MaxConnections's default.
const DefaultMaxConnections = 10_000

// DefaultMaxHeaderBytes is Config.MaxHeaderBytes's default.
const DefaultMaxHeaderBytes = 64 << 10

// WithDefaults returns c with zero fields set to Default's values.
func (c Config) WithDefaults() Config {
	d := Default()
	if c.PrefixLength == 0 {
		c.PrefixLength = d.PrefixLength
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = d.MaxBodyBytes
	}
	if c.Retries == 0 {
		c.Retries = d.Retries
	} else if c.Retries < 0 {
		c.Retries = 0
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = d.RequestTimeout
	}
	if c.MaxQueue == 0 {
		c.MaxQueue = d.MaxQueue
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.QueueTimeout == 0 {
		c.QueueTimeout = d.QueueTimeout
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = d.ReadTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = c.RequestTimeout + writeTimeoutSlack
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = d.IdleTimeout
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = d.MaxHeaderBytes
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = d.MaxConnections
	}
	return c
}

// Validate reports the first invalid field, after defaults, by its
// configuration name.
func (c Config) Validate() error {
	c = c.WithDefaults()
	switch {
	case c.PrefixLength < MinPrefixLength || c.PrefixLength > MaxPrefixLength:
		return fmt.Errorf("prefix_length: must be %d–%d, got %d", MinPrefixLength, MaxPrefixLength, c.PrefixLength)
	case c.MaxBodyBytes < 1024:
		return fmt.Errorf("max_body_bytes: must be at least 1024, got %d", c.MaxBodyBytes)
	case c.Retries > 8:
		return fmt.Errorf("retries: must be at most 8, got %d", c.Retries)
	case c.RequestTimeout < 0:
		return fmt.Errorf("request_timeout: must be positive, got %s", c.RequestTimeout)
	case c.MaxInFlight < 1 || c.MaxInFlight > 1<<20:
		return fmt.Errorf("max_in_flight: must be 1–1048576, got %d", c.MaxInFlight)
	case c.MaxQueue < -1 || c.MaxQueue > 1<<20:
		return fmt.Errorf("max_queue: must be -1 (no queue) or 1–1048576, got %d", c.MaxQueue)
	case c.QueueTimeout < 0:
		return fmt.Errorf("queue_timeout: must be positive, got %s", c.QueueTimeout)
	case c.ReadTimeout < 0:
		return fmt.Errorf("read_timeout: must be positive, got %s", c.ReadTimeout)
	case c.WriteTimeout < 0:
		return fmt.Errorf("write_timeout: must be positive, got %s", c.WriteTimeout)
	case c.IdleTimeout < 0:
		return fmt.Errorf("idle_timeout: must be positive, got %s", c.IdleTimeout)
	case c.MaxPromptTokens < 0:
		return fmt.Errorf("max_prompt_tokens: must be positive (0: no limit), got %d", c.MaxPromptTokens)
	case c.MaxHeaderBytes < 4096:
		return fmt.Errorf("max_header_bytes: must be at least 4096, got %d", c.MaxHeaderBytes)
	case c.MaxConnections < -1:
		return fmt.Errorf("max_connections: must be -1 (no limit) or positive, got %d", c.MaxConnections)
	}
	for i, m := range c.Models {
		if m == "" {
			return fmt.Errorf("models[%d]: must not be empty", i)
		}
	}
	return nil
}
