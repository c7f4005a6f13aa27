package llamacpp

import (
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/vllm"
)

// Kind is llama.cpp's llama-server: an OpenAI-compatible engine whose
// load and slots are read (/metrics or /slots, /props), whose requests
// set cache_prompt, and which serves the configured adapters it was
// started with.
var Kind = engine.Kind{
	Name: "llamacpp", URL: true,
	Connect: func(t engine.Target) (engine.Client, error) {
		c, err := New(t.Address, httpengine.WithTLS(t.TLS))
		if err != nil {
			return nil, err
		}
		c.ServeAdapters(t.Adapters)
		return c, nil
	},
	Scrape: func(t engine.Target) (engine.LoadScraper, error) {
		s, err := NewScraper(t.Address, t.MetricsPath, vllm.WithTLS(t.TLS))
		if err != nil {
			return nil, err
		}
		return s, nil
	},
}
