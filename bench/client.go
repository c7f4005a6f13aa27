package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/batonllm/baton/bench/workload"
)

// Result is what the load generator saw of one request. Times are wall
// clock seconds; the report converts them to modelled time.
type Result struct {
	Index int `json:"index"`
	// Lag is how late the request was sent against its scheduled arrival
	// (load generator or concurrency cap), seconds.
	Lag float64 `json:"lag"`
	// TTFT is from send to the first content chunk; E2E to the end of the
	// stream.
	TTFT float64 `json:"ttft"`
	E2E  float64 `json:"e2e"`
	// Gaps are the per-token times between consecutive content chunks.
	Gaps             []float64 `json:"-"`
	PromptTokens     int       `json:"prompt_tokens"`
	CachedTokens     int       `json:"cached_tokens"`
	CompletionTokens int       `json:"completion_tokens"`
	Worker           string    `json:"worker"`
	// PrefillWorker is the worker that prefilled the prompt for Worker
	// (X-Baton-Prefill-Worker), when another did.
	PrefillWorker string `json:"prefill_worker,omitempty"`
	// Route is the scheduler's X-Baton-Route: the strategy and its reason
	// (kv_aware's predicted hit, a spill, the prefill worker).
	Route string `json:"route,omitempty"`
	Spill bool   `json:"spill"`
	Err   string `json:"error,omitempty"`
	// Done is the wall offset, from the run's start, at which it ended.
	Done float64 `json:"done"`
}

type chatBody struct {
	Model         string             `json:"model"`
	Messages      []workload.Message `json:"messages"`
	MaxTokens     int                `json:"max_tokens"`
	Stream        bool               `json:"stream"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// send posts one streaming chat completion to base and reads the SSE
// stream to its end, timing the first token and every chunk after it. It
// reads the response to EOF, so that its connection serves the next
// request.
func send(ctx context.Context, hc *http.Client, base, model string, req *workload.Request, res *Result) {
	if req.Model != "" {
		model = req.Model
	}
	body := chatBody{Model: model, Messages: req.Messages, MaxTokens: req.MaxTokens, Stream: true}
	body.StreamOptions.IncludeUsage = true
	b, err := json.Marshal(&body)
	if err != nil {
		res.Err = err.Error()
		return
	}
	start := time.Now()
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(b))
	if err != nil {
		res.Err = err.Error()
		return
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(hr)
	if err != nil {
		res.Err = err.Error()
		return
	}
	defer resp.Body.Close()
	res.Worker = resp.Header.Get("X-Baton-Worker")
	res.PrefillWorker = resp.Header.Get("X-Baton-Prefill-Worker")
	res.Route = resp.Header.Get("X-Baton-Route")
	res.Spill = strings.Contains(res.Route, "spill=true")
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		res.Err = fmt.Sprintf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
		return
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var last time.Time
	done := false
	for {
		line, err := br.ReadSlice('\n')
		if err != nil && err != bufio.ErrBufferFull {
			if !done {
				res.Err = "stream ended without [DONE]: " + err.Error()
			}
			break
		}
		line = bytes.TrimSpace(line)
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			done = true
			break
		}
		now := time.Now()
		var c chunk
		if err := json.Unmarshal(data, &c); err != nil {
			res.Err = "bad SSE event: " + err.Error()
			break
		}
		if c.Error != nil {
			res.Err = "stream error: " + c.Error.Message
			break
		}
		if c.Usage != nil {
			res.PromptTokens = c.Usage.PromptTokens
			res.CompletionTokens = c.Usage.CompletionTokens
			res.CachedTokens = c.Usage.PromptTokensDetails.CachedTokens
		}
		if len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
			if last.IsZero() {
				res.TTFT = now.Sub(start).Seconds()
			} else {
				res.Gaps = append(res.Gaps, now.Sub(last).Seconds())
			}
			last = now
		}
	}
	res.E2E = time.Since(start).Seconds()
	if res.Err == "" && last.IsZero() {
		res.Err = "no content"
	}
	if done {
		// Read the response's end (its last chunk's terminator), as a
		// client that reads the stream to EOF does: a body closed before
		// it costs the connection, and the next request a new one.
		_, _ = io.Copy(io.Discard, io.LimitReader(br, drainAfterDone))
	}
}

// drainAfterDone bounds what send reads of a stream after its [DONE]
// event, which ends it: a server that sends more loses the connection.
const drainAfterDone = 4 << 10
