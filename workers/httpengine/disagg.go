package httpengine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strings"

	"github.com/batonllm/baton/workers/engine"
)

// Disaggregated prefill/decode between engines of one kind, through their
// own protocols: the scheduler asks a prefill engine to compute the prompt
// and a decode engine to generate from the KV blocks the two exchange
// directly.

// Protocol is how an engine hands a prompt's KV cache to another.
type Protocol int

const (
	// Colocated engines prefill and decode each request themselves.
	Colocated Protocol = iota
	// NIXL is vLLM's NixlConnector: the prefill request carries
	// kv_transfer_params asking for a remote decode, and its response's
	// kv_transfer_params go, verbatim, in the decode request, whose
	// engine pulls the blocks from the prefill engine.
	NIXL
	// Bootstrap is SGLang's: the same request, carrying the prefill
	// engine's bootstrap host and port and a random room, goes to the
	// prefill and the decode engine at once; they meet in that room.
	Bootstrap
)

func (p Protocol) String() string {
	switch p {
	case NIXL:
		return "nixl"
	case Bootstrap:
		return "bootstrap"
	}
	return "colocated"
}

// DefaultBootstrapPort is SGLang's --disaggregation-bootstrap-port default.
const DefaultBootstrapPort = 8998

// WithProtocol has the engine serve disaggregated prefill or decode by p.
// For Bootstrap, host and port name the engine's bootstrap server, which
// decode engines reach when this one prefills: host defaults to the host
// of the engine's URL, port to DefaultBootstrapPort.
func WithProtocol(p Protocol, bootstrapHost string, bootstrapPort int) Option {
	return func(c *Client) {
		c.protocol, c.bootstrapHost, c.bootstrapPort = p, bootstrapHost, bootstrapPort
	}
}

// Protocol returns the engine's disaggregation protocol.
func (c *Client) Protocol() Protocol { return c.protocol }

// Bootstrap returns the host and port of the engine's bootstrap server
// (Bootstrap protocol only).
func (c *Client) Bootstrap() (host string, port int) { return c.bootstrapHost, c.bootstrapPort }

// setBootstrapDefaults fills in the bootstrap address from u, the engine's
// URL, as SGLang's own load balancer does.
func (c *Client) setBootstrapDefaults(u *url.URL) {
	if c.protocol != Bootstrap {
		return
	}
	if c.bootstrapHost == "" {
		c.bootstrapHost = u.Hostname()
		if strings.Contains(c.bootstrapHost, ":") {
			c.bootstrapHost = "[" + c.bootstrapHost + "]"
		}
	}
	if c.bootstrapPort == 0 {
		c.bootstrapPort = DefaultBootstrapPort
	}
}

// ErrNoKVParams is returned (wrapped, with engine.ErrTransfer) by
// PrefillNIXL when the engine answered without kv_transfer_params: it
// runs without a KV connector, so no decode engine can use its work.
var ErrNoKVParams = errors.New("the prefill engine answered no kv_transfer_params (is it started with --kv-transfer-config?)")

// NIXLResult is a vLLM prefill engine's answer.
type NIXLResult struct {
	// Params is the response's kv_transfer_params, verbatim: the decode
	// request carries it unchanged, whatever fields the engine's version
	// puts in it.
	Params json.RawMessage
	// Usage is the prefill's usage, if it reported one; CachedReported
	// says whether it had prompt_tokens_details.cached_tokens (vLLM's
	// --enable-prompt-tokens-details).
	Usage          *engine.Final
	CachedReported bool
}

// maxPrefillBody bounds the prefill engine's answer read: one token and
// the transfer parameters, with a prompt's logprobs at most.
const maxPrefillBody = 8 << 20

// PrefillNIXL runs req's prefill on a vLLM engine (NIXL protocol): it
// posts NIXLPrefillBody(req.Body) to req.Path with X-Request-Id req.ID,
// which the decode request must carry too, and returns the transfer
// parameters the decode engine needs. Its errors are Generate's: a
// *StatusError for a status that is not 2xx, engine.ErrUnavailable when
// the engine cannot be reached; and ErrNoKVParams.
func (c *Client) PrefillNIXL(ctx context.Context, req *engine.Request) (*NIXLResult, error) {
	if req == nil {
		return nil, fmt.Errorf("prefill: %w: nil request", ErrInvalid)
	}
	body, err := NIXLPrefillBody(req.Body)
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	resp, err := c.post(ctx, req, body)
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		return nil, fmt.Errorf("prefill: %w", &StatusError{Status: resp.StatusCode, Message: strings.TrimSpace(string(msg))})
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillBody))
	if err != nil {
		return nil, fmt.Errorf("prefill: reading response: %w", transportError(ctx, err))
	}
	var answer struct {
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
		Usage            *usageJSON      `json:"usage"`
	}
	if err := json.Unmarshal(b, &answer); err != nil {
		return nil, fmt.Errorf("prefill: %w: decoding response: %w", engine.ErrUnavailable, err)
	}
	p := bytes.TrimSpace(answer.KVTransferParams)
	if len(p) == 0 || string(p) == "null" {
		return nil, fmt.Errorf("prefill: %w: %w", engine.ErrTransfer, ErrNoKVParams)
	}
	res := &NIXLResult{Params: p}
	if answer.Usage != nil {
		res.Usage = toFinal(answer.Usage, "")
		res.CachedReported = answer.Usage.PromptTokensDetails != nil
	}
	return res, nil
}

