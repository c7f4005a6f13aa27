package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readmeLayout returns the rows of the README's Layout table, by folder.
func readmeLayout(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "## Layout\n")
	if !ok {
		t.Fatal("README.md has no Layout section")
	}
	rows := map[string]string{}
	row := regexp.MustCompile("^\\| `([^`]+)` \\| (.*) \\|$")
	for _, line := range strings.Split(rest, "\n") {
		if strings.HasPrefix(line, "## ") {
			break
		}
		if m := row.FindStringSubmatch(line); m != nil {
			rows[strings.TrimSuffix(m[1], "/")] = m[2]
		}
	}
	return rows
}

// The README's Layout table names every command of `baton help` and
// every folder of Go code, so that it cannot fall behind the tree.
func TestReadmeLayout(t *testing.T) {
	rows := readmeLayout(t)
	cmd, ok := rows["cmd/baton"]
	if !ok {
		t.Fatalf("the Layout table has no cmd/baton row: %v", rows)
	}
	for _, m := range regexp.MustCompile(`(?m)^  baton (\w+)`).FindAllStringSubmatch(usage, -1) {
		if !strings.Contains(cmd, "`"+m[1]+"`") {
			t.Errorf("the Layout table's cmd/baton row does not name the command %s", m[1])
		}
	}
	seen := map[string]bool{}
	// Each folder holding Go code is named in the row of its top folder
	// (scheduler/routing as `routing`, bench/cmd/faults as `faults`), or
	// has a row of its own.
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel("../..", path)
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && rel != "." || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		dir := filepath.ToSlash(filepath.Dir(rel))
		if dir == "." || seen[dir] {
			return nil
		}
		seen[dir] = true
		if _, ok := rows[dir]; ok {
			return nil
		}
		top, _, _ := strings.Cut(dir, "/")
		text, ok := rows[top]
		if !ok {
			t.Errorf("the Layout table has no row for %s/ (holding %s)", top, dir)
			return nil
		}
		if base := filepath.Base(dir); !strings.Contains(text, "`"+base+"`") && !strings.Contains(text, "`"+dir+"`") {
			t.Errorf("the Layout table's %s/ row does not name %s", top, dir)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
