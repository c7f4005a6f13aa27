package strictyaml

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

type inner struct {
	Port    int           `yaml:"port"`
	Timeout time.Duration `yaml:"timeout"`
}

type Shared struct {
	Weight float64 `yaml:"weight"`
}

type doc struct {
	Name    string   `yaml:"name"`
	Enabled bool     `yaml:"enabled"`
	Tags    []string `yaml:"tags"`
	Size    uint8    `yaml:"size"`
	Inner   inner    `yaml:"inner"`
	List    []inner  `yaml:"list"`
	Skipped string   `yaml:"-"`
	Plain   int
	Shared  `yaml:",inline"`
	hidden  int
}

func TestUnmarshal(t *testing.T) {
	in := `
name: baton
enabled: true
tags: [a, b]
size: 200
inner: {port: 8080, timeout: 1m30s}
defaults: &d {port: 1, timeout: 2s}
`
	// defaults is not a field: the document above is rejected, the one
	// below is the same without it.
	if err := Unmarshal([]byte(in), &doc{}); err == nil || !strings.Contains(err.Error(), "defaults: line 7: unknown field") {
		t.Errorf("unknown field: %v", err)
	}
	in = `
name: baton
enabled: true
tags: [a, b]
size: 200
inner: {port: 8080, timeout: 1m30s}
list: [{port: 1}, null, {<<: {port: 2, timeout: 3s}, port: 3}]
plain: 7
weight: 0.5
`
	var got doc
	if err := Unmarshal([]byte(in), &got); err != nil {
		t.Fatal(err)
	}
	want := doc{Name: "baton", Enabled: true, Tags: []string{"a", "b"}, Size: 200,
		Inner: inner{Port: 8080, Timeout: 90 * time.Second},
		List:  []inner{{Port: 1}, {Port: 3, Timeout: 3 * time.Second}}, Plain: 7, Shared: Shared{Weight: 0.5}}
	if diff := cmp.Diff(want, got, cmp.AllowUnexported(doc{})); diff != "" {
		t.Errorf("decoded (-want +got):\n%s", diff)
	}
}

func TestUnmarshalErrors(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"nmae: x", "nmae: line 1: unknown field; did you mean name?"},
		{"zzzzzzzz: x", "zzzzzzzz: line 1: unknown field (known: name, enabled, tags, size, inner, list, plain, weight)"},
		{"inner: {port: 2.5}", "inner.port: line 1: 2.5 is not an integer"},
		{"inner: {timeout: 30}", "inner.timeout: line 1: 30 is not a duration (e.g. 30s, 10m)"},
		{"size: 300", "size: line 1: 300 is not a non-negative 8-bit integer"},
		{"size: -1", "size: line 1: -1 is not a non-negative integer"},
		{"enabled: maybe", `enabled: line 1: "maybe" is not true or false`},
		{"tags: a", `tags: line 1: "a" is not a list`},
		{"inner: [1]", "inner: line 1: a list is not a mapping of fields"},
		{"list: [{port: 1}, {port: x}]", `list[1].port: line 1: "x" is not an integer`},
		{"name: a\nname: b", "name: line 2: set twice (first on line 1)"},
		{"[1, 2]", "line 1: a list is not a mapping of fields"},
		{"hidden: 1", "hidden: line 1: unknown field"},
		{"a: &a [*a]", "a: line 1: unknown field"},
		{"inner: &i {port: 1, <<: *i}", "nested too deeply"},
	} {
		err := Unmarshal([]byte(c.in), &doc{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want one containing %q", c.in, err, c.want)
		}
	}
	if err := Unmarshal([]byte("name: x"), doc{}); err == nil {
		t.Error("a struct, not a pointer to one, was accepted")
	}
}

// An empty document, or one of comments, keeps every value.
func TestUnmarshalEmpty(t *testing.T) {
	for _, in := range []string{"", "# only a comment\n", "---\n"} {
		got := doc{Name: "kept"}
		if err := Unmarshal([]byte(in), &got); err != nil || got.Name != "kept" {
			t.Errorf("%q: %v, name %q", in, err, got.Name)
		}
	}
}

// FuzzUnmarshal: no document panics the decoder.
func FuzzUnmarshal(f *testing.F) {
	f.Add([]byte("name: x\nlist: [{port: 1}]\ninner: {timeout: 1s}\n"))
	f.Add([]byte("a: &a {b: *a}\ninner: *a\n"))
	f.Add([]byte("<<: [{name: a}, {plain: 2}]\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var d doc
		_ = Unmarshal(b, &d)
	})
}
