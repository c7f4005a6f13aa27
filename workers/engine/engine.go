// Package engine holds the types the scheduler and the engine adapters
// exchange: one normalized generation request and the stream of events it
// produces, whatever engine serves it (a baton worker over gRPC, or an
// OpenAI-compatible HTTP engine such as vLLM).
package engine

import (
	"context"
	"errors"
	"net/http"
	"time"
)

// Request is one generation request, validated and normalized by the
// scheduler's front end.
type Request struct {
	// ID is the scheduler's request id, for logs.
	ID string
	// Model is the model name the client asked for.
	Model string
	// Tenant salts every block key (prompt_cache_key or X-Prefix-Aware-Id).
	Tenant string
	// Prompt is the routing text: chat messages rendered in order, or the
	// completion prompt.
	Prompt string
	// MaxTokens bounds the completion; 0 means the engine's default.
	MaxTokens int
	// Stop sequences end generation before their first occurrence.
	Stop []string

	// Path and Body are the client's original HTTP request, which
	// OpenAI-compatible HTTP engines receive unchanged.
	Path string
	Body []byte
	// Stream reports whether the client asked for a streamed response.
	Stream bool
}

// Event is one event of a generation stream: either new text (the first
// one marks the first token) or, last, the final usage.
type Event struct {
	// Text is newly generated text; Tokens the number of tokens it holds.
	Text   string
	Tokens int
	// Final is set on the last event only.
	Final *Final
}

// Final is how a generation ended and what it used.
type Final struct {
	// FinishReason is "stop" or "length".
	FinishReason     string
	PromptTokens     int
	CachedTokens     int
	CompletionTokens int
	// CachedTokens by the tier they were found in, for engines with tiers
	// (baton workers); all zero when unknown.
	CachedGPU, CachedCPU, CachedRedis int
}

// Stream is a generation in progress. Recv is called from one goroutine;
// it returns io.EOF after the event carrying Final. Close releases the
// stream and cancels the generation if it has not ended; it is idempotent.
type Stream interface {
	Recv() (Event, error)
	Close() error
}

// Client drives one engine. Its methods are safe for concurrent use.
type Client interface {
	// Generate starts req and returns its stream. An error returned here
	// means nothing was generated, so the caller may retry elsewhere.
	// Cancelling ctx cancels the generation.
	Generate(ctx context.Context, req *Request) (Stream, error)
	// Check reports the engine's health: nil when it can serve.
	Check(ctx context.Context) error
	// Close releases the client's connections.
	Close() error
}

// Description is what an engine says it serves.
type Description struct {
	// Models the engine serves; empty means it does not say (any model).
	// An engine that holds LoRA adapters may list them here too.
	Models []string
	// Adapters are the LoRA adapters the engine holds now, when it tells
	// them from its base models (vLLM's /v1/models entries with a parent).
	Adapters []string
	// MaxLoRAs is how many adapters the engine holds at once, when it
	// says (a baton worker's Info, vLLM's max_lora); 0 when it does not.
	MaxLoRAs int
	// Role is "both", "prefill" or "decode"; engines without
	// disaggregation are "both".
	Role string
}

// Describer is implemented by clients that can ask their engine what it
// serves (a baton worker's Info, an OpenAI server's /v1/models). The
// scheduler's pool calls it from its health-check goroutine, with a
// deadline; it may block that long.
type Describer interface {
	Describe(ctx context.Context) (Description, error)
}

// ErrUnavailable is returned (wrapped) by clients when the engine cannot be
// reached or refused the request for lack of capacity; callers may retry the
// request on another engine.
var ErrUnavailable = errors.New("engine unavailable")

// Proxier is implemented by clients of engines that speak the OpenAI HTTP
// API themselves (vLLM, SGLang, llama.cpp's llama-server). The scheduler
// relays such an engine's response to its client as it comes, rather than
// re-rendering it from events.
type Proxier interface {
	// Proxy sends req.Body to req.Path on the engine and copies the
	// response to w (status, content type, body), flushing after each
	// server-sent event. onFirstToken, if not nil, is called once when the
	// first event carrying generated text is relayed. The caller sets its
	// own response headers on w before calling Proxy.
	//
	// If Proxy returns an error with ProxyResult.Written false, nothing was
	// written to w and the caller may retry elsewhere or write its own
	// error; an error after writing means the relayed response was cut
	// short.
	Proxy(ctx context.Context, req *Request, w http.ResponseWriter, onFirstToken func()) (ProxyResult, error)
}

