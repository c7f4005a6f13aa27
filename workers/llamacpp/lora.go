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
// and scale (newer servers add task_name, prompt_prefix and aLoRA fields,
// which the client does not read), and a request applies some with its
// lora field, [{"id", "scale"}]. The client names them after the
// configured adapters whose source is their path (or whose name is their
// file's, without extension).
//
// What a request gets from the adapters its lora field leaves out, or
// from an empty or absent lora, differs between servers: a late-2026
// server applies every adapter it holds at scale 1 to a request whose
// lora is [], even one started with --lora-init-without-apply. So the
// client names every adapter the server holds in every request to a
// server that holds any: the one asked for at its scale, the others (all
// of them, for the base model) at 0. It must know them for that: until it
// has read the list (Describe, or before the first request), a request
// waits for the list to be read, and is refused as the server being
// unavailable (engine.ErrUnavailable) if it cannot be, rather than sent
// for output the client did not ask for.

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

// loraList is what the client read of the server's adapters.
type loraList struct {
	ids    []int               // every adapter it holds
	byName map[string]heldLoRA // the configured adapters among them
}

// loraState is what the client knows of the server's adapters.
type loraState struct {
	known []engine.Adapter         // set by ServeAdapters, before use
	held  atomic.Pointer[loraList] // nil: not read yet
}

// ServeAdapters tells the client the fleet's LoRA adapters, so that
// Describe reports those the server holds and requests for them apply
// them. Call it before the client is used.
func (c *Client) ServeAdapters(list []engine.Adapter) {
	c.lora.known = list
}

// Describe lists the models the server serves (httpengine's Describe) and
// the configured adapters it holds, from GET /lora-adapters, which it
// reads again for the requests that follow.
func (c *Client) Describe(ctx context.Context) (engine.Description, error) {
	d, err := c.Client.Describe(ctx)
	if err != nil {
		return d, err
	}
	l, err := c.readLoRA(ctx)
	if err != nil {
		return d, err
	}
	for _, a := range c.lora.known {
		if _, ok := l.byName[a.Name]; ok {
			d.Adapters = append(d.Adapters, a.Name)
		}
	}
	return d, nil
}

// readLoRA reads the server's adapters and keeps them.
func (c *Client) readLoRA(ctx context.Context) (*loraList, error) {
	entries, err := c.loraAdapters(ctx)
	if err != nil {
		return nil, err
	}
	l := &loraList{byName: make(map[string]heldLoRA)}
	for _, e := range entries {
		l.ids = append(l.ids, e.ID)
		for _, a := range c.lora.known {
			if _, dup := l.byName[a.Name]; !dup && loraMatches(a, e.Path) {
				s := e.Scale
				if s <= 0 {
					s = 1
				}
				l.byName[a.Name] = heldLoRA{id: e.ID, scale: s}
			}
		}
	}
	c.lora.held.Store(l)
	return l, nil
}

// heldLoRA returns the server's adapters, reading them first if they are
// not known yet.
func (c *Client) heldLoRA(ctx context.Context) (*loraList, error) {
	if l := c.lora.held.Load(); l != nil {
		return l, nil
	}
	return c.readLoRA(ctx)
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

// loraScale is one entry of a request's lora field.
type loraScale struct {
	ID    int     `json:"id"`
	Scale float64 `json:"scale"`
}

// withLoRA returns body, a request for model, as the server holding l
// must get it: for an adapter it holds, asking for the adapter's base
// model with that adapter applied and every other at scale 0; for a base
// model, every adapter at 0 (unless the client set lora itself). ok is
// false for an adapter the server does not hold, which it would serve as
// its base model.
func (c *Client) withLoRA(body []byte, model string, l *loraList) (out []byte, ok bool) {
	var adapter *engine.Adapter
	for i := range c.lora.known {
		if c.lora.known[i].Name == model {
			adapter = &c.lora.known[i]
		}
	}
	var h heldLoRA
	if adapter != nil {
		if h, ok = l.byName[adapter.Name]; !ok {
			return body, false
		}
	} else if len(l.ids) == 0 {
		return body, true
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil || fields == nil {
		return body, true // the server refuses it
	}
	if _, set := fields["lora"]; set && adapter == nil {
		return body, true
	}
	scales := make([]loraScale, len(l.ids))
	for i, id := range l.ids {
		scales[i].ID = id
		if adapter != nil && id == h.id {
			scales[i].Scale = h.scale
		}
	}
	if adapter != nil {
		fields["model"], _ = json.Marshal(adapter.Base)
	}
	fields["lora"], _ = json.Marshal(scales)
	out, err := json.Marshal(fields)
	if err != nil {
		return body, true
	}
	return out, true
}
