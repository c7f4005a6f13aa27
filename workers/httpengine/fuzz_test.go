package httpengine

import (
	"bytes"
	"encoding/json"
	"io"
	"testing"
)

// FuzzEventStream feeds arbitrary engine output through the event-stream
// reading the proxy and Generate rely on: it must never panic, and usage
// it reports must come from a chunk that really carries one.
func FuzzEventStream(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\r\n\r\n"))
	f.Add([]byte("data: {\"choices\":[{\"finish_reason\":\"stop\",\"text\":\"\"}]}\n\n: comment\n\ndata:{\"error\":{\"message\":\"boom\"}}\n\n"))
	f.Add([]byte("data: {\"usage\":\"not an object\"}\n"))
	f.Fuzz(func(t *testing.T, body []byte) {
		lr := newLineReader(bytes.NewReader(body))
		var u usageTracker
		for {
			line, err := lr.next()
			if data, ok := dataPayload(line); ok && !bytes.Equal(data, doneMarker) {
				u.observe(data)
				var c chunkJSON
				if json.Unmarshal(data, &c) == nil {
					c.hasGenerated()
					c.errorMessage()
				}
			}
			isBlank(line)
			if err != nil {
				if err != io.EOF && err != errLineTooLong {
					t.Fatalf("unexpected error %v", err)
				}
				break
			}
		}
		if f := u.final(); f != nil && (f.PromptTokens < 0 && !bytes.Contains(body, []byte("-"))) {
			t.Fatalf("usage %+v from nowhere", f)
		}
	})
}

// FuzzDisaggBodies feeds arbitrary client bodies and engine answers
// through the rewriting of disaggregated requests and of a decode's usage:
// it must never panic, and what it returns for a JSON object is a JSON
// object that carries what it set.
func FuzzDisaggBodies(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":9}`),
		[]byte(`{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}`))
	f.Add([]byte(`{"prompt":"<&>"}`), []byte(`{"usage":{"prompt_tokens_details":{"cached_tokens":"x"}}}`))
	f.Add([]byte(`null`), []byte(`{"usage":[]}`))
	f.Fuzz(func(t *testing.T, body, answer []byte) {
		isObject := func(b []byte) bool {
			var m map[string]json.RawMessage
			return json.Unmarshal(b, &m) == nil && m != nil
		}
		if out, err := NIXLPrefillBody(body); err == nil {
			var m struct {
				Stream    bool `json:"stream"`
				MaxTokens int  `json:"max_tokens"`
			}
			if json.Unmarshal(out, &m) != nil || m.Stream || m.MaxTokens != 1 {
				t.Fatalf("prefill body %s of %s", out, body)
			}
		} else if isObject(body) {
			t.Fatalf("object %s refused: %v", body, err)
		}
		if out, err := NIXLDecodeBody(body, json.RawMessage(`{"remote_block_ids":[1]}`)); err == nil && !isObject(out) {
			t.Fatalf("decode body %s of %s", out, body)
		}
		if out, err := BootstrapBody(body, "h", 1, 7); err == nil && !bytes.Contains(out, []byte(`"bootstrap_room":7`)) {
			t.Fatalf("bootstrap body %s of %s", out, body)
		}
		if out, ok := withCachedTokens(answer, 5); ok {
			var c struct {
				Usage struct {
					Details struct {
						Cached json.RawMessage `json:"cached_tokens"`
					} `json:"prompt_tokens_details"`
				} `json:"usage"`
			}
			if json.Unmarshal(out, &c) != nil || string(c.Usage.Details.Cached) != "5" {
				t.Fatalf("rewritten %s of %s", out, answer)
			}
		} else if !bytes.Equal(out, answer) {
			t.Fatalf("%s changed to %s though not rewritten", answer, out)
		}
	})
}