// ProxyResult is what the scheduler learns from a relayed response.
type ProxyResult struct {
	// Status is the engine's HTTP status.
	Status int
	// Written reports whether anything was written to the client.
	Written bool
	// Usage is the engine's reported usage, if its response carried one.
	Usage *Final
}

// ErrUnknownModel is returned (wrapped) when the engine does not serve the
// requested model. It is the request's fault, not the engine's.
var ErrUnknownModel = errors.New("unknown model")

// ErrInvalid is returned (wrapped) when the engine rejects the request as
// invalid. It is the request's fault, not the engine's.
var ErrInvalid = errors.New("invalid request")

// ErrTooLarge is returned (wrapped) when the engine refuses the request for
// its size (a gRPC message over the worker's receive limit, an HTTP 413).
// It is the request's fault, not the engine's: no other engine of the same
// fleet takes it either.
var ErrTooLarge = errors.New("request too large for the engine")

// ErrTransfer is returned (wrapped, with ErrUnavailable) by Prefill when
// the prefill engine computed the prompt but could not hand its KV blocks
// to the decode engine: that side, or the link, was slow or gone. It is
// no fault of the prefill engine; the decode engine recomputes what it
// lacks.
var ErrTransfer = errors.New("kv transfer failed")

// ErrClientGone is returned (wrapped) when the response could not be
// written to the client: it hung up. It is the client's doing, never the
// engine's, whatever the engine was doing at the time.
var ErrClientGone = errors.New("client gone")

// PrefillRequest asks a prefill engine to compute a prompt's KV blocks and
// push those the decode engine lacks straight to it.
type PrefillRequest struct {
	Request *Request
	// TransferID names the transfer on the decode engine.
	TransferID string
	// DecodeAddr is the decode engine's KV transfer address (host:port).
	DecodeAddr string
	// MinRemoteTokens: when the decode engine lacks fewer tokens than this,
	// the prefill engine skips and the decode engine prefills locally.
	MinRemoteTokens int
	// TransferTimeout bounds the push; 0 means the call's deadline.
	TransferTimeout time.Duration
}

// PrefillResult is what a prefill did.
type PrefillResult struct {
	// Skipped: nothing was computed or sent; SkipReason says why.
	Skipped    bool
	SkipReason string
	// PromptTokens of the request; CachedTokens found in the prefill
	// engine's cache; DecodeHeldTokens the leading tokens the decode engine
	// already held.
	PromptTokens     int
	CachedTokens     int
	DecodeHeldTokens int
	// BlocksSent were pushed (BytesSent bytes); BlocksHeld were skipped
	// because the decode engine held them.
	BlocksSent int
	BlocksHeld int
	BytesSent  int64
	// BlocksRejected were dropped by the decode engine as corrupt; it
	// recomputes them.
	BlocksRejected int
	// Queue, Prefill and Transfer are the real time spent waiting,
	// computing and pushing.
	Queue, Prefill, Transfer time.Duration
}

// Disaggregator is implemented by clients of engines that serve
// disaggregated prefill and decode (baton workers with role prefill or
// decode).
type Disaggregator interface {
	// Prefill runs req's prefill and pushes its blocks to the decode
	// engine. An error means the decode engine may hold some of the blocks,
	// none wrong: it recomputes whatever it lacks.
	Prefill(ctx context.Context, req *PrefillRequest) (*PrefillResult, error)
	// Decode generates req on this engine after waiting, at most timeout,
	// for transfer transferID (empty: none) to end. Like Generate, an
	// error returned here means nothing was generated.
	Decode(ctx context.Context, req *Request, transferID string, timeout time.Duration) (Stream, error)
}
