package httpengine

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/workers/engine"
)

// decodeObject decodes a JSON object for comparison.
func decodeObject(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return m
}

func TestNIXLPrefillBody(t *testing.T) {
	for _, tc := range []struct {
		name, body, want string
	}{
		{
			name: "streamed chat with every bound",
			body: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":100,"max_completion_tokens":100,"min_tokens":5,"min_completion_tokens":5,"temperature":0}`,
			want: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":1,"max_completion_tokens":1,"temperature":0,` +
				`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
		},
		{
			name: "completion without bounds",
			body: `{"model":"m","prompt":"once upon"}`,
			want: `{"model":"m","prompt":"once upon","stream":false,"max_tokens":1,` +
				`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NIXLPrefillBody([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(decodeObject(t, []byte(tc.want)), decodeObject(t, got)); diff != "" {
				t.Errorf("prefill body (-want +got):\n%s", diff)
			}
		})
	}
	if _, err := NIXLPrefillBody([]byte(`[1]`)); !errors.Is(err, ErrInvalid) {
		t.Errorf("a body that is not an object: %v, want ErrInvalid", err)
	}
}

func TestNIXLDecodeBodyKeepsParamsVerbatim(t *testing.T) {
	params := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[3,1,2],"remote_engine_id":"e<1>&","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1,"future_field":{"x":[]}}`
	got, err := NIXLDecodeBody([]byte(`{"model":"m","prompt":"p","stream":true}`), json.RawMessage(params))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(got, &m); err != nil {
		t.Fatal(err)
	}
	if string(m["kv_transfer_params"]) != params {
		t.Errorf("kv_transfer_params = %s, want %s byte for byte", m["kv_transfer_params"], params)
	}
	if string(m["stream"]) != "true" || string(m["prompt"]) != `"p"` {
		t.Errorf("the client's fields changed: %s", got)
	}
	if _, err := NIXLDecodeBody([]byte(`{}`), json.RawMessage(`{`)); !errors.Is(err, ErrInvalid) {
		t.Errorf("params that are not JSON: %v, want ErrInvalid", err)
	}
}

func TestPrefillNIXL(t *testing.T) {
	const params = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[7,8],"remote_engine_id":"eng-1","remote_host":"h","remote_port":1,"extra":"kept"}`
	f := &fakeEngine{contentType: "application/json", events: []string{
		`{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"A"},"finish_reason":"length"}],` +
			`"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41,"prompt_tokens_details":{"cached_tokens":16}},"kv_transfer_params":` + params + `}`,
	}}
	c := startEngine(t, f)
	res, err := c.PrefillNIXL(testContext(t), &engine.Request{ID: "req-7", Path: "/v1/chat/completions", Body: []byte(chatBody)})
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Params) != params {
		t.Errorf("params = %s, want %s", res.Params, params)
	}
	if res.Usage == nil || res.Usage.CachedTokens != 16 || !res.CachedReported {
		t.Errorf("usage = %+v (reported %v), want 16 cached tokens", res.Usage, res.CachedReported)
	}
	if got := (*f.gotHeader.Load()).Get("X-Request-Id"); got != "req-7" {
		t.Errorf("X-Request-Id = %q, want req-7", got)
	}
	sent := decodeObject(t, *f.gotBody.Load())
	if sent["stream"] != false || sent["max_tokens"] != float64(1) || sent["stream_options"] != nil {
		t.Errorf("prefill request %v: want stream false, max_tokens 1, no stream_options", sent)
	}

	for _, tc := range []struct {
		name   string
		status int
		body   string
		want   error
	}{
		{"no params", 200, `{"choices":[],"kv_transfer_params":null}`, engine.ErrTransfer},
		{"params absent", 200, `{"choices":[]}`, ErrNoKVParams},
		{"engine failure", 500, `boom`, nil},
		{"overloaded", 503, `busy`, engine.ErrUnavailable},
		{"bad request", 400, `{"error":{}}`, engine.ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startEngine(t, &fakeEngine{status: tc.status, contentType: "application/json", events: []string{tc.body}})
			_, err := c.PrefillNIXL(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{"prompt":"x"}`)})
			if err == nil {
				t.Fatal("no error")
			}
			var se *StatusError
			if tc.want == nil && (!errors.As(err, &se) || se.Status != tc.status) {
				t.Errorf("error %v, want a StatusError %d", err, tc.status)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("error %v, want %v", err, tc.want)
			}
		})
	}
}

func TestProxyCachedRewritesUsage(t *testing.T) {
	t.Run("stream", func(t *testing.T) {
		c := startEngine(t, &fakeEngine{contentType: "text/event-stream", events: vllmChatEvents})
		rec := newRecorder()
		res, err := c.ProxyCached(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(chatBody)}, rec, nil, 7)
		if err != nil {
			t.Fatal(err)
		}
		if res.Usage == nil || res.Usage.CachedTokens != 7 || res.Usage.PromptTokens != 40 {
			t.Errorf("usage = %+v, want 40 prompt tokens, 7 cached", res.Usage)
		}
		body := rec.Body.String()
		if !strings.Contains(body, `"prompt_tokens_details":{"cached_tokens":7}`) || strings.Contains(body, `"cached_tokens":32`) {
			t.Errorf("relayed stream does not report 7 cached tokens:\n%s", body)
		}
		// Every other event is relayed unchanged.
		for _, ev := range vllmChatEvents {
			if !strings.Contains(ev, `"usage"`) && !strings.Contains(body, ev) {
				t.Errorf("event %q not relayed as sent", ev)
			}
		}
	})
	t.Run("whole response", func(t *testing.T) {
		c := startEngine(t, &fakeEngine{contentType: "application/json", events: []string{vllmChatJSON}})
		rec := newRecorder()
		res, err := c.ProxyCached(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{"model":"m"}`)}, rec, nil, 3)
		if err != nil {
			t.Fatal(err)
		}
		if res.Usage == nil || res.Usage.CachedTokens != 3 {
			t.Errorf("usage = %+v, want 3 cached", res.Usage)
		}
		var got struct {
			Choices []struct {
				Message struct{ Content string }
			}
			Usage usageJSON
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
			t.Fatalf("relayed body %q: %v", rec.Body, err)
		}
		if got.Usage.PromptTokensDetails == nil || got.Usage.PromptTokensDetails.CachedTokens != 3 || got.Choices[0].Message.Content != "Hello world" {
			t.Errorf("relayed %s, want the answer with 3 cached tokens", rec.Body)
		}
	})
	t.Run("refusal untouched", func(t *testing.T) {
		const e = `{"error":{"message":"bad","type":"BadRequestError","code":400},"usage":{"prompt_tokens":1}}`
		c := startEngine(t, &fakeEngine{status: 400, contentType: "application/json", events: []string{e}})
		rec := newRecorder()
		if _, err := c.ProxyCached(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, rec, nil, 3); err != nil {
			t.Fatal(err)
		}
		if rec.Body.String() != e {
			t.Errorf("relayed %q, want %q", rec.Body, e)
		}
	})
}

