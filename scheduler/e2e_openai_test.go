package scheduler_test

import (
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/batonllm/baton/scheduler"
)

// TestOpenAIClient drives a served scheduler over three simulated workers
// with the official OpenAI Go client: every API shape answers, a repeated
// long prompt stays on its worker and hits its cache, and the probes and
// metrics agree with the traffic.
func TestOpenAIClient(t *testing.T) {
	_, workers := startWorkers(t, 3, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "prefix_aware", Workers: workers, Pool: fastPool()})
	c := oaClient(t, addr)
	hc := httpClient(t)
	names := []string{"w0", "w1", "w2"}

	t.Run("chat", func(t *testing.T) {
		got := chat(t, c, chatParams("Say hello.", 16))
		if got.content == "" || got.finish == "" || got.prompt == 0 {
			t.Errorf("chat = %+v, want content, finish_reason and prompt_tokens", got)
		}
		if !slices.Contains(names, got.worker) {
			t.Errorf("X-Baton-Worker = %q, want one of %v", got.worker, names)
		}
		if want := "prefix_aware; spill=false"; got.route != want {
			t.Errorf("X-Baton-Route = %q, want %q", got.route, want)
		}
	})

	t.Run("chat stream", func(t *testing.T) {
		got, err := streamChat(t, c, chatParams("Say hello in a stream.", 16))
		if err != nil {
			t.Fatal(err)
		}
		if got.content == "" || got.finish == "" || got.prompt == 0 {
			t.Errorf("streamed chat = %+v, want content, finish_reason and usage", got)
		}
		if !slices.Contains(names, got.worker) {
			t.Errorf("X-Baton-Worker = %q, want one of %v", got.worker, names)
		}
	})

	t.Run("completion", func(t *testing.T) {
		got, err := c.Completions.New(ctxT(t, 30*time.Second), openai.CompletionNewParams{
			Model:     model,
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
			MaxTokens: openai.Int(16),
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Choices) != 1 || got.Choices[0].Text == "" || got.Choices[0].FinishReason == "" {
			t.Fatalf("completion choices = %+v, want one with text and finish_reason", got.Choices)
		}
		if got.Usage.PromptTokens == 0 || got.Usage.CompletionTokens == 0 {
			t.Errorf("completion usage = %+v, want prompt and completion tokens", got.Usage)
		}
	})

	t.Run("completion stream", func(t *testing.T) {
		stream := c.Completions.NewStreaming(ctxT(t, 30*time.Second), openai.CompletionNewParams{
			Model:         model,
			Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a stream")},
			MaxTokens:     openai.Int(16),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		})
		defer stream.Close()
		var text, finish string
		var usage openai.CompletionUsage
		for stream.Next() {
			ch := stream.Current()
			for _, choice := range ch.Choices {
				text += choice.Text
				if choice.FinishReason != "" {
					finish = string(choice.FinishReason)
				}
			}
			if ch.Usage.PromptTokens > 0 {
				usage = ch.Usage
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if text == "" || finish == "" || usage.PromptTokens == 0 || usage.CompletionTokens == 0 {
			t.Errorf("streamed completion: text %q, finish %q, usage %+v; want all set", text, finish, usage)
		}
	})

	t.Run("repeated long prompt hits its worker's cache", func(t *testing.T) {
		p := chatParams(text("cache", 2500), 8)
		first := chat(t, c, p)
		if first.cached != 0 {
			t.Errorf("first request: cached_tokens = %d, want 0", first.cached)
		}
		second, err := streamChat(t, c, p)
		if err != nil {
			t.Fatal(err)
		}
		if second.worker != first.worker {
			t.Errorf("X-Baton-Worker: second request on %q, first on %q; want the same", second.worker, first.worker)
		}
		if second.cached <= 0 || second.cached > second.prompt {
			t.Errorf("second request: cached_tokens = %d of %d prompt tokens, want > 0", second.cached, second.prompt)
		}
	})

	t.Run("models", func(t *testing.T) {
		page, err := c.Models.List(ctxT(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, m := range page.Data {
			ids = append(ids, m.ID)
		}
		if !slices.Contains(ids, model) {
			t.Errorf("/v1/models = %v, want it to list %q", ids, model)
		}
	})

	t.Run("probes", func(t *testing.T) {
		for _, path := range []string{"/healthz", "/readyz", "/ping"} {
			if got := do(t, hc, http.MethodGet, "http://"+addr+path, "", nil).status; got != http.StatusOK {
				t.Errorf("GET %s = %d, want 200", path, got)
			}
		}
	})

	t.Run("metrics", func(t *testing.T) {
		// One rejected request, so failed outcomes appear too.
		_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("x", 1), option.WithJSONSet("n", 2))
		if err == nil {
			t.Fatal("n=2 succeeded, want a 400")
		}
		m := scrapeSettled(t, hc, addr)
		for _, name := range []string{"baton_requests_total", "baton_cached_tokens_total", "baton_prompt_tokens_total"} {
			if v, _ := metric(m, name); v <= 0 {
				t.Errorf("%s = %v, want > 0", name, v)
			}
		}
		if v, _ := metric(m, "baton_requests_total", `outcome="ok"`); v < 6 {
			t.Errorf(`baton_requests_total{outcome="ok"} = %v, want >= 6`, v)
		}
		accepted, _ := metric(m, "baton_requests_accepted_total")
		completed, _ := metric(m, "baton_requests_completed_total")
		failed, _ := metric(m, "baton_requests_failed_total")
		if accepted < 6 || accepted != completed+failed {
			t.Errorf("accepted %v, completed %v, failed %v: want accepted = completed + failed, >= 6", accepted, completed, failed)
		}
		invalid, _ := metric(m, "baton_requests_total", `outcome="invalid"`)
		if invalid < 1 {
			t.Errorf(`baton_requests_total{outcome="invalid"} = %v, want >= 1 after a rejected request`, invalid)
		}
	})
}
