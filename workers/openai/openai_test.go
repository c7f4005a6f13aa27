package openai

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/batonllm/baton/workers/engine"
	"github.com/google/go-cmp/cmp"
)

func TestParseChat(t *testing.T) {
	body := `{"model":"m","messages":[{"role":"system","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"hello "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"world"}]}],
		"max_tokens":50,"max_completion_tokens":20,"stop":["\n\n","END"],"stream":true,"stream_options":{"include_usage":true},
		"prompt_cache_key":"tenant-1","temperature":0.2}`
	got, err := Parse(Chat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := engine.Request{
		Model: "m", Tenant: "tenant-1",
		Prompt:    "<|system|>\nbe brief\n<|user|>\nhello world\n",
		MaxTokens: 20, Stop: []string{"\n\n", "END"},
		Path: ChatPath, Body: []byte(body), Stream: true,
	}
	if diff := cmp.Diff(want, got.Request); diff != "" {
		t.Errorf("request (-want +got):\n%s", diff)
	}
	if !got.IncludeUsage {
		t.Error("IncludeUsage = false, want true")
	}
}

func TestChatTextIgnoresLayout(t *testing.T) {
	a, err := Parse(Chat, []byte(`{"model":"m","messages":[{"role":"user","content":"hi there"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Parse(Chat, []byte(`{ "messages" : [ { "content" : [{"type":"text","text":"hi "},{"type":"text","text":"there"}], "role":"user" } ], "model":"m" }`))
	if err != nil {
		t.Fatal(err)
	}
	if a.Prompt != b.Prompt {
		t.Errorf("equal conversations gave different routing text: %q vs %q", a.Prompt, b.Prompt)
	}
}

func TestParseCompletion(t *testing.T) {
	for _, body := range []string{`{"model":"m","prompt":"once upon"}`, `{"model":"m","prompt":["once upon"]}`} {
		got, err := Parse(Completion, []byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if got.Prompt != "once upon" || got.Path != CompletionPath {
			t.Errorf("%s: got prompt %q path %q", body, got.Prompt, got.Path)
		}
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		name, body string
		kind       Kind
		param      string
	}{
		{"malformed", `{"model":`, Chat, ""},
		{"not an object", `[1,2]`, Chat, ""},
		{"missing model", `{"messages":[{"role":"user","content":"x"}]}`, Chat, "model"},
		{"model not a string", `{"model":7,"messages":[{"role":"user","content":"x"}]}`, Chat, "model"},
		{"missing messages", `{"model":"m"}`, Chat, "messages"},
		{"empty messages", `{"model":"m","messages":[]}`, Chat, "messages"},
		{"messages not an array", `{"model":"m","messages":"hi"}`, Chat, "messages"},
		{"bad role", `{"model":"m","messages":[{"role":"wizard","content":"x"}]}`, Chat, "messages[0].role"},
		{"missing role", `{"model":"m","messages":[{"content":"x"}]}`, Chat, "messages[0].role"},
		{"content a number", `{"model":"m","messages":[{"role":"user","content":5}]}`, Chat, "messages[0].content"},
		{"text part without text", `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`, Chat, "messages[0].content[0].text"},
		{"max_tokens zero", `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}`, Chat, "max_tokens"},
		{"max_tokens string", `{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"5"}`, Chat, "max_tokens"},
		{"n two", `{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}`, Chat, "n"},
		{"too many stops", `{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}`, Chat, "stop"},
		{"stop a number", `{"model":"m","messages":[{"role":"user","content":"x"}],"stop":3}`, Chat, "stop"},
		{"stream_options without stream", `{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}`, Chat, "stream_options"},
		{"tenant too long", `{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_cache_key":"` + strings.Repeat("k", 65) + `"}`, Chat, "prompt_cache_key"},
		{"tenant leading space", `{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_cache_key":" k"}`, Chat, "prompt_cache_key"},
		{"tenant control char", `{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_cache_key":"a\tb"}`, Chat, "prompt_cache_key"},
		{"missing prompt", `{"model":"m"}`, Completion, "prompt"},
		{"token prompt", `{"model":"m","prompt":[1,2,3]}`, Completion, "prompt"},
		{"batched prompts", `{"model":"m","prompt":["a","b"]}`, Completion, "prompt"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(c.kind, []byte(c.body))
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("got %v, want an *Error", err)
			}
			if e.Status != http.StatusBadRequest || e.Type != TypeInvalidRequest || e.Param != c.param || e.Message == "" {
				t.Errorf("got status %d type %q param %q message %q; want 400 %q param %q", e.Status, e.Type, e.Param, e.Message, TypeInvalidRequest, c.param)
			}
		})
	}
}

// Type errors say what the field must be, in OpenAI's terms.
func TestParseTypeErrorMessages(t *testing.T) {
	const chat = `{"model":"m","messages":[{"role":"user","content":"x"}],`
	cases := []struct {
		name, body, param, message string
	}{
		{"max_tokens a fraction", chat + `"max_tokens":3.5}`, "max_tokens", "max_tokens must be an integer, got 3.5"},
		{"max_completion_tokens an exponent", chat + `"max_completion_tokens":1.5e1}`, "max_completion_tokens", "max_completion_tokens must be an integer, got 1.5e1"},
		{"max_tokens too large", chat + `"max_tokens":1e40}`, "max_tokens", "max_tokens is out of range, got 1e40"},
		{"max_tokens a string", chat + `"max_tokens":"5"}`, "max_tokens", "max_tokens must be of type integer, got string"},
		{"model a number", `{"model":7,"messages":[]}`, "model", "model must be of type string, got number"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(Chat, []byte(c.body))
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("got %v, want an *Error", err)
			}
			if e.Param != c.param || e.Message != c.message || e.Status != http.StatusBadRequest {
				t.Errorf("got %d param %q message %q; want 400 param %q message %q", e.Status, e.Param, e.Message, c.param, c.message)
			}
		})
	}
}

