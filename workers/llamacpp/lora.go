package llamacpp

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path"
	"strings"
	"sync/atomic"

	"github.com/batonllm/baton/workers/engine"
)

// llama-server loads its LoRA adapters at start (--lora, --lora-scaled)
// and has no API to load more: GET /lora-adapters lists them, by id, path
// and scale, and a request applies some with its lora field,
// [{"id", "scale"}] (those it leaves out at scale 0). The client names
// them after the configured adapters whose source is their path (or whose
// name is their file's, without extension).

// loraEntry is one adapter of GET /lora-adapters.
type loraEntry struct {
	ID    int     `json:"id"`
	Path  string  `json:"path"`
	Scale float64 `json:"scale"`
}

// heldLoRA is an adapter the server holds: its id and scale (1 when the
// server lists it at 0, loaded with --lora-init-without-apply).
type heldLoRA struct {
	id    int
	scale float64
}

// loraState is what the client knows of the server's adapters.
type loraState struct {
	known []engine.Adapter                    // set by ServeAdapters, before use
	held  atomic.Pointer[map[string]heldLoRA] // by adapter name; nil: none read
}

// ServeAdapters tells the client the fleet's LoRA adapters, so that
// Describe reports those the server holds and requests for them apply
// them. Call it before the client is used.
func (c *Client) ServeAdapters(list []engine.Adapter) {
	c.lora.known = list
}

// Describe lists the models the server serves (httpengine's Describe) and
// the configured adapters it holds, from GET /lora-adapters.
func (c *Client) Describe(ctx context.Context) (engine.Description, error) {
	d, err := c.Client.Describe(ctx)
	if err != nil || len(c.lora.known) == 0 {
		return d, err
	}
	entries, err := c.loraAdapters(ctx)
	if err != nil {
		return d, err
	}
	held := make(map[string]heldLoRA)
	for _, e := range entries {
		for _, a := range c.lora.known {
			if _, dup := held[a.Name]; !dup && loraMatches(a, e.Path) {
				s := e.Scale
				if s == 0 {
					s = 1
				}
				held[a.Name] = heldLoRA{id: e.ID, scale: s}
				d.Adapters = append(d.Adapters, a.Name)
			}
		}
	}
	c.lora.held.Store(&held)
	return d, nil
}

// loraMatches reports whether the server's adapter at p is a.
func loraMatches(a engine.Adapter, p string) bool {
	if a.Source != "" {
		return p == a.Source || path.Clean(p) == path.Clean(a.Source)
	}
	return strings.TrimSuffix(path.Base(p), path.Ext(p)) == a.Name
}

// loraAdapters reads GET /lora-adapters; a server without the route (404)
// holds none.
func (c *Client) loraAdapters(ctx context.Context) ([]loraEntry, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/lora-adapters", nil)
	if err != nil {
		return nil, fmt.Errorf("listing lora adapters: %w", err)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("listing lora adapters: %w: %w", engine.ErrUnavailable, err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, nil
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("listing lora adapters: %w: status %d", engine.ErrUnavailable, resp.StatusCode)
	}
	var list []loraEntry
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxBody)).Decode(&list); err != nil {
		return nil, fmt.Errorf("listing lora adapters: %w: %w", engine.ErrUnavailable, err)
	}
	return list, nil
}

// withLoRA returns body, a request for model, as the server must get it:
// for an adapter it holds, asking for the adapter's base model with the
// adapter applied (lora); for a base model, with none applied (an empty
// lora, unless the client set one), since a server started with --lora
// applies its adapters to requests that do not say. ok is false for an
// adapter the server does not hold, which it would serve as its base
// model.
func (c *Client) withLoRA(body []byte, model string) (out []byte, ok bool) {
	held := c.lora.held.Load()
	var adapter *engine.Adapter
	for i := range c.lora.known {
		if c.lora.known[i].Name == model {
			adapter = &c.lora.known[i]
		}
	}
	switch {
	case adapter == nil && (held == nil || len(*held) == 0):
		return body, true
	case adapter != nil && held == nil:
		return body, false
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil || fields == nil {
		return body, true // the server refuses it
	}
	if adapter == nil {
		if _, set := fields["lora"]; set {
			return body, true
		}
		fields["lora"] = json.RawMessage("[]")
	} else {
		h, found := (*held)[adapter.Name]
		if !found {
			return body, false
		}
		fields["model"], _ = json.Marshal(adapter.Base)
		fields["lora"], _ = json.Marshal([]map[string]any{{"id": h.id, "scale": h.scale}})
	}
	out, err := json.Marshal(fields)
	if err != nil {
		return body, true
	}
	return out, true
}
