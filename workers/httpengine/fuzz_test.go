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
