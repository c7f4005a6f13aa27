package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

// regenerate is what brings bench/results/default up to date.
const regenerate = "run `make bench` on a quiet machine and copy bench/out/{report.md,report.json,summary.csv,*.png} into bench/results/default"

// benchCommand returns the baton command line of the Makefile's bench
// target ("baton bench --speedup 1.25"), as the report records it.
func benchCommand(t *testing.T) string {
	t.Helper()
	f, err := os.Open("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	inBench := false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "bench:"):
			inBench = true
		case inBench && strings.HasPrefix(line, "\t"):
			fields := strings.Fields(line)
			for i, f := range fields {
				if (f == "baton" || strings.HasSuffix(f, "/baton")) && i+1 < len(fields) && fields[i+1] == "bench" {
					return "baton " + strings.Join(fields[i+1:], " ")
				}
			}
		case inBench:
			inBench = false
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	t.Fatal("the Makefile's bench target runs no `baton bench`")
	return ""
}

// The committed report of `make bench` is what today's `make bench`
// writes: the same flags, the same rows and columns, rendered by today's
// report writer, with the figures today's scheduler records.
func TestCommittedDefaultReport(t *testing.T) {
	const dir = "results/default/"
	js, err := os.ReadFile(dir + "report.json")
	if err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(dir + "report.md")
	if err != nil {
		t.Fatal(err)
	}
	var rep Report
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields() // a field the writer no longer has
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("%sreport.json does not decode as today's report: %v; %s", dir, err, regenerate)
	}

	if want := benchCommand(t); rep.Command != want {
		t.Errorf("%sreport.json was run as %q, the Makefile's bench target runs %q; %s", dir, rep.Command, want, regenerate)
	}
	if want := []string{"random", "least_outstanding", "prefix_aware", "kv_aware"}; !slices.Equal(strategyNames(rep.Strategies), want) {
		t.Errorf("%sreport.json has columns %v, want %v (baton bench's default); %s", dir, strategyNames(rep.Strategies), want, regenerate)
	}
	// Today's scheduler reports each decision's thread CPU time and each
	// part of the routing profile.
	for _, s := range rep.Strategies {
		if s.DecisionCPUP50us == 0 || len(s.PartsUs) == 0 || s.TTFTMean == 0 {
			t.Errorf("%sreport.json: %s has no routing decision CPU time, routing parts or mean TTFT (it predates them); %s", dir, s.Strategy, regenerate)
		}
	}

	var got strings.Builder
	rep.Markdown(&got)
	if got.String() != string(md) {
		t.Errorf("%sreport.md is not what today's report writer makes of report.json (rows, columns or layout changed):\n%s\n%s",
			dir, firstDiff(string(md), got.String()), regenerate)
	}
}

func strategyNames(ss []StrategyReport) []string {
	var names []string
	for _, s := range ss {
		names = append(names, s.Strategy)
	}
	return names
}

// firstDiff describes the first line where committed and written differ.
func firstDiff(committed, written string) string {
	a, b := strings.Split(committed, "\n"), strings.Split(written, "\n")
	for i := 0; i < max(len(a), len(b)); i++ {
		var x, y string
		if i < len(a) {
			x = a[i]
		}
		if i < len(b) {
			y = b[i]
		}
		if x != y {
			return fmt.Sprintf("line %d:\n committed: %s\n written:   %s", i+1, x, y)
		}
	}
	return ""
}