// BootstrapResult is what an SGLang prefill engine answered.
type BootstrapResult struct {
	// Usage is the prefill's usage, if its response had one (it has the
	// client's stream and stream_options); CachedReported says whether
	// it had prompt_tokens_details.cached_tokens (SGLang's
	// --enable-cache-report, which leaves the details null while no
	// token was cached).
	Usage          *engine.Final
	CachedReported bool
}

// PrefillBootstrap runs req's prefill on an SGLang engine (Bootstrap
// protocol): it posts req.Body, which must already carry the bootstrap
// fields (BootstrapBody), to req.Path. It calls started once the engine
// answered with a 2xx status, then reads the response to its end, for its
// usage. Its errors are Generate's; it returns ctx's error when ctx ends
// first.
func (c *Client) PrefillBootstrap(ctx context.Context, req *engine.Request, started func()) (*BootstrapResult, error) {
	if req == nil {
		return nil, fmt.Errorf("prefill: %w: nil request", ErrInvalid)
	}
	resp, err := c.post(ctx, req, req.Body)
	if err != nil {
		return nil, fmt.Errorf("prefill: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		return nil, fmt.Errorf("prefill: %w", &StatusError{Status: resp.StatusCode, Message: strings.TrimSpace(string(msg))})
	}
	started()
	var usage usageTracker
	if isEventStream(resp.ContentType) {
		lr := pooledLineReader(resp.Body)
		defer lr.release()
		for {
			line, rerr := lr.next()
			if data, ok := dataPayload(line); ok && !bytes.Equal(data, doneMarker) {
				usage.observe(data)
			}
			if rerr == io.EOF {
				break
			}
			if rerr != nil {
				return nil, fmt.Errorf("prefill: reading response: %w", transportError(ctx, rerr))
			}
		}
	} else {
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillBody))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
		}
		if err != nil {
			return nil, fmt.Errorf("prefill: reading response: %w", transportError(ctx, err))
		}
		var c chunkJSON
		if json.Unmarshal(b, &c) == nil {
			usage.take(&c)
		}
	}
	res := &BootstrapResult{Usage: usage.final()}
	res.CachedReported = usage.usage != nil && usage.usage.PromptTokensDetails != nil
	return res, nil
}

// nixlPrefillParams asks a vLLM engine to prefill for a remote decode.
var nixlPrefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// NIXLPrefillBody returns the client's body as a vLLM prefill engine
// takes it, as vLLM's own disaggregation proxy sends it: with
// kv_transfer_params asking for a remote decode, not streamed, one token
// (max_tokens, and max_completion_tokens when the client set it), and
// without stream_options, min_tokens or min_completion_tokens, which
// one token cannot honour.
func NIXLPrefillBody(body []byte) ([]byte, error) {
	m, err := object(body)
	if err != nil {
		return nil, err
	}
	m["kv_transfer_params"] = nixlPrefillParams
	m["stream"] = json.RawMessage("false")
	m["max_tokens"] = json.RawMessage("1")
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = json.RawMessage("1")
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		delete(m, k)
	}
	return marshal(m)
}

// NIXLDecodeBody returns the client's body with kv_transfer_params set to
// params, a prefill engine's answer, verbatim.
func NIXLDecodeBody(body []byte, params json.RawMessage) ([]byte, error) {
	if !json.Valid(params) {
		return nil, fmt.Errorf("%w: kv_transfer_params is not JSON", ErrInvalid)
	}
	m, err := object(body)
	if err != nil {
		return nil, err
	}
	m["kv_transfer_params"] = params
	return marshal(m)
}

// BootstrapBody returns the client's body with the bootstrap fields that
// pair an SGLang prefill engine and a decode engine: both get the same.
func BootstrapBody(body []byte, host string, port int, room uint64) ([]byte, error) {
	m, err := object(body)
	if err != nil {
		return nil, err
	}
	h, _ := json.Marshal(host) // a string always marshals
	m["bootstrap_host"] = h
	m["bootstrap_port"] = json.RawMessage(fmt.Sprint(port))
	m["bootstrap_room"] = json.RawMessage(fmt.Sprint(room))
	return marshal(m)
}

// object decodes a request body, which must be a JSON object.
func object(body []byte) (map[string]json.RawMessage, error) {
	m := map[string]json.RawMessage{}
	if err := json.Unmarshal(body, &m); err != nil || m == nil {
		return nil, fmt.Errorf("%w: body is not a JSON object", ErrInvalid)
	}
	return m, nil
}

// marshal encodes a body whose values go out as they came: without
// json.Marshal's escaping of <, > and & in them.
func marshal(m map[string]json.RawMessage) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// withCachedTokens returns the response or chunk data with its usage's
// prompt_tokens_details.cached_tokens set to cached, and false with data
// unchanged if it carries no usage object.
func withCachedTokens(data []byte, cached int) ([]byte, bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		return data, false
	}
	var usage map[string]json.RawMessage
	if json.Unmarshal(m["usage"], &usage) != nil || usage == nil {
		return data, false
	}
	var details map[string]json.RawMessage
	_ = json.Unmarshal(usage["prompt_tokens_details"], &details)
	if details == nil {
		details = map[string]json.RawMessage{}
	}
	details["cached_tokens"] = json.RawMessage(fmt.Sprint(cached))
	var err error
	if usage["prompt_tokens_details"], err = marshal(details); err != nil {
		return data, false
	}
	if m["usage"], err = marshal(usage); err != nil {
		return data, false
	}
	out, err := marshal(m)
	if err != nil {
		return data, false
	}
	return out, true
}
