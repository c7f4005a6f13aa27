package httpengine

import (
	"bytes"
	"encoding/json"
	"testing"
)

// decodedFirst is what firstChunk answers by decoding every chunk.
func decodedFirst(data []byte) (bool, usageTracker) {
	var u usageTracker
	var c chunkJSON
	if json.Unmarshal(data, &c) != nil {
		return false, u
	}
	u.take(&c)
	return c.hasGenerated(), u
}

// TestFirstChunkAsDecoded: the chunks engines stream (vLLM, SGLang,
// llama-server, OpenAI; chat and completions; reasoning and tool calls;
// usage, timings, finish reasons and errors) are read by firstChunk as
// decoding them reads them.
func TestFirstChunkAsDecoded(t *testing.T) {
	for _, chunk := range []string{
		`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":" map"},"logprobs":null,"finish_reason":null}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"\n"},"finish_reason":null}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"\"quoted\""}}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"reasoning":"think","content":null}}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t","type":"function","function":{"name":"f","arguments":""}}]}}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[ ]}}]}`,
		`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":null}}]}`,
		`{"id":"c","object":"text_completion","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}`,
		`{"id":"c","object":"text_completion","choices":[{"index":0,"text":" Paris","logprobs":{"tokens":[" Paris"],"text_offset":[0]},"finish_reason":null}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":"x"},"logprobs":{"content":[{"token":"x","logprob":-0.1}]}}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":[{"token":"x","logprob":-0.1}]}}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":"end"},"finish_reason":"stop"}],"usage":null}`,
		`{"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":3}}}`,
		`{"choices":[{"index":0,"delta":{"content":""}}],"timings":{"cache_n":16,"prompt_n":4}}`,
		`{"error":{"message":"boom","type":"server_error","code":500}}`,
		`{"object":"error","message":"old vLLM boom","type":"BadRequestError","code":400}`,
		`{"choices":[{"index":0,"message":{"role":"assistant","content":"whole"}}]}`,
		` { "choices" : [ { "index" : 0 , "delta" : { "content" : "spaced" } } ] }`,
		`{"choices":[{"index":0,"delta":{"content" : ""}},{"index":1,"delta":{"content":"second"}}]}`,
		`[1,2]`,
		`not json`,
	} {
		var fast usageTracker
		got := fast.firstChunk([]byte(chunk))
		want, slow := decodedFirst([]byte(chunk))
		if got != want || fast.finish != slow.finish || (fast.usage == nil) != (slow.usage == nil) || (fast.timings == nil) != (slow.timings == nil) {
			t.Errorf("%s:\n firstChunk generated %v finish %q usage %v timings %v\n decoded    generated %v finish %q usage %v timings %v",
				chunk, got, fast.finish, fast.usage != nil, fast.timings != nil, want, slow.finish, slow.usage != nil, slow.timings != nil)
		}
	}
}

// FuzzFirstChunk: chunks of the shapes engines stream, built from fuzzed
// values and spacing, are read by firstChunk as decoding them reads them.
func FuzzFirstChunk(f *testing.F) {
	f.Add("", "", "", "", false, false, "", false, false, 0)
	f.Add(" map", "", "", "", true, false, "", false, false, 1)
	f.Add("", "x", "", "", false, true, "stop", true, true, 2)
	f.Fuzz(func(t *testing.T, content, text, reasoning, reasoningContent string, role, tools bool, finish string, usage, timings bool, indent int) {
		delta := map[string]any{}
		if role {
			delta["role"] = "assistant"
		}
		delta["content"] = content
		if reasoning != "" {
			delta["reasoning"] = reasoning
		}
		if reasoningContent != "" {
			delta["reasoning_content"] = reasoningContent
		}
		if tools {
			delta["tool_calls"] = []any{map[string]any{"index": 0, "function": map[string]any{"name": content, "arguments": text}}}
		} else {
			delta["tool_calls"] = []any{}
		}
		choice := map[string]any{"index": 0, "delta": delta, "logprobs": nil, "finish_reason": nil}
		if text != "" {
			choice["text"] = text
		}
		if finish != "" {
			choice["finish_reason"] = finish
		}
		chunk := map[string]any{"id": "chatcmpl-" + text, "object": "chat.completion.chunk", "model": reasoning, "choices": []any{choice}}
		if usage {
			chunk["usage"] = map[string]any{"prompt_tokens": 3, "completion_tokens": 1}
		}
		if timings {
			chunk["timings"] = map[string]any{"cache_n": 2, "prompt_n": 1}
		}
		data, err := json.Marshal(chunk)
		if err != nil {
			t.Skip()
		}
		if indent%3 == 1 {
			var b bytes.Buffer
			json.Indent(&b, data, "", " ")
			data = b.Bytes()
		}
		var fast usageTracker
		got := fast.firstChunk(data)
		want, slow := decodedFirst(data)
		if got != want || fast.finish != slow.finish || (fast.usage == nil) != (slow.usage == nil) || (fast.timings == nil) != (slow.timings == nil) {
			t.Errorf("%s: firstChunk %v %q, decoded %v %q", data, got, fast.finish, want, slow.finish)
		}
	})
}
