package engine

import (
	"context"
	"crypto/tls"
	"io"
	"math"

	"google.golang.org/grpc/credentials"
)

// Kind describes one kind of engine: what a worker of that kind may be
// configured with and how the scheduler reaches it, reads its load and
// pairs it for disaggregated serving. Each engine package declares the
// kinds it serves (httpengine.Kind, vllm.Kind, vllm.SGLangKind,
// llamacpp.Kind, grpcworker.Kind); the scheduler lists them once.
type Kind struct {
	// Name is the worker configuration's kind.
	Name string
	// URL: the worker's address is a base URL (http:// or https://, tls
	// configured per worker); otherwise host:port (worker_tls).
	URL bool
	// PD is how a prefill engine of this kind hands a prompt's KV blocks
	// to a decode engine of this kind; NoPD serves colocated only.
	PD PD
	// Bootstrap: the engine runs SGLang's bootstrap server
	// (bootstrap_host, bootstrap_port).
	Bootstrap bool
	// DataParallel: one address serves data_parallel_size ranks;
	// DataParallelColocated, only for colocated serving.
	DataParallel, DataParallelColocated bool
	// Events: the engine publishes KV cache events, and has the engine
	// settings that go with them (events, block_size, tokenizer, ...).
	Events bool
	// SelfReported: the engine reports its own cache and cost figures
	// (cache_prompts and cost are not configured), and streams its cache
	// events when it implements the watcher's source.
	SelfReported bool
	// DescribesRole: the engine says its role when the configuration
	// leaves it out.
	DescribesRole bool
	// LoadsAdapters: the engine loads LoRA adapters on demand (max_loras);
	// AdapterSource, from the adapter's source, which is then required.
	LoadsAdapters, AdapterSource bool
	// AdapterMetrics: the engine's metrics say which adapters it holds.
	AdapterMetrics bool
	// Tokenizes: the engine's /tokenize gives the token ids its cache
	// events are keyed by.
	Tokenizes bool
	// Connect returns the client of one worker of this kind.
	Connect func(Target) (Client, error)
	// Scrape, if set, returns the scraper of the engine's load, which the
	// scheduler reads (metrics_path, metrics_interval, metrics_timeout).
	Scrape func(Target) (LoadScraper, error)
}

// PD is how engines hand a prompt's KV blocks from prefill to decode.
type PD int

// Protocols of disaggregated serving.
const (
	// NoPD: the engine prefills and decodes each request itself.
	NoPD PD = iota
	// PDBaton is baton's transfer service (baton workers).
	PDBaton
	// PDNIXL is vLLM's NixlConnector with kv_transfer_params.
	PDNIXL
	// PDBootstrap is SGLang's bootstrap server.
	PDBootstrap
)

// Target is one worker as its kind's functions see it.
type Target struct {
	Name, Address string
	// Role is prefill, decode, both, or empty when the engine says.
	Role string
	// TLS is how an https engine is reached (nil: the system roots).
	TLS *tls.Config
	// Credentials are a grpc worker's (nil: plaintext).
	Credentials credentials.TransportCredentials
	// BootstrapHost and BootstrapPort are an SGLang engine's bootstrap
	// server, when they differ from its defaults.
	BootstrapHost string
	BootstrapPort int
	// Rank is the data-parallel rank this worker is, when DPSize > 1.
	Rank, DPSize int
	// MetricsPath is where the engine's metrics are (empty: its kind's).
	MetricsPath string
	// Adapters are the LoRA adapters configured.
	Adapters []Adapter
}

// LoadScraper reads an engine's load.
type LoadScraper interface {
	Scrape(ctx context.Context) (Load, error)
	io.Closer
}

// Load is what baton reads of an engine's metrics (its load, its KV
// cache and its adapters). With data-parallel
// engines (one series per engine label) counts and capacities are summed
// and the usage averaged.
type Load struct {
	// Running and Waiting are the requests in the running batch and in the
	// engine's queue (vLLM's num_requests_running and _waiting, SGLang's
	// num_running_reqs and num_queue_reqs). HasLoad says both were read.
	Running, Waiting int
	HasLoad          bool
	// KVUsage is the fraction of the GPU KV cache in use, 0–1 (vLLM's
	// kv_cache_usage_perc, gpu_cache_usage_perc before v0.10; SGLang's
	// token_usage); HasKVUsage says it was read.
	KVUsage    float64
	HasKVUsage bool
	// BlockSize is the tokens of one KV block, 0 when unknown (vLLM's
	// cache_config_info label block_size; SGLang does not say).
	BlockSize int
	// GPUBlocks is the KV cache's capacity in blocks (vLLM's
	// cache_config_info label num_gpu_blocks), 0 when unknown.
	GPUBlocks int64
	// KVTokens is the KV cache's capacity in tokens (SGLang's
	// max_total_num_tokens), 0 when unknown.
	KVTokens int64
	// Slots is the prompts the engine keeps cached at once when it keeps
	// one per slot (llama-server's total_slots), 0 otherwise. Parse does
	// not set it: workers/llamacpp reads it from the engine's /props.
	Slots int
	// Adapters are the LoRA adapters with requests running or waiting on
	// the engine, sorted, and MaxLoRAs its adapter slots: vLLM's
	// lora_requests_info labels running_lora_adapters,
	// waiting_lora_adapters and max_lora, of the series set last (its
	// value is the time it was set). HasLoRA says the gauge was read: an
	// engine without --enable-lora has none.
	Adapters []string
	MaxLoRAs int
	HasLoRA  bool
}

// Blocks returns the GPU KV blocks in use and in all, in blocks of
// blockSize tokens; 0, 0 when the capacity is unknown.
func (m Load) Blocks(blockSize int) (used, total int64) {
	switch {
	case m.GPUBlocks > 0:
		total = m.GPUBlocks
	case m.KVTokens > 0 && blockSize > 0:
		total = m.KVTokens / int64(blockSize)
	default:
		return 0, 0
	}
	if m.HasKVUsage {
		used = int64(math.Round(m.KVUsage * float64(total)))
	}
	return used, total
}

// Roles a worker serves in disaggregated serving.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RoleBoth    = "both"
)
