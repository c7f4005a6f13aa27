package tune

import (
	"bytes"
	"context"
	"encoding/csv"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/batonllm/baton/bench/vsim"
	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func excerpt(t *testing.T, n int) *workload.Workload {
	t.Helper()
	recs, err := workload.LoadTrace(filepath.Join("..", "workload", "testdata", "mooncake_conversation_head.jsonl"), n, workload.ParseMooncake)
	if err != nil {
		t.Fatal(err)
	}
	return workload.Mooncake(recs, 1)
}

func smallSearch() Options {
	return Options{GPUs: 3, GPUCounts: []int{2, 3}, SLOTTFT: 2 * time.Second, SLOITL: 50 * time.Millisecond,
		Strategies: []string{"random", "kv_aware"}, Thresholds: []int{8, 16}, MinRemote: []int{512, 2048}, Top: 2,
		Base: vsim.Config{Seed: 1}}
}

func TestSearch(t *testing.T) {
	w := excerpt(t, 30)
	rep, err := Search(context.Background(), smallSearch(), w)
	if err != nil {
		t.Fatal(err)
	}
	// Stage 1: 3 shapes × 2 strategies; stage 2 and 3 add variants.
	if len(rep.Candidates) < 6 {
		t.Fatalf("%d candidates", len(rep.Candidates))
	}
	seen := map[string]bool{}
	for i, c := range rep.Candidates {
		if seen[c.Config.Label()] {
			t.Errorf("%s ran twice", c.Config.Label())
		}
		seen[c.Config.Label()] = true
		if i > 0 && better(&rep.Candidates[i-1], &c) > 0 {
			t.Errorf("candidate %d (%s) ranks above %d", i, c.Config.Label(), i-1)
		}
		if c.Goodput < 0 || c.Attainment < 0 || c.Attainment > 1 || c.Events == 0 {
			t.Errorf("%s: goodput %v attainment %v events %d", c.Config.Label(), c.Goodput, c.Attainment, c.Events)
		}
	}
	for _, want := range []string{"colocated:3 random", "disagg:1:2 random min_remote=512", "disagg:2:1 kv_aware threshold=16 min_remote=512"} {
		if !seen[want] {
			t.Errorf("%q not searched", want)
		}
	}
	if rep.Best != &rep.Candidates[0] {
		t.Error("Best is not the first candidate")
	}
	if len(rep.ByGPUs) != 2 || rep.ByGPUs[0].Config.GPUs() != 2 || rep.ByGPUs[1].Config.GPUs() != 3 {
		t.Errorf("goodput against GPUs: %+v", rep.ByGPUs)
	}
	// A search is deterministic, whatever the parallelism.
	o := smallSearch()
	o.Parallel = 1
	again, err := Search(context.Background(), o, w)
	if err != nil {
		t.Fatal(err)
	}
	strip := func(cs []Candidate) []Candidate {
		out := append([]Candidate(nil), cs...)
		for i := range out {
			out[i].Wall = 0
		}
		return out
	}
	if !reflect.DeepEqual(strip(rep.Candidates), strip(again.Candidates)) {
		t.Error("two searches differ")
	}

	// The files, and a snippet baton serve accepts.
	dir := t.TempDir()
	files, err := rep.WriteFiles(dir)
	if err != nil || len(files) != 4 {
		t.Fatalf("wrote %v: %v", files, err)
	}
	f, _ := os.Open(filepath.Join(dir, "candidates.csv"))
	rows, err := csv.NewReader(f).ReadAll()
	f.Close()
	if err != nil || len(rows) != len(rep.Candidates)+1 {
		t.Errorf("CSV: %d rows, %v", len(rows), err)
	}
	var md bytes.Buffer
	rep.Markdown(&md)
	for _, want := range []string{"## Best on", "```yaml", "## Goodput against GPUs", "| configuration |"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

// Every snippet is a configuration baton serve loads and validates, with
// the routing it names.
func TestSnippetLoads(t *testing.T) {
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	for _, c := range []vsim.Config{
		{Workers: 4, Strategy: "kv_aware", ConcurrencyThreshold: 8},
		{Prefill: 2, Decode: 6, Strategy: "prefix_aware", ConcurrencyThreshold: 32, MinRemotePrefillTokens: 2048},
		{Workers: 1, Strategy: "random"},
	} {
		path := filepath.Join(t.TempDir(), "baton.yaml")
		if err := os.WriteFile(path, []byte(Snippet(c)), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg, err := scheduler.LoadConfig(path)
		if err != nil {
			t.Fatalf("%s: %v\n%s", c.Label(), err, Snippet(c))
		}
		if err := cfg.Validate(reg); err != nil {
			t.Fatalf("%s: %v", c.Label(), err)
		}
		if cfg.Strategy != c.Strategy || len(cfg.Workers) != c.GPUs() ||
			c.ConcurrencyThreshold != 0 && cfg.ConcurrencyThreshold != c.ConcurrencyThreshold ||
			c.Disaggregated() && cfg.Disaggregation.MinRemotePrefillTokens != c.MinRemotePrefillTokens {
			t.Errorf("%s: loaded %+v", c.Label(), cfg)
		}
	}
}

func TestOptionsValidate(t *testing.T) {
	ok := smallSearch()
	for _, tc := range []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"gpus", func(o *Options) { o.GPUs = 0 }, "--gpus: must be at least 1"},
		{"ttft", func(o *Options) { o.SLOTTFT = 0 }, "--slo-ttft-p90: must be positive"},
		{"itl", func(o *Options) { o.SLOITL = -time.Second }, "--slo-itl-p90: must be positive"},
		{"threshold", func(o *Options) { o.Thresholds = []int{0} }, "--thresholds: must be 1–1024"},
		{"min remote", func(o *Options) { o.MinRemote = []int{0} }, "--min-remote: must be 1–1048576"},
		{"gpu counts", func(o *Options) { o.GPUCounts = []int{-1} }, "--gpu-counts: must be at least 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := ok
			tc.edit(&o)
			if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want %q", err, tc.want)
			}
		})
	}
	if err := ok.Validate(); err != nil {
		t.Errorf("valid options: %v", err)
	}
}
