package httpengine

import (
	"strings"
	"testing"

	"github.com/batonllm/baton/workers/engine"
)

func TestWithModel(t *testing.T) {
	tests := []struct{ in, want string }{
		{`{"id":"x","model":"base","choices":[]}`, `{"id":"x","model":"sql","choices":[]}`},
		{`{"choices":[{"text":"\"model\":\"no\""}], "model" : "base" ,"n":1}`, `{"choices":[{"text":"\"model\":\"no\""}], "model" : "sql" ,"n":1}`},
		{`{"choices":[{"x":{"model":"nested"}}],"model":"base"}`, `{"choices":[{"x":{"model":"nested"}}],"model":"sql"}`},
		{`{"model":null}`, `{"model":"sql"}`},
	}
	for _, tt := range tests {
		got, ok := withModel([]byte(tt.in), "sql")
		if !ok || string(got) != tt.want {
			t.Errorf("withModel(%s) = %s, %v; want %s", tt.in, got, ok, tt.want)
		}
	}
	for _, in := range []string{`{"id":"x"}`, `[1]`, `{"model":`, ``} {
		if got, ok := withModel([]byte(in), "sql"); ok || string(got) != in {
			t.Errorf("withModel(%s) = %s, %v; want it unchanged", in, got, ok)
		}
	}
}

// A response names the model the client asked for, streamed or not,
// whatever the engine named; one that names it already is relayed as it
// came.
func TestProxyNamesAskedModel(t *testing.T) {
	for _, stream := range []bool{false, true} {
		for _, asked := range []string{"sql", "m", ""} {
			events, ct := []string{vllmChatJSON}, "application/json"
			if stream {
				events, ct = vllmChatEvents, "text/event-stream"
			}
			c := startEngine(t, &fakeEngine{contentType: ct, events: events})
			rec := newRecorder()
			res, err := c.Proxy(testContext(t), &engine.Request{Model: asked, Path: "/v1/chat/completions", Body: []byte(chatBody), Stream: stream}, rec, nil)
			if err != nil {
				t.Fatalf("Proxy: %v", err)
			}
			want := strings.Join(events, "")
			if asked == "sql" {
				want = strings.ReplaceAll(want, `"model":"m"`, `"model":"sql"`)
			}
			if got := rec.Body.String(); got != want {
				t.Errorf("stream %v, asked %q: relayed\n%s\nwant\n%s", stream, asked, got, want)
			}
			if res.Usage == nil || res.Usage.PromptTokens != 40 {
				t.Errorf("stream %v, asked %q: usage %+v", stream, asked, res.Usage)
			}
		}
	}
}
