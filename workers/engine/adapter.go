package engine

import "context"

// Adapter is a LoRA adapter of a base model, served as a model of its own
// name: a request whose model is Name runs on Base with the adapter.
type Adapter struct {
	// Name is the model name requests give.
	Name string
	// Base is the model the adapter adapts.
	Base string
	// Source is where the engine loads it from: a path or a repository
	// the engine can read (vLLM's lora_path).
	Source string
	// Bytes is the adapter's size, from which the load time is modelled.
	Bytes int64
}

// AdapterLoader is implemented by clients of engines that load and unload
// LoRA adapters on request (vLLM's /v1/load_lora_adapter and
// /v1/unload_lora_adapter). The scheduler calls them from a request's
// goroutine, one load of an adapter at a time, and waits for them: they
// may block until ctx ends. An error means the engine does not hold the
// adapter (LoadAdapter) or may still hold it (UnloadAdapter).
//
// Engines whose client is no AdapterLoader load an adapter themselves on
// its first request (baton's simulated engine) and evict as they need.
type AdapterLoader interface {
	LoadAdapter(ctx context.Context, a Adapter) error
	UnloadAdapter(ctx context.Context, name string) error
}