func TestWriteErrorShape(t *testing.T) {
	rec := httptest.NewRecorder()
	WriteError(rec, NoWorker("none"))
	if rec.Code != 503 || rec.Header().Get("Retry-After") != "1" {
		t.Errorf("got %d Retry-After %q", rec.Code, rec.Header().Get("Retry-After"))
	}
	var got map[string]map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]map[string]any{"error": {"message": "none", "type": "server_error", "param": nil, "code": "no_worker_available"}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("error body (-want +got):\n%s", diff)
	}
}

// events is a hand-written engine.Stream over fixed events.
type events struct {
	evs []engine.Event
	err error // returned after evs, instead of io.EOF, when set
}

func (s *events) Recv() (engine.Event, error) {
	if len(s.evs) == 0 {
		if s.err != nil {
			return engine.Event{}, s.err
		}
		return engine.Event{}, io.EOF
	}
	ev := s.evs[0]
	s.evs = s.evs[1:]
	return ev, nil
}
func (s *events) Close() error { return nil }

func sample() *events {
	return &events{evs: []engine.Event{
		{Text: " hello", Tokens: 1}, {Text: ` "q"` + "\n<", Tokens: 1},
		{Final: &engine.Final{FinishReason: "length", PromptTokens: 10, CachedTokens: 4, CompletionTokens: 2}},
	}}
}

