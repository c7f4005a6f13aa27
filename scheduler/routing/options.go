package routing

import (
	"bytes"
	"fmt"

	"github.com/batonllm/baton/scheduler/internal/strictyaml"
	"go.yaml.in/yaml/v3"
)

// Options are one part's own options, as a profile in the configuration
// gives them: a mapping kept undecoded until the registry decodes it into
// the part type's options (RegisterScorerWith). The zero value is no
// options.
type Options struct {
	node *yaml.Node
}

// ParseOptions returns the options a YAML mapping gives, as text, for
// callers that build a ProfileConfig in Go: ParseOptions("weight_floor: 0.2").
func ParseOptions(text string) (Options, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(text), &doc); err != nil {
		return Options{}, err
	}
	if len(doc.Content) == 0 {
		return Options{}, nil
	}
	var o Options
	return o, o.UnmarshalStrictYAML(doc.Content[0], "")
}

// Decode decodes the options into *v, a pointer to a struct, strictly: a
// field v lacks, or a value of the wrong type, is an error naming the
// field ("block_size: line 7: unknown field"). No options leave *v
// unchanged.
func (o Options) Decode(v any) error { return strictyaml.DecodeNode(o.node, v, "") }

// IsZero reports whether there are no options.
func (o Options) IsZero() bool { return o.node == nil }

// Equal reports whether o and p are the same YAML.
func (o Options) Equal(p Options) bool {
	if o.node == nil || p.node == nil {
		return o.node == p.node
	}
	a, errA := yaml.Marshal(o.node)
	b, errB := yaml.Marshal(p.node)
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// UnmarshalStrictYAML keeps n, which must be a mapping
// (strictyaml.Unmarshaler).
func (o *Options) UnmarshalStrictYAML(n *yaml.Node, field string) error {
	if n.Kind != yaml.MappingNode {
		if field == "" {
			return fmt.Errorf("line %d: options must be a mapping", n.Line)
		}
		return fmt.Errorf("%s: line %d: must be a mapping", field, n.Line)
	}
	o.node = n
	return nil
}

// UnmarshalYAML keeps n, as UnmarshalStrictYAML does, for yaml.v3.
func (o *Options) UnmarshalYAML(n *yaml.Node) error { return o.UnmarshalStrictYAML(n, "options") }

// PartConfig is one filter, or the picker, of a profile: its registered
// type and its options. A plain name is short for {type: NAME}.
type PartConfig struct {
	// Type is the part's registered name.
	Type string `yaml:"type"`
	// Options are the part's own, as its type documents them; a field
	// the type does not know is an error. Default: none.
	Options Options `yaml:"options"`
}

// partFields is PartConfig without its methods, to decode its mapping.
type partFields PartConfig

// UnmarshalStrictYAML accepts a name or a mapping of PartConfig's fields
// (strictyaml.Unmarshaler).
func (pc *PartConfig) UnmarshalStrictYAML(n *yaml.Node, field string) error {
	if n.Kind == yaml.ScalarNode {
		*pc = PartConfig{Type: n.Value}
		return nil
	}
	return strictyaml.DecodeNode(n, (*partFields)(pc), field)
}

// UnmarshalYAML accepts a name or a mapping, as UnmarshalStrictYAML does,
// for yaml.v3; unknown fields are an error there too.
func (pc *PartConfig) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		*pc = PartConfig{Type: n.Value}
		return nil
	}
	b, err := yaml.Marshal(n)
	if err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	return dec.Decode((*partFields)(pc))
}

var (
	_ strictyaml.Unmarshaler = (*Options)(nil)
	_ strictyaml.Unmarshaler = (*PartConfig)(nil)
	_ yaml.Unmarshaler       = (*Options)(nil)
	_ yaml.Unmarshaler       = (*PartConfig)(nil)
)
