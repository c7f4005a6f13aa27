package vllm

import (
	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
)

// Kind is vLLM served as an OpenAI-compatible engine: its load is scraped
// from its metrics, its KV cache events followed, its adapters loaded on
// demand, and its prefill and decode engines paired by NixlConnector.
var Kind = engine.Kind{
	Name: "vllm", URL: true, PD: engine.PDNIXL, DataParallel: true, Events: true,
	LoadsAdapters: true, AdapterSource: true, AdapterMetrics: true, Tokenizes: true,
	Connect: httpengine.Connect(engine.PDNIXL),
	Scrape:  scrape(VLLM),
}

// SGLangKind is SGLang served as an OpenAI-compatible engine: its load is
// scraped, its KV cache events followed, and its prefill and decode
// engines paired by its bootstrap server; its data-parallel ranks serve
// colocated only.
var SGLangKind = engine.Kind{
	Name: "sglang", URL: true, PD: engine.PDBootstrap, Bootstrap: true,
	DataParallel: true, DataParallelColocated: true, Events: true, Tokenizes: true,
	Connect: httpengine.Connect(engine.PDBootstrap),
	Scrape:  scrape(SGLang),
}

func scrape(e Engine) func(engine.Target) (engine.LoadScraper, error) {
	return func(t engine.Target) (engine.LoadScraper, error) {
		var (
			s   *Scraper
			err error
		)
		if t.DPSize > 1 {
			s, err = NewRankScraper(t.Address, t.MetricsPath, e, t.Rank, WithTLS(t.TLS))
		} else {
			s, err = NewScraper(t.Address, t.MetricsPath, e, WithTLS(t.TLS))
		}
		if err != nil {
			return nil, err
		}
		return s, nil
	}
}
