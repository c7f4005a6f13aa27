package scheduler_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// loadYAML writes text to a config file and loads it.
func loadYAML(t *testing.T, text string) scheduler.Config {
	t.Helper()
	path := filepath.Join(t.TempDir(), "baton.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := scheduler.LoadConfig(path)
	if err != nil {
		t.Fatalf("LoadConfig: %v", err)
	}
	return cfg
}

// TestCustomProfileFromYAML: a profile defined in the configuration file
// routes as its parts say (here the prefix scorer outweighs load, so each
// conversation stays on one worker) and names itself in X-Baton-Route.
func TestCustomProfileFromYAML(t *testing.T) {
	_, workers := startWorkers(t, 3, fastScale)
	var ws strings.Builder
	for _, w := range workers {
		fmt.Fprintf(&ws, "  - {name: %s, address: %q}\n", w.Name, w.Address)
	}
	cfg := loadYAML(t, `
strategy: sticky
profiles:
  - name: sticky
    filters: [available, model]
    scorers:
      - {name: prefix, weight: 2}
      - {name: load, weight: 0.5}
    picker: max
workers:
`+ws.String())
	cfg.Pool = fastPool()
	_, addr := startScheduler(t, cfg)
	c := oaClient(t, addr)
	for conv := range 4 {
		doc := text(fmt.Sprintf("conversation %d", conv), 5000)
		first := chat(t, c, chatParams(doc+" first question", 4))
		if first.route != "sticky; spill=false" {
			t.Errorf("X-Baton-Route = %q, want %q", first.route, "sticky; spill=false")
		}
		for q := range 3 {
			if got := chat(t, c, chatParams(doc+fmt.Sprintf(" question %d", q), 4)); got.worker != first.worker {
				t.Errorf("conversation %d question %d went to %s, its first to %s", conv, q, got.worker, first.worker)
			}
		}
	}
}

// TestBadProfileNamesTheField: a custom profile that names an unknown
// part, or gives a part an option it does not know, is refused at start
// (by validation, before any worker is dialled) with an error naming the
// field by its path (and, for an option, its line).
func TestBadProfileNamesTheField(t *testing.T) {
	for _, tc := range []struct{ scorer, want string }{
		{"{name: lod, weight: 1}", `profiles[0].scorers[1].name: unknown scorer "lod" (known: kv, kv_usage, load, prefix)`},
		{"{name: strict, type: prefix, options: {concurrency_threshold: 4, block_size: 16}}",
			`profiles[0].scorers[1].options.block_size: line 7: unknown field (known: concurrency_threshold)`},
	} {
		cfg := loadYAML(t, `
strategy: mine
profiles:
  - name: mine
    scorers:
      - {name: prefix}
      - `+tc.scorer+`
workers:
  - {address: "127.0.0.1:1"}
`)
		var reg routing.Registry
		routing.RegisterBuiltins(&reg)
		if err := cfg.Validate(&reg); err == nil || err.Error() != tc.want {
			t.Errorf("%s: Validate = %v, want %q", tc.scorer, err, tc.want)
		}
		if _, err := scheduler.New(cfg, &reg, nil); err == nil || err.Error() != tc.want {
			t.Errorf("%s: New = %v, want %q", tc.scorer, err, tc.want)
		}
	}
}