func TestWriteStreamChat(t *testing.T) {
	req := &Request{Kind: Chat, IncludeUsage: true}
	req.Model, req.Stream = "m", true
	rec := httptest.NewRecorder()
	firsts, tokens := 0, 0
	final, written, err := Write(rec, req, "chatcmpl-1", sample(), &Observer{FirstToken: func() { firsts++ }, Token: func(n int) { tokens += n }})
	if err != nil || !written || final == nil || final.CachedTokens != 4 {
		t.Fatalf("got final %+v written %v err %v", final, written, err)
	}
	if firsts != 1 || tokens != 1 {
		t.Errorf("observer saw %d first tokens and %d later tokens, want 1 and 1", firsts, tokens)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("content type %q", ct)
	}
	var text strings.Builder
	var sawUsage, sawDone bool
	for _, ev := range strings.Split(strings.TrimSpace(rec.Body.String()), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			t.Fatalf("event without data: %q", ev)
		}
		if data == "[DONE]" {
			sawDone = true
			continue
		}
		var chunk struct {
			Object  string `json:"object"`
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Usage *usageBody `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		if chunk.Object != "chat.completion.chunk" {
			t.Errorf("object %q", chunk.Object)
		}
		for _, c := range chunk.Choices {
			text.WriteString(c.Delta.Content)
		}
		if chunk.Usage != nil {
			sawUsage = chunk.Usage.PromptTokensDetails.CachedTokens == 4 && chunk.Usage.TotalTokens == 12
		}
	}
	if got, want := text.String(), ` hello "q"`+"\n<"; got != want {
		t.Errorf("text %q, want %q", got, want)
	}
	if !sawUsage || !sawDone {
		t.Errorf("usage chunk %v, [DONE] %v", sawUsage, sawDone)
	}
}

func TestWriteJSONCompletion(t *testing.T) {
	req := &Request{Kind: Completion}
	req.Model = "m"
	rec := httptest.NewRecorder()
	if _, _, err := Write(rec, req, "cmpl-1", sample(), nil); err != nil {
		t.Fatal(err)
	}
	var got completionResponse
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if got.Object != "text_completion" || *got.Choices[0].Text != ` hello "q"`+"\n<" || got.Choices[0].FinishReason != "length" || got.Usage.PromptTokensDetails.CachedTokens != 4 {
		t.Errorf("got %+v", got)
	}
}

func TestWriteStreamBreaks(t *testing.T) {
	req := &Request{Kind: Chat}
	req.Model, req.Stream = "m", true

	// Broken before the first token: nothing written, the caller answers.
	rec := httptest.NewRecorder()
	_, written, err := Write(rec, req, "x", &events{err: errors.New("boom")}, nil)
	if err == nil || written || rec.Body.Len() != 0 {
		t.Errorf("before first token: written %v err %v body %q", written, err, rec.Body.String())
	}

	// Broken after it: the stream ends with an error event.
	rec = httptest.NewRecorder()
	_, written, err = Write(rec, req, "x", &events{evs: []engine.Event{{Text: "a", Tokens: 1}}, err: errors.New("boom")}, nil)
	if err == nil || !written {
		t.Fatalf("after first token: written %v err %v", written, err)
	}
	if body := rec.Body.String(); !strings.Contains(body, `data: {"error":`) || strings.Contains(body, "[DONE]") {
		t.Errorf("body %q: want an error event and no [DONE]", body)
	}
}

func TestAppendJSONString(t *testing.T) {
	for _, s := range []string{"", "plain", "q\"b\\s", "tab\t nl\n cr\r \x01 <&>", "héllo 語 \u2028", "bad \xff utf8"} {
		got := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatalf("%q encoded as %s: %v", s, got, err)
		}
		want, _ := json.Marshal(s)
		var wantBack string
		json.Unmarshal(want, &wantBack)
		if back != wantBack {
			t.Errorf("%q round-tripped to %q, want %q", s, back, wantBack)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`), true)
	f.Add([]byte(`{"model":"m","prompt":["x"],"stop":"y","max_tokens":3}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"stream":true,"stream_options":{}}`), true)
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		k := Completion
		if chat {
			k = Chat
		}
		r, err := Parse(k, body)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) || e.Status != 400 {
				t.Fatalf("error %v is not a 400 *Error", err)
			}
			return
		}
		if r.Model == "" || (r.MaxTokens < 0) || len(r.Stop) > MaxStop {
			t.Fatalf("accepted invalid request %+v", r)
		}
	})
}

// appendString must give what encoding/json gives, or leave the literal to
// it.
func TestAppendString(t *testing.T) {
	tests := []struct {
		raw    string
		wantOK bool
	}{
		{`""`, true},
		{`"plain text"`, true},
		{`"line\nbreak\ttab \"quoted\" back\\slash \/ \b\f\r"`, true},
		{`"ends in an escape\n"`, true},
		{`"\\\\"`, true},
		{`"héllo, 世界"`, true},
		{`"\u00e9"`, false},
		{`"a\\u0041"`, false}, // an escaped backslash before u: decoded by encoding/json
		{`"\ud83d\ude00"`, false},
		{"\"invalid \xff utf-8\"", false},
		{`not a string`, false},
	}
	for _, tt := range tests {
		var b strings.Builder
		b.WriteString("<")
		ok := appendString(&b, []byte(tt.raw))
		if ok != tt.wantOK {
			t.Errorf("appendString(%s) = %v, want %v", tt.raw, ok, tt.wantOK)
		}
		if !ok {
			if b.String() != "<" {
				t.Errorf("appendString(%s) failed but appended %q", tt.raw, b.String()[1:])
			}
			continue
		}
		var want string
		if err := json.Unmarshal([]byte(tt.raw), &want); err != nil {
			t.Fatalf("json.Unmarshal(%s): %v", tt.raw, err)
		}
		if got := b.String()[1:]; got != want {
			t.Errorf("appendString(%s) = %q, want %q", tt.raw, got, want)
		}
	}
}

func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "a\nb", `"q"`, "tab\there", "\\", "é", "\x00\x1f", "\u2028"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		raw, _ := json.Marshal(s)
		var want string
		if err := json.Unmarshal(raw, &want); err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		if appendString(&b, raw) && b.String() != want {
			t.Errorf("appendString(%s) = %q, want %q", raw, b.String(), want)
		}
	})
}

// BenchmarkParseChat parses a chat request whose prompt is an
// 8,000-token document (~32 KB).
func BenchmarkParseChat(b *testing.B) {
	doc := strings.Repeat("Lorem ipsum dolor sit amet.\n", 32000/28)
	body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 1, "stream": true,
		"messages": []map[string]string{{"role": "system", "content": "be brief"}, {"role": "user", "content": doc}}})
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := Parse(Chat, body); err != nil {
			b.Fatal(err)
		}
	}
}
