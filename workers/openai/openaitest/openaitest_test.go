package openaitest

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
)

func TestMessageText(t *testing.T) {
	for _, tt := range []struct {
		name, content, want string
	}{
		{"string", `"hello there"`, "hello there"},
		{"text parts", `[{"type":"text","text":"hello "},{"text":"there"}]`, "hello there"},
		{"other parts left out", `[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"hi"}]`, "hi"},
		{"neither", `42`, ""},
	} {
		m := Message{Role: "user", Content: json.RawMessage(tt.content)}
		if got := m.Text(); got != tt.want {
			t.Errorf("%s: Text() = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestUsage(t *testing.T) {
	const counts = `"completion_tokens":2,"prompt_tokens":40,`
	want := map[string]string{
		"cached":       `{` + counts + `"prompt_tokens_details":{"cached_tokens":32},"total_tokens":42}`,
		"no details":   `{` + counts + `"total_tokens":42}`,
		"null details": `{` + counts + `"prompt_tokens_details":null,"total_tokens":42}`,
	}
	got := map[string]any{
		"cached":       Usage(40, 2, Cached(32), false),
		"no details":   Usage(40, 2, nil, false),
		"null details": Usage(40, 2, nil, true),
	}
	for name, u := range got {
		if b, _ := json.Marshal(u); string(b) != want[name] {
			t.Errorf("%s: %s, want %s", name, b, want[name])
		}
	}
}

// A stream is one flushed data line a chunk, ending in data: [DONE].
func TestStream(t *testing.T) {
	for _, tt := range []struct {
		name string
		chat bool
		want string
	}{
		{"chat", true, `data: {"choices":[{"delta":{"content":"ok "},"finish_reason":null,"index":0}],"created":1,"id":"c1","model":"m","object":"chat.completion.chunk"}` + "\n\n" +
			`data: {"choices":[],"created":1,"id":"c1","model":"m","object":"chat.completion.chunk","usage":{"completion_tokens":1,"prompt_tokens":3,"total_tokens":4}}` + "\n\n" +
			"data: [DONE]\n\n"},
		{"text", false, `data: {"choices":[{"finish_reason":null,"index":0,"text":"ok "}],"created":1,"id":"c1","model":"m","object":"text_completion"}` + "\n\n" +
			`data: {"choices":[],"created":1,"id":"c1","model":"m","object":"text_completion","usage":{"completion_tokens":1,"prompt_tokens":3,"total_tokens":4}}` + "\n\n" +
			"data: [DONE]\n\n"},
	} {
		rec := httptest.NewRecorder()
		st := Completion{ID: "c1", Model: "m", Created: 1, Chat: tt.chat}.Stream(rec, "text/event-stream")
		st.Token("ok ", nil, nil)
		st.Usage(Usage(3, 1, nil, false))
		st.Done()
		if got := rec.Body.String(); got != tt.want {
			t.Errorf("%s:\n got %q\nwant %q", tt.name, got, tt.want)
		}
		if !rec.Flushed || rec.Header().Get("Content-Type") != "text/event-stream" {
			t.Errorf("%s: flushed %v, content type %q", tt.name, rec.Flushed, rec.Header().Get("Content-Type"))
		}
	}
}

func TestBody(t *testing.T) {
	c := Completion{ID: "c1", Model: "m", Created: 1, Chat: true}
	b, _ := json.Marshal(c.Body(c.Choice("hi", "stop", map[string]any{"logprobs": nil}), Usage(1, 1, nil, false), map[string]any{"timings": 1}))
	want := `{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":"hi","role":"assistant"}}],"created":1,"id":"c1","model":"m","object":"chat.completion","timings":1,"usage":{"completion_tokens":1,"prompt_tokens":1,"total_tokens":2}}`
	if string(b) != want {
		t.Errorf("Body:\n got %s\nwant %s", b, want)
	}
}

// A raw value passes through as it is, <, > and & included, as Python's
// json writes them.
func TestWriteJSONKeepsRawBytes(t *testing.T) {
	rec := httptest.NewRecorder()
	raw := `{"remote_host":"127.0.0.1","x":{"a":[1,"<&>"]}}`
	WriteJSON(rec, 200, "application/json", map[string]any{"kv_transfer_params": json.RawMessage(raw)})
	if got, want := rec.Body.String(), `{"kv_transfer_params":`+raw+"}\n"; got != want {
		t.Errorf("body %q, want %q", got, want)
	}
}
