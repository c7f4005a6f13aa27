package vllm

import (
	"encoding/json"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/workers/engine"
)

// The /tokenize body carries the client's values as they came: it decodes
// to what marshalling vLLM's TokenizeChatRequest or
// TokenizeCompletionRequest would give.
func TestTokenizeBody(t *testing.T) {
	yes := true
	for _, tc := range []struct {
		name, path, body string
		want             *tokenizeRequest
	}{
		{"chat", chatPath, `{"model":"m","messages":[{"role":"user","content":"a <b> & \"c\"\n"}], "stream":true}`,
			&tokenizeRequest{Model: "m", Messages: json.RawMessage(`[{"role":"user","content":"a <b> & \"c\"\n"}]`), AddGenerationPrompt: &yes}},
		{"chat with tools", chatPath, `{"messages": [ {"role":"user","content":"x"} ], "tools":[{"type":"function","function":{"name":"f"}}]}`,
			&tokenizeRequest{Model: "m", Messages: json.RawMessage(`[{"role":"user","content":"x"}]`),
				Tools: json.RawMessage(`[{"type":"function","function":{"name":"f"}}]`), AddGenerationPrompt: &yes}},
		{"chat, tools null", chatPath, `{"messages":[],"tools":null}`,
			&tokenizeRequest{Model: "m", Messages: json.RawMessage(`[]`), AddGenerationPrompt: &yes}},
		{"completion", "/v1/completions", `{"model":"m","prompt":"once \u003c upon"}`,
			&tokenizeRequest{Model: "m", Prompt: json.RawMessage(`"once \u003c upon"`)}},
		{"a list of prompts", "/v1/completions", `{"prompt":["a","b"]}`, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tokenizeBody(&engine.Request{Model: "m", Path: tc.path, Body: []byte(tc.body)})
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == nil {
				if got != nil {
					t.Errorf("body %s, want none", got)
				}
				return
			}
			want, _ := json.Marshal(tc.want)
			var g, w any
			if err := json.Unmarshal(got, &g); err != nil {
				t.Fatalf("body %s: %v", got, err)
			}
			json.Unmarshal(want, &w)
			if diff := cmp.Diff(w, g); diff != "" {
				t.Errorf("body %s (-want +got):\n%s", got, diff)
			}
		})
	}
	if _, err := tokenizeBody(&engine.Request{Path: chatPath, Body: []byte(`{`)}); err == nil {
		t.Error("a body that is not JSON: no error")
	}
}

var rawFieldsBodies = []string{
	`{}`,
	` { "model" : "m" , "messages" : [ {"role":"user","content":"a \"}] {[ b"} ] , "stream" : true } `,
	`{"prompt":"x\\"y","tools":null,"n":-1.5e3,"ok":false,"o":{"a":[1,{"b":"}"}]}}`,
	`{"messages":[],"messages":[{"role":"user"}]}`,
	`{"Messages":[1]}`,
	`{"mess\u0061ges":[1]}`,
	`{"prompt":["a","b"]}`,
	`[1]`,
	`{"prompt":"a"} x`,
}

func checkRawFields(t *testing.T, body string) {
	m, tl, p, ok := rawFields([]byte(body))
	if !ok || !json.Valid([]byte(body)) {
		return
	}
	var want struct {
		Messages json.RawMessage `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal([]byte(body), &want); err != nil {
		t.Fatalf("%s: read, but encoding/json says %v", body, err)
	}
	if string(m) != string(want.Messages) || string(tl) != string(want.Tools) || string(p) != string(want.Prompt) {
		t.Errorf("%s: messages %s, tools %s, prompt %s; encoding/json reads %s, %s, %s", body, m, tl, p, want.Messages, want.Tools, want.Prompt)
	}
}

// rawFields reads what encoding/json reads, or declines.
func TestRawFields(t *testing.T) {
	for _, b := range rawFieldsBodies {
		checkRawFields(t, b)
	}
	if _, _, _, ok := rawFields([]byte(`{"Messages":[1]}`)); ok {
		t.Error("a key in another case: read, want declined (encoding/json matches it)")
	}
}

func FuzzRawFields(f *testing.F) {
	for _, b := range rawFieldsBodies {
		f.Add(b)
	}
	f.Fuzz(checkRawFields)
}
