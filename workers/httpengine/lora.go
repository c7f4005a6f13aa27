package httpengine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/batonllm/baton/workers/engine"
)

// LoRA adapter routes of vLLM's OpenAI server (with
// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
const (
	LoadAdapterPath   = "/v1/load_lora_adapter"
	UnloadAdapterPath = "/v1/unload_lora_adapter"
)

// LoadAdapter has the engine load a: POST /v1/load_lora_adapter with
// {"lora_name", "lora_path"}. An engine that answers it already holds the
// adapter (vLLM's 400 "has already been loaded") counts as a success.
func (c *Client) LoadAdapter(ctx context.Context, a engine.Adapter) error {
	body, err := json.Marshal(struct {
		Name string `json:"lora_name"`
		Path string `json:"lora_path"`
	}{a.Name, a.Source})
	if err != nil {
		return err
	}
	status, msg, err := c.adapterCall(ctx, LoadAdapterPath, body)
	switch {
	case err != nil:
		return fmt.Errorf("loading adapter %s: %w", a.Name, err)
	case status == http.StatusOK:
		return nil
	case status == http.StatusBadRequest && strings.Contains(msg, "already been loaded"):
		return nil
	}
	return fmt.Errorf("loading adapter %s: %w", a.Name, &StatusError{Status: status, Message: msg})
}

// UnloadAdapter has the engine unload the adapter name: POST
// /v1/unload_lora_adapter with {"lora_name"}. An engine that does not
// hold it (404) counts as a success.
func (c *Client) UnloadAdapter(ctx context.Context, name string) error {
	body, err := json.Marshal(struct {
		Name string `json:"lora_name"`
	}{name})
	if err != nil {
		return err
	}
	status, msg, err := c.adapterCall(ctx, UnloadAdapterPath, body)
	switch {
	case err != nil:
		return fmt.Errorf("unloading adapter %s: %w", name, err)
	case status == http.StatusOK, status == http.StatusNotFound:
		return nil
	}
	return fmt.Errorf("unloading adapter %s: %w", name, &StatusError{Status: status, Message: msg})
}

// adapterCall posts body to path and returns the status and the start of
// the answer.
func (c *Client) adapterCall(ctx context.Context, path string, body []byte) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	c.setAuth(req)
	resp, err := c.hc.Do(req)
	if err != nil {
		return 0, "", transportError(ctx, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	return resp.StatusCode, strings.TrimSpace(string(msg)), nil
}

var _ engine.AdapterLoader = (*Client)(nil)
