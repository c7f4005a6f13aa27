package workload

import (
	"fmt"
	"math/rand/v2"
)

// LoRAConfig shapes the lora workload.
type LoRAConfig struct {
	// Adapters is the number of LoRA adapters requests name. Default 50.
	Adapters int
	// ZipfS is the Zipf exponent of the adapters' popularity (> 1).
	// Default 1.1.
	ZipfS float64
	// SystemTokens is each adapter's shared system prompt. Default 1,500.
	SystemTokens int
}

// LoRA generates n requests of a multi-tenant fleet of fine-tuned
// variants: each names one of cfg.Adapters LoRA adapters (lora-0 the most
// popular, by Zipf popularity), whose system prompt (1,500 tokens) every
// request for it shares, then a question of 50–300 tokens; max_tokens
// 50–200. w.Adapters lists the adapters.
func LoRA(cfg LoRAConfig, n int, seed uint64) (*Workload, error) {
	if cfg.Adapters == 0 {
		cfg.Adapters = 50
	}
	if cfg.ZipfS == 0 {
		cfg.ZipfS = 1.1
	}
	if cfg.SystemTokens == 0 {
		cfg.SystemTokens = 1500
	}
	if cfg.Adapters < 2 || cfg.ZipfS <= 1 || cfg.SystemTokens < 1 || n < 0 {
		return nil, fmt.Errorf("lora: need adapters ≥ 2, zipf exponent > 1, system tokens ≥ 1; got %d, %v, %d", cfg.Adapters, cfg.ZipfS, cfg.SystemTokens)
	}
	w := &Workload{Name: "lora", Requests: make([]Request, n), Adapters: make([]string, cfg.Adapters),
		Describe: fmt.Sprintf("%d LoRA adapters (Zipf %.2f popularity), each with its %d-token system prompt; questions 50–300 tokens, max_tokens 50–200",
			cfg.Adapters, cfg.ZipfS, cfg.SystemTokens)}
	systems := make([]string, cfg.Adapters)
	for i := range systems {
		w.Adapters[i] = fmt.Sprintf("lora-%d", i)
		head := fmt.Sprintf("You are assistant %d.\n", i)
		systems[i] = head + Text(rngFor(seed, 7000+uint64(i)), cfg.SystemTokens*CharsPerToken-len(head))
	}
	rng := rngFor(seed, 7)
	zipf := rand.NewZipf(rng, cfg.ZipfS, 1, uint64(cfg.Adapters-1))
	for i := range w.Requests {
		a := int(zipf.Uint64())
		q := Text(rng, uniformInt(rng, 50, 300)*CharsPerToken)
		w.Requests[i] = Request{
			Model:     w.Adapters[a],
			Messages:  []Message{{Role: "system", Content: systems[a]}, {Role: "user", Content: q}},
			MaxTokens: uniformInt(rng, 50, 200),
		}
	}
	return w, nil
}
