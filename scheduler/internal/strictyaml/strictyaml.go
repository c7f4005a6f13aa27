// Package strictyaml decodes YAML into Go structs as yaml.v3 with
// KnownFields does, but with errors in the configuration's own terms: each
// names the field by its path (pool.breaker_failures, workers[1].address)
// and its line, says what the value must be, and suggests the closest
// known name for an unknown field. A float is never truncated into an
// integer, durations are Go durations (30s, 10m), a key set twice is an
// error, and aliases and merges are followed to a bounded depth.
package strictyaml

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Unmarshal decodes the YAML document b into *v, a pointer to a struct.
// Fields are named by their yaml tags (a field without one by its
// lower-cased name; ",inline" embeds a struct's fields; "-" and
// unexported fields are skipped). An empty document, or one of only
// comments, leaves *v unchanged; so does a null value.
func Unmarshal(b []byte, v any) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("strictyaml: Unmarshal needs a pointer to a struct, got %T", v)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return err
	}
	if len(doc.Content) == 0 {
		return nil
	}
	return decode(doc.Content[0], rv.Elem(), "", 0)
}

// An Unmarshaler decodes itself from n, a value that is not null, as
// the configuration gives it; field names n in errors ("" for the whole
// document). A type implements it (on its pointer) to accept a shorthand,
// or to keep n undecoded until it knows what to decode it into
// (DecodeNode).
type Unmarshaler interface {
	UnmarshalStrictYAML(n *yaml.Node, field string) error
}

// DecodeNode decodes n into *v, a pointer to a struct, as Unmarshal does a
// document, naming fields in errors under field ("" for none). A nil n
// leaves *v unchanged.
func DecodeNode(n *yaml.Node, v any, field string) error {
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.IsNil() || rv.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("strictyaml: DecodeNode needs a pointer to a struct, got %T", v)
	}
	if n == nil {
		return nil
	}
	return decode(n, rv.Elem(), field, 0)
}

var durationType = reflect.TypeFor[time.Duration]()

// maxDepth bounds the nesting decode follows, with aliases and
// merges expanded, so that a self-referencing anchor ends in an error.
const maxDepth = 32

// decode decodes n into v, which field names in errors ("" for the
// whole document).
func decode(n *yaml.Node, v reflect.Value, field string, depth int) error {
	if n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	if n.Tag == "!!null" {
		return nil // an empty value keeps the default
	}
	fail := func(format string, args ...any) error {
		msg := fmt.Sprintf("line %d: ", n.Line) + fmt.Sprintf(format, args...)
		if field == "" {
			return errors.New(msg)
		}
		return fmt.Errorf("%s: %s", field, msg)
	}
	if depth > maxDepth {
		return fail("nested too deeply (a recursive alias?)")
	}
	if v.CanAddr() {
		if u, ok := v.Addr().Interface().(Unmarshaler); ok {
			return u.UnmarshalStrictYAML(n, field)
		}
	}
	switch {
	case v.Kind() == reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return fail("%s is not a mapping of fields", value(n))
		}
		return decodeStruct(n, v, field, depth)
	case v.Kind() == reflect.Slice && v.Type().Elem().Kind() != reflect.Uint8:
		if n.Kind != yaml.SequenceNode {
			return fail("%s is not a list", value(n))
		}
		s := reflect.MakeSlice(v.Type(), 0, len(n.Content))
		for i, item := range n.Content {
			if item.Kind == yaml.AliasNode {
				item = item.Alias
			}
			if item.Tag == "!!null" {
				continue // as yaml.v3 does
			}
			s = reflect.Append(s, reflect.Zero(v.Type().Elem()))
			if err := decode(item, s.Index(s.Len()-1), fmt.Sprintf("%s[%d]", field, i), depth+1); err != nil {
				return err
			}
		}
		v.Set(s)
		return nil
	}
	if want, ok := decodeScalar(n, v); !ok {
		return fail("%s is not %s", value(n), want)
	}
	return nil
}

