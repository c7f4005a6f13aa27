package workload

import (
	"strings"
	"testing"
)

func TestLoRA(t *testing.T) {
	w, err := LoRA(LoRAConfig{}, 2000, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Adapters) != 50 || len(w.Requests) != 2000 {
		t.Fatalf("%d adapters, %d requests; want 50, 2000", len(w.Adapters), len(w.Requests))
	}
	count := map[string]int{}
	system := map[string]string{}
	for _, r := range w.Requests {
		count[r.Model]++
		if s, ok := system[r.Model]; ok && s != r.Messages[0].Content {
			t.Fatalf("two system prompts for %s", r.Model)
		}
		system[r.Model] = r.Messages[0].Content
		if !strings.HasPrefix(r.Model, "lora-") {
			t.Fatalf("model %q is not an adapter", r.Model)
		}
	}
	if count["lora-0"] <= count["lora-10"] || count["lora-10"] == 0 && count["lora-0"] < 200 {
		t.Errorf("requests by adapter %v: want lora-0 far more popular than lora-10", count)
	}
	if system["lora-0"] == system["lora-1"] {
		t.Errorf("lora-0 and lora-1 share a system prompt")
	}
	again, _ := LoRA(LoRAConfig{}, 2000, 1)
	for i := range w.Requests {
		if w.Requests[i].Model != again.Requests[i].Model || w.Requests[i].Messages[1].Content != again.Requests[i].Messages[1].Content {
			t.Fatalf("request %d differs between two runs of one seed", i)
		}
	}
}
