package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

var (
	batonOnce sync.Once
	batonBin  string
	batonErr  error
	batonDir  string
)

// buildBaton builds baton once for the package's smoke tests.
func buildBaton(t *testing.T) string {
	t.Helper()
	batonOnce.Do(func() {
		if batonDir, batonErr = os.MkdirTemp("", "faults-test-"); batonErr != nil {
			return
		}
		batonBin = filepath.Join(batonDir, "baton")
		if out, err := exec.Command("go", "build", "-o", batonBin, "github.com/batonllm/baton/cmd/baton").CombinedOutput(); err != nil {
			batonErr = err
			t.Logf("go build:\n%s", out)
		}
	})
	if batonErr != nil {
		t.Fatalf("go build: %v", batonErr)
	}
	return batonBin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if batonDir != "" {
		os.RemoveAll(batonDir)
	}
	os.Exit(code)
}

// smoke runs faults on a real fleet with short windows and returns the
// report's row of each, split into columns.
func smoke(t *testing.T, faults ...string) (map[string][]string, string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds baton and runs a fleet of processes")
	}
	redis, err := redistest.Binary()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(redistest.EnvServer, redis)
	bin := buildBaton(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	// A loaded machine slows everything: a generous client deadline, so
	// that a hang means one.
	err = run(ctx, []string{"-baton", bin, "-faults", strings.Join(faults, ","), "-clients", "2",
		"-before", "1s", "-during", "3s", "-after", "1s", "-deadline", "30s"}, &out)
	report := out.String()
	if err != nil {
		t.Fatalf("run: %v\n%s", err, report)
	}
	rows := map[string][]string{}
	for _, line := range strings.Split(report, "\n") {
		for _, f := range faults {
			if strings.HasPrefix(line, "| "+f+" |") {
				rows[f] = strings.Split(line, " | ")
			}
		}
	}
	for _, f := range faults {
		if len(rows[f]) < 11 {
			t.Fatalf("no %s row in the report:\n%s", f, report)
		}
	}
	if !strings.Contains(report, "(0 still open") {
		t.Errorf("requests still open at the end:\n%s", report)
	}
	return rows, report
}

// allOK checks that a row's requests all ended well.
func allOK(t *testing.T, row []string, report string) {
	t.Helper()
	for i, col := range map[int]string{5: "429", 6: "503", 7: "error events", 8: "truncated", 9: "hangs", 10: "other"} {
		if row[i] != "0" {
			t.Errorf("%s: %s: got %s, want 0\n%s", row[0], col, row[i], report)
		}
	}
	if row[2] == "0" || row[3] != row[2] {
		t.Errorf("%s: sent %s, ok %s: want all of some ok\n%s", row[0], row[2], row[3], report)
	}
}

// TestRedisDownSmoke runs the matrix's redis-down fault on a real fleet
// with short windows: every request the clients sent ends, none hangs,
// none is cut short, none gets a 503 (the tier is bypassed).
func TestRedisDownSmoke(t *testing.T) {
	rows, report := smoke(t, "redis-down")
	allOK(t, rows["redis-down"], report)
}

// TestLinkFaultsSmoke runs corrupt-transfer and watch-gap on a real
// fleet: every request ends well, and each fault was exercised and seen
// (the run fails otherwise: flipped blocks rejected by the decode
// workers, texts compared with an uncorrupted replay; dropped Watch
// events detected as gaps).
func TestLinkFaultsSmoke(t *testing.T) {
	rows, report := smoke(t, "corrupt-transfer", "watch-gap")
	for _, f := range []string{"corrupt-transfer", "watch-gap"} {
		allOK(t, rows[f], report)
	}
	for _, c := range []struct {
		fault, re, what string
	}{
		{"corrupt-transfer", `(\d+) flipped; decode workers: (\d+) rejected`, "blocks flipped, rejected"},
		{"corrupt-transfer", `(\d+) flipped;.* replicas: (\d+) rejected blocks counted`, "blocks flipped, rejected blocks the replicas counted"},
		{"corrupt-transfer", `(\d+) of (\d+) texts equal`, "texts equal, compared"},
		{"watch-gap", `(\d+) events dropped.*resyncs gap (\d+),`, "Watch events dropped, gaps seen"},
	} {
		m := regexp.MustCompile(c.re).FindStringSubmatch(rows[c.fault][1])
		switch {
		case m == nil:
			t.Errorf("%s: no %q in %q", c.fault, c.re, rows[c.fault][1])
		case m[1] != m[2]:
			t.Errorf("%s: %s: %s and %s, want them equal\n%s", c.fault, c.what, m[1], m[2], report)
		}
	}
	if !strings.Contains(rows["corrupt-transfer"][1], " 0 transfers broken off") {
		t.Errorf("corrupt-transfer broke transfers off, where a flipped byte should only get blocks rejected:\n%s", report)
	}
}