// decodeScalar decodes the scalar n into v. If it cannot, it returns
// false and what v's value must be.
func decodeScalar(n *yaml.Node, v reflect.Value) (want string, ok bool) {
	scalar := n.Kind == yaml.ScalarNode
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		if v.Type() == durationType {
			d, err := time.ParseDuration(n.Value)
			if !scalar || err != nil {
				return "a duration (e.g. 30s, 10m)", false
			}
			v.SetInt(int64(d))
			return "", true
		}
		// yaml.v3 would truncate 2.5 to 2.
		var f float64
		if !scalar || n.ShortTag() == "!!float" && (n.Decode(&f) != nil || f != math.Trunc(f)) {
			return "an integer", false
		}
		var i int64
		if n.Decode(&i) != nil {
			return "an integer", false
		}
		if v.OverflowInt(i) {
			return fmt.Sprintf("a %d-bit integer", v.Type().Bits()), false
		}
		v.SetInt(i)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		var i uint64
		if !scalar || n.Decode(&i) != nil {
			return "a non-negative integer", false
		}
		if v.OverflowUint(i) {
			return fmt.Sprintf("a non-negative %d-bit integer", v.Type().Bits()), false
		}
		v.SetUint(i)
	case reflect.Float32, reflect.Float64:
		var f float64
		if !scalar || n.Decode(&f) != nil {
			return "a number", false
		}
		v.SetFloat(f)
	case reflect.Bool:
		var b bool
		if !scalar || n.Decode(&b) != nil {
			return "true or false", false
		}
		v.SetBool(b)
	case reflect.String:
		if !scalar {
			return "a string", false
		}
		v.SetString(n.Value)
	default:
		if err := n.Decode(v.Addr().Interface()); err != nil {
			return fmt.Sprintf("a %s (%v)", v.Type(), err), false
		}
	}
	return "", true
}

// decodeStruct decodes the mapping n into the struct v.
func decodeStruct(n *yaml.Node, v reflect.Value, field string, depth int) error {
	fields := map[string][]int{}
	var names []string
	collectFields(v.Type(), nil, fields, &names)
	prefix := field
	if prefix != "" {
		prefix += "."
	}
	// Merged mappings (<<: *defaults) first: the mapping's own keys
	// override them.
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k, val := n.Content[i], n.Content[i+1]; k.Tag == "!!merge" {
			if val.Kind == yaml.AliasNode {
				val = val.Alias
			}
			merged := []*yaml.Node{val}
			if val.Kind == yaml.SequenceNode {
				merged = val.Content
			}
			for _, m := range merged {
				if err := decode(m, v, field, depth+1); err != nil {
					return err
				}
			}
		}
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if k.Tag == "!!merge" {
			continue
		}
		if k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		key := k.Value
		if k.Kind != yaml.ScalarNode || k.Tag == "!!null" {
			if field == "" {
				return fmt.Errorf("line %d: a field must be named", k.Line)
			}
			return fmt.Errorf("%s: line %d: a field must be named", field, k.Line)
		}
		if line, dup := seen[key]; dup {
			return fmt.Errorf("%s%s: line %d: set twice (first on line %d)", prefix, key, k.Line, line)
		}
		seen[key] = k.Line
		idx, ok := fields[key]
		if !ok {
			if near := closest(key, names); near != "" {
				return fmt.Errorf("%s%s: line %d: unknown field; did you mean %s?", prefix, key, k.Line, near)
			}
			if len(names) == 0 {
				return fmt.Errorf("%s%s: line %d: unknown field (there are none)", prefix, key, k.Line)
			}
			return fmt.Errorf("%s%s: line %d: unknown field (known: %s)", prefix, key, k.Line, strings.Join(names, ", "))
		}
		if err := decode(val, v.FieldByIndex(idx), prefix+key, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// collectFields adds t's fields to fields by their YAML names, with those of
// inlined structs, and appends the names to names.
func collectFields(t reflect.Type, index []int, fields map[string][]int, names *[]string) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		idx := append(slices.Clone(index), i)
		switch {
		case name == "-":
			continue
		case opts == "inline" || strings.HasPrefix(opts, "inline,") || strings.HasSuffix(opts, ",inline"):
			collectFields(f.Type, idx, fields, names)
			continue
		case name == "":
			name = strings.ToLower(f.Name)
		}
		fields[name] = idx
		*names = append(*names, name)
	}
}

// value renders the value of n for an error: numbers and booleans as
// written, other scalars quoted, collections by their kind.
func value(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	}
	switch n.Tag {
	case "!!int", "!!float", "!!bool":
		return n.Value
	}
	return strconv.Quote(n.Value)
}

// closest returns the name nearest to s by edit distance, if one is near
// enough to be a likely typo, else "".
func closest(s string, names []string) string {
	best, bestDist := "", max(2, len(s)/4)+1
	for _, name := range names {
		if d := editDistance(s, name); d < bestDist {
			best, bestDist = name, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
