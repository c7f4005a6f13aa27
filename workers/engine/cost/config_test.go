package cost

import (
	"errors"
	"strings"
	"testing"
)

func TestConfigDefaults(t *testing.T) {
	got, err := Config{}.Engine()
	if err != nil {
		t.Fatalf("Config{}.Engine(): %v", err)
	}
	want, err := NewEngine(DefaultModel, DefaultGPU, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("Config{}.Engine() = %+v, want %+v", got, want)
	}
	c, err := Config{Model: "llama-3.1-70b", GPU: "h200", TP: 2, MFU: 0.4, BandwidthEfficiency: 0.7}.Engine()
	if err != nil {
		t.Fatal(err)
	}
	if c.Model.Name != "llama-3.1-70b" || c.GPU.Name != "h200" || c.TP != 2 || c.MFU != 0.4 || c.BandwidthEfficiency != 0.7 {
		t.Errorf("Engine() = %+v, want the fields set", c)
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name  string
		cfg   Config
		field string // the error's prefix; "" for a valid config
	}{
		{"zero", Config{}, ""},
		{"70b fits one h100", Config{Model: "llama-3.1-70b", TP: 1}, ""},
		{"unknown model", Config{Model: "gpt-9"}, "model: "},
		{"unknown gpu", Config{GPU: "a100"}, "gpu: "},
		{"negative tp", Config{TP: -1}, "tp: "},
		{"mfu above 1", Config{MFU: 2}, "mfu: "},
		{"negative mfu", Config{MFU: -0.1}, "mfu: "},
		{"negative bandwidth efficiency", Config{BandwidthEfficiency: -0.5}, "bandwidth_efficiency: "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.field == "" {
				if err != nil {
					t.Errorf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tt.field) {
				t.Errorf("Validate() = %v, want an error naming %q", err, tt.field)
			}
		})
	}
	if _, err := (Config{Model: "gpt-9"}).Engine(); !errors.Is(err, ErrUnknownPreset) {
		t.Errorf("Engine() of an unknown model: %v, want ErrUnknownPreset", err)
	}
}
