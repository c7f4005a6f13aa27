package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/batonllm/baton/bench/workload"
)

// A small run of both kinds on the trace's head reports every offered
// rate it tried, the index's memory and a saturation line, and writes the
// CSV and the plots.
func TestRunReports(t *testing.T) {
	dir := t.TempDir()
	o, err := parseFlags([]string{"-workers", "4", "-blocks", "2K", "-steps", "2", "-ops", "1000",
		"-min-step", "10ms", "-start", "1K", "-out", dir,
		"-trace", filepath.Join("..", "..", "workload", "testdata", "mooncake_conversation_head.jsonl")})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := run(&b, o); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"load average", "events      4     2K", "learned     4     2K", "saturation"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, f := range []string{"results.csv", "index_events_throughput.png", "index_learned_latency.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", f, err)
		}
	}
	// The CSV reads back, step for step, and plots again.
	rs, err := readCSV(filepath.Join(dir, "results.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[0].kind != "events" || rs[1].kind != "learned" || rs[0].workers != 4 || len(rs[0].steps) == 0 {
		t.Errorf("read back %+v", rs)
	}
	for _, r := range rs {
		for _, s := range r.steps {
			if (s.perCore > 0) != (s.blockPerCore > 0) {
				t.Errorf("%s: %v ops and %v block ops per CPU second", r.kind, s.perCore, s.blockPerCore)
			}
		}
	}
	// Offered far past saturation, a step counts the operations and the
	// block operations one CPU second does; every operation carries one
	// key at least.
	sat := t.TempDir()
	o.out, o.start, o.steps, o.kinds = sat, 1e9, 1, []string{"events"}
	if err := run(&strings.Builder{}, o); err != nil {
		t.Fatal(err)
	}
	rs, err = readCSV(filepath.Join(sat, "results.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if s := rs[0].steps[0]; s.keptUp || s.perCore <= 0 || s.blockPerCore < s.perCore {
		t.Errorf("past saturation: %+v", s)
	}
	again := t.TempDir()
	if err := run(&strings.Builder{}, options{plotFrom: filepath.Join(dir, "results.csv"), out: again}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(again, "index_events_latency.png")); err != nil {
		t.Error(err)
	}
}

func TestParseFlagsRejects(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-kind", "radix"}, "-kind"},
		{[]string{"-workers", "0"}, "-workers"},
		{[]string{"-blocks", "x"}, "-blocks"},
		{[]string{"-source", "azure"}, "-source"},
		{[]string{"-steps", "0"}, "-steps"},
		{[]string{"-keep-up", "2"}, "-keep-up"},
	} {
		if _, err := parseFlags(c.args); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseFlags(%q) = %v, want an error naming %s", c.args, err, c.want)
		}
	}
}

// The engine stands for a cache of cap blocks: it stores what it lacks,
// and evicts its oldest prompts' blocks no later prompt shares.
func TestEngineEvictsOldestPrompts(t *testing.T) {
	e := newEngine(4)
	st, rm := e.serve([]uint64{1, 2, 3}, nil, nil)
	if len(st) != 3 || len(rm) != 0 {
		t.Fatalf("first prompt: stored %v, removed %v", st, rm)
	}
	st, rm = e.serve([]uint64{1, 2, 4, 5}, nil, nil)
	if want := []uint64{4, 5}; !equal(st, want) {
		t.Errorf("second prompt stored %v, want %v", st, want)
	}
	if want := []uint64{3}; !equal(rm, want) {
		t.Errorf("second prompt removed %v, want %v (the first prompt's, but the shared 1, 2)", rm, want)
	}
	if !e.full {
		t.Error("an engine that held its capacity is not full")
	}
}

func equal(a, b []uint64) bool { return slices.Equal(a, b) }

// The trace source replays copies under disjoint keys, and a second pass
// under fresh ones.
func TestMooncakeCopies(t *testing.T) {
	recs := []workload.MooncakeRecord{{HashIDs: []uint64{0, 1}}, {HashIDs: []uint64{0, 2}}}
	m := newMooncake(recs, 2)
	if got := m.distinct(); got != 6 {
		t.Errorf("distinct = %d, want 6", got)
	}
	seen := map[uint64]int{}
	for range 8 { // two passes of 2 records × 2 copies
		for _, k := range m.next(nil) {
			seen[k]++
		}
	}
	if len(seen) != 12 {
		t.Errorf("two passes gave %d distinct keys, want 12", len(seen))
	}
}