func TestBootstrap(t *testing.T) {
	for _, tc := range []struct {
		url, host string
		port      int
		wantHost  string
		wantPort  int
	}{
		{"http://10.0.0.7:30000", "", 0, "10.0.0.7", DefaultBootstrapPort},
		{"http://[::1]:30000", "", 9000, "[::1]", 9000},
		{"http://p0.local:30000", "10.1.1.1", 0, "10.1.1.1", DefaultBootstrapPort},
	} {
		c, err := New(tc.url, WithProtocol(Bootstrap, tc.host, tc.port))
		if err != nil {
			t.Fatal(err)
		}
		if h, p := c.Bootstrap(); h != tc.wantHost || p != tc.wantPort || c.Protocol() != Bootstrap {
			t.Errorf("%s: bootstrap %s:%d (%v), want %s:%d", tc.url, h, p, c.Protocol(), tc.wantHost, tc.wantPort)
		}
		c.Close()
	}
	body, err := BootstrapBody([]byte(`{"model":"m","prompt":"p"}`), "10.0.0.7", 8998, 1<<62+5)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":4611686018427387909,"model":"m","prompt":"p"}`
	if string(body) != want {
		t.Errorf("body %s, want %s", body, want)
	}
}

func TestPrefillBootstrap(t *testing.T) {
	f := &fakeEngine{contentType: "text/event-stream", events: vllmCompletionEvents}
	c := startEngine(t, f)
	started := 0
	res, err := c.PrefillBootstrap(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{"bootstrap_room":1}`)}, func() { started++ })
	if err != nil || started != 1 {
		t.Errorf("PrefillBootstrap = %v, started %d times; want nil, once", err, started)
	}
	if got := string(*f.gotBody.Load()); got != `{"bootstrap_room":1}` {
		t.Errorf("sent %s, want the body as given", got)
	}
	// The stream's usage has no prompt_tokens_details: nothing reported.
	if res == nil || res.Usage == nil || res.Usage.PromptTokens != 5 || res.CachedReported {
		t.Errorf("result %+v, want the stream's usage (5 prompt tokens), no cached tokens reported", res)
	}
	c = startEngine(t, &fakeEngine{status: http.StatusInternalServerError, events: []string{"boom"}})
	started = 0
	_, err = c.PrefillBootstrap(testContext(t), &engine.Request{Path: "/v1/completions", Body: []byte(`{}`)}, func() { started++ })
	var se *StatusError
	if !errors.As(err, &se) || se.Status != 500 || started != 0 {
		t.Errorf("PrefillBootstrap = %v, started %d times; want a 500, never started", err, started)
	}
}

// SGLang's usage: prompt_tokens_details is null unless --enable-cache-report
// is on and some prompt tokens were cached.
func TestPrefillBootstrapCachedTokens(t *testing.T) {
	for _, tc := range []struct {
		name, contentType string
		events            []string
		cached            int
		reported          bool
	}{
		{"whole response", "application/json", []string{vllmChatJSON}, 16, true},
		{"stream", "text/event-stream", []string{
			`data: {"id":"1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"length"}]}` + "\n\n",
			`data: {"id":"1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41,"prompt_tokens_details":{"cached_tokens":32}}}` + "\n\n",
			"data: [DONE]\n\n"}, 32, true},
		{"details null", "application/json", []string{
			`{"id":"1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41,"prompt_tokens_details":null}}`}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startEngine(t, &fakeEngine{contentType: tc.contentType, events: tc.events})
			res, err := c.PrefillBootstrap(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}, func() {})
			if err != nil {
				t.Fatal(err)
			}
			if res.Usage == nil || res.Usage.PromptTokens != 40 || res.Usage.CachedTokens != tc.cached || res.CachedReported != tc.reported {
				t.Errorf("result %+v (usage %+v), want 40 prompt tokens, %d cached, reported %v", res, res.Usage, tc.cached, tc.reported)
			}
		})
	}
}

func TestProxyCachedFunc(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cached func() (int, bool)
		want   int
	}{
		{"the prefill's count", func() (int, bool) { return 5, true }, 5},
		{"none: the engine's own", func() (int, bool) { return 0, false }, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startEngine(t, &fakeEngine{contentType: "application/json", events: []string{vllmChatJSON}})
			rec := newRecorder()
			res, err := c.ProxyCachedFunc(testContext(t), &engine.Request{Path: "/v1/chat/completions", Body: []byte(`{}`)}, rec, nil, tc.cached)
			if err != nil {
				t.Fatal(err)
			}
			var got struct{ Usage usageJSON }
			if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil {
				t.Fatalf("relayed body %q: %v", rec.Body, err)
			}
			if res.Usage == nil || res.Usage.CachedTokens != tc.want || got.Usage.PromptTokensDetails == nil || got.Usage.PromptTokensDetails.CachedTokens != tc.want {
				t.Errorf("usage %+v, relayed %s; want %d cached tokens", res.Usage, rec.Body, tc.want)
			}
		})
	}
}
