package httpengine

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/workers/engine"
)

// llama-server reports the prompt tokens it found cached in its timings
// (cache_n), and in its usage only in newer versions: the relay reads
// either, the usage's first.
func TestUsageFromLlamaTimings(t *testing.T) {
	tests := []struct {
		name   string
		chunks []string
		want   *engine.Final
	}{{
		name: "timings only",
		chunks: []string{
			`{"choices":[{"index":0,"delta":{"content":"hi"}}]}`,
			`{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":96,"prompt_n":24,"predicted_n":5}}`,
		},
		want: &engine.Final{FinishReason: "stop", PromptTokens: 120, CachedTokens: 96},
	}, {
		name: "usage without details",
		chunks: []string{
			`{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":120,"completion_tokens":5},"timings":{"cache_n":64,"prompt_n":56}}`,
		},
		want: &engine.Final{FinishReason: "length", PromptTokens: 120, CompletionTokens: 5, CachedTokens: 64},
	}, {
		name: "usage with details",
		chunks: []string{
			`{"choices":[],"usage":{"prompt_tokens":120,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":100}},"timings":{"cache_n":64,"prompt_n":56}}`,
		},
		want: &engine.Final{PromptTokens: 120, CompletionTokens: 5, CachedTokens: 100},
	}, {
		name:   "neither",
		chunks: []string{`{"choices":[{"index":0,"delta":{"content":"hi"}}]}`},
		want:   nil,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var u usageTracker
			for _, c := range tt.chunks {
				u.observe([]byte(c))
			}
			if diff := cmp.Diff(tt.want, u.final()); diff != "" {
				t.Errorf("usage (-want +got):\n%s", diff)
			}
		})
	}
}
