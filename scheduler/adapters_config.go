package scheduler

import (
	"fmt"
	"slices"

	"github.com/batonllm/baton/workers/engine"
)

// AdapterConfig is a LoRA adapter the fleet serves as a model of its own
// name, loaded onto workers that serve its base model and have
// max_loras set.
type AdapterConfig struct {
	// Name is the model name requests give for it. Required; no other
	// adapter's, nor a model's.
	Name string `yaml:"name"`
	// BaseModel is the model it adapts. Required.
	BaseModel string `yaml:"base_model"`
	// Source is where engines load it from: vLLM's lora_path (a local
	// directory or a Hugging Face repository). Required for vllm workers;
	// baton workers load the adapters of their own configuration.
	Source string `yaml:"source"`
	// Size is the adapter's size in bytes, which the simulated engine's
	// load time is modelled from. Default 0.
	Size int64 `yaml:"size"`
}

// MaxMaxLoRAs bounds a worker's max_loras.
const MaxMaxLoRAs = 1024

// adapters returns the configured adapters as the engines take them.
func (c Config) adapters() []engine.Adapter {
	out := make([]engine.Adapter, len(c.Adapters))
	for i, a := range c.Adapters {
		out[i] = engine.Adapter{Name: a.Name, Base: a.BaseModel, Source: a.Source, Bytes: a.Size}
	}
	return out
}

// validateAdapters checks adapters: and the workers' max_loras.
func (c Config) validateAdapters() error {
	seen := map[string]bool{}
	// Workers that load adapters from their source, and the first's kind.
	fromSource := ""
	if i := slices.IndexFunc(c.Workers, func(w WorkerConfig) bool { k := kindOf(w.Kind); return k != nil && k.AdapterSource && w.MaxLoRAs > 0 }); i >= 0 {
		fromSource = c.Workers[i].Kind
	}
	for i, a := range c.Adapters {
		field := fmt.Sprintf("adapters[%d]", i)
		switch {
		case a.Name == "":
			return fmt.Errorf("%s.name: required", field)
		case seen[a.Name]:
			return fmt.Errorf("%s.name: %q is another adapter's", field, a.Name)
		case slices.Contains(c.Models, a.Name) || slices.ContainsFunc(c.Adapters, func(b AdapterConfig) bool { return b.BaseModel == a.Name }):
			return fmt.Errorf("%s.name: %q is a model", field, a.Name)
		case a.BaseModel == "":
			return fmt.Errorf("%s.base_model: required", field)
		case len(c.Models) > 0 && !slices.Contains(c.Models, a.BaseModel):
			return fmt.Errorf("%s.base_model: %q is not one of models %v", field, a.BaseModel, c.Models)
		case a.Source == "" && fromSource != "":
			return fmt.Errorf("%s.source: required: %s workers load adapters from it", field, fromSource)
		case a.Size < 0:
			return fmt.Errorf("%s.size: must not be negative, got %d", field, a.Size)
		}
		seen[a.Name] = true
	}
	for i, w := range c.Workers {
		switch {
		case w.MaxLoRAs < 0 || w.MaxLoRAs > MaxMaxLoRAs:
			return fmt.Errorf("workers[%d].max_loras: must be 0–%d, got %d", i, MaxMaxLoRAs, w.MaxLoRAs)
		case w.MaxLoRAs > 0 && !kindOfWorker(w).LoadsAdapters:
			return fmt.Errorf("workers[%d].max_loras: only %s workers load adapters (kind is %s)", i, kindList("and", loadsAdapters), w.Kind)
		}
	}
	return nil
}

// heldAdapters returns the adapters an engine's description says it holds:
// those it tells from its models, and the configured adapters among its
// models (a baton worker lists the adapters in its slots with them).
func (s *Scheduler) heldAdapters(d engine.Description) []string {
	held := slices.Clone(d.Adapters)
	for _, a := range s.cfg.Adapters {
		if slices.Contains(d.Models, a.Name) && !slices.Contains(held, a.Name) {
			held = append(held, a.Name)
		}
	}
	return held
}
