package scheduler

import (
	"strings"
	"testing"
)

func TestAdaptersConfigValidate(t *testing.T) {
	good := func() Config {
		return Config{
			Workers: []WorkerConfig{
				{Name: "w0", Address: "127.0.0.1:9000", MaxLoRAs: 2},
				{Name: "v0", Kind: KindVLLM, Address: "http://127.0.0.1:8000", MaxLoRAs: 4},
			},
			Adapters: []AdapterConfig{
				{Name: "sql", BaseModel: "llama", Source: "/adapters/sql", Size: 1 << 26},
				{Name: "chat", BaseModel: "llama", Source: "org/chat-lora"},
			},
		}
	}
	if err := good().Validate(registry()); err != nil {
		t.Fatalf("valid adapters config: %v", err)
	}
	for _, tt := range []struct {
		name   string
		change func(*Config)
		want   string
	}{
		{"no name", func(c *Config) { c.Adapters[1].Name = "" }, "adapters[1].name: required"},
		{"twice", func(c *Config) { c.Adapters[1].Name = "sql" }, "adapters[1].name:"},
		{"a base model's name", func(c *Config) { c.Adapters[0].Name = "llama" }, "adapters[0].name:"},
		{"a listed model", func(c *Config) { c.Models = []string{"llama", "sql"} }, "adapters[0].name:"},
		{"no base", func(c *Config) { c.Adapters[0].BaseModel = "" }, "adapters[0].base_model: required"},
		{"base not served", func(c *Config) { c.Models = []string{"qwen"} }, "adapters[0].base_model:"},
		{"no source for vllm", func(c *Config) { c.Adapters[1].Source = "" }, "adapters[1].source: required"},
		{"negative size", func(c *Config) { c.Adapters[0].Size = -1 }, "adapters[0].size:"},
		{"negative max_loras", func(c *Config) { c.Workers[0].MaxLoRAs = -1 }, "workers[0].max_loras:"},
		{"huge max_loras", func(c *Config) { c.Workers[1].MaxLoRAs = 5000 }, "workers[1].max_loras:"},
		{"http worker", func(c *Config) { c.Workers[1].Kind = KindHTTP }, "workers[1].max_loras:"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := good()
			tt.change(&c)
			err := c.Validate(registry())
			if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
				t.Errorf("Validate = %v, want an error starting %q", err, tt.want)
			}
		})
	}
	// Without vllm workers loading adapters, a source is not needed.
	c := good()
	c.Workers = c.Workers[:1]
	c.Adapters[0].Source = ""
	if err := c.Validate(registry()); err != nil {
		t.Errorf("baton workers only, adapter without source: %v", err)
	}
}
