package vllm

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// The few lines of an engine's page that baton reads (kept by
// names.keep) are parsed here rather than by expfmt's text parser, whose
// set-up (a buffered reader, protobuf families) cost more than those lines
// for each of thousands of pages a second. It reads the text exposition
// format (0.0.4) as expfmt does for those lines: HELP and TYPE comments,
// samples with labels (escapes \\, \" and \n), a value and an optional
// timestamp; a syntax error ends the parse, the families before it kept.

// family is one metric family's samples and type.
type family struct {
	name    string
	typ     string // "counter", "gauge", "untyped", ...; "" until a TYPE line or sample
	typed   bool   // a TYPE line was read
	help    bool   // a HELP line was read
	samples []sample
}

type sample struct {
	labels []label
	value  float64
}

type label struct{ name, value string }

// label returns the value of the sample's label name and whether it has it.
func (s *sample) label(name string) (string, bool) {
	for _, l := range s.labels {
		if l.name == name {
			return l.value, true
		}
	}
	return "", false
}

// val returns a sample's value, as the family's type reads it: NaN for a
// histogram's or summary's, which baton does not read.
func (f *family) val(s *sample) float64 {
	switch f.typ {
	case "counter", "gauge", "untyped", "":
		return s.value
	}
	return math.NaN()
}

// parseText parses text-format lines into families by name. On a syntax
// error it returns the families read before it and the error.
func parseText(text []byte) (map[string]*family, error) {
	fams := map[string]*family{}
	p := textParser{fams: fams}
	for n := 1; len(text) > 0; n++ {
		line := text
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line, text = text[:i], text[i+1:]
		} else {
			text = nil
		}
		if err := p.line(line); err != nil {
			return fams, fmt.Errorf("text format parsing error in line %d: %w", n, err)
		}
	}
	return fams, nil
}

type textParser struct {
	fams map[string]*family
}

func isBlankByte(c byte) bool { return c == ' ' || c == '\t' }

func skipBlank(b []byte) []byte {
	for len(b) > 0 && isBlankByte(b[0]) {
		b = b[1:]
	}
	return b
}

// nameBytes marks the bytes of metric names: 1 those that may start one,
// 2 digits, which may only follow.
var nameBytes = func() (t [256]uint8) {
	for c := range 256 {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c == '_', c == ':':
			t[c] = 1
		case c >= '0' && c <= '9':
			t[c] = 2
		}
	}
	return t
}()

func isNameByte(c byte) bool { return nameBytes[c] != 0 }

// token splits a metric name (colons allowed) or, with label, a label
// name (no colon) off b.
func token(b []byte, labelName bool) (string, []byte, bool) {
	i := 0
	for i < len(b) && isNameByte(b[i]) && !(labelName && b[i] == ':') {
		i++
	}
	if i == 0 || b[0] >= '0' && b[0] <= '9' {
		return "", b, false
	}
	return string(b[:i]), b[i:], true
}

func (p *textParser) family(name string) *family {
	f := p.fams[name]
	if f == nil {
		f = &family{name: name}
		p.fams[name] = f
	}
	return f
}

func (p *textParser) line(line []byte) error {
	line = skipBlank(line)
	if len(line) == 0 {
		return nil
	}
	if line[0] == '#' {
		return p.comment(skipBlank(line[1:]))
	}
	return p.sample(line)
}

func (p *textParser) comment(c []byte) error {
	kind, rest := field(c)
	if len(rest) == 0 || string(kind) != "HELP" && string(kind) != "TYPE" {
		return nil // another comment, or a keyword alone
	}
	rest = skipBlank(rest)
	name, rest, _ := token(rest, false)
	if len(rest) == 0 {
		return nil // a name alone (or nothing)
	}
	if !isBlankByte(rest[0]) {
		return fmt.Errorf("invalid metric name in comment")
	}
	f := p.family(name)
	rest = skipBlank(rest)
	if len(rest) == 0 {
		return nil
	}
	if string(kind) == "HELP" {
		if f.help {
			return fmt.Errorf("second HELP line for metric name %q", name)
		}
		f.help = true
		return nil
	}
	typ := strings.ToLower(string(rest))
	switch typ {
	case "counter", "gauge", "histogram", "summary", "untyped", "gauge_histogram":
	default:
		return fmt.Errorf("unknown metric type %q", rest)
	}
	if f.typed || len(f.samples) > 0 {
		return fmt.Errorf("second TYPE line for metric name %q, or TYPE reported after samples", name)
	}
	f.typ, f.typed = typ, true
	return nil
}

func (p *textParser) sample(line []byte) error {
	name, rest, ok := token(line, false)
	if !ok {
		return fmt.Errorf("invalid metric name")
	}
	f := p.family(name)
	if f.typ == "" {
		f.typ = "untyped"
	}
	var s sample
	rest = skipBlank(rest)
	if len(rest) > 0 && rest[0] == '{' {
		var err error
		if s.labels, rest, err = labels(rest[1:]); err != nil {
			return err
		}
	}
	rest = skipBlank(rest)
	val, rest := field(rest)
	if len(val) == 0 {
		return fmt.Errorf("expected a value for metric %q", name)
	}
	v, err := parseValue(val)
	if err != nil {
		return fmt.Errorf("expected float as value, got %q", val)
	}
	s.value = v
	if len(rest) > 0 {
		// A blank after the value: a timestamp follows, and nothing after it.
		ts, rest := field(skipBlank(rest))
		if _, err := strconv.ParseInt(string(ts), 10, 64); err != nil {
			return fmt.Errorf("expected integer as timestamp, got %q", ts)
		}
		if len(rest) > 0 {
			return fmt.Errorf("spurious string after timestamp: %q", rest)
		}
	}
	f.samples = append(f.samples, s)
	return nil
}

// field splits the bytes up to the next blank off b.
func field(b []byte) ([]byte, []byte) {
	i := 0
	for i < len(b) && !isBlankByte(b[i]) {
		i++
	}
	return b[:i], b[i:]
}

// labels parses `name="value",...}` (the brace opened), returning the
// labels and what follows the closing brace.
func labels(b []byte) ([]label, []byte, error) {
	var out []label
	for {
		b = skipBlank(b)
		if len(b) > 0 && b[0] == '}' {
			return out, b[1:], nil
		}
		name, rest, ok := token(b, true)
		if !ok {
			return nil, nil, fmt.Errorf("invalid label name")
		}
		for _, l := range out {
			if l.name == name {
				return nil, nil, fmt.Errorf("duplicate label name %q", name)
			}
		}
		rest = skipBlank(rest)
		if len(rest) == 0 || rest[0] != '=' {
			return nil, nil, fmt.Errorf("expected '=' after label name %q", name)
		}
		rest = skipBlank(rest[1:])
		if len(rest) == 0 || rest[0] != '"' {
			return nil, nil, fmt.Errorf("expected '\"' to start the value of label %q", name)
		}
		value, rest, err := quoted(rest[1:])
		if err != nil {
			return nil, nil, err
		}
		if !utf8.ValidString(value) {
			return nil, nil, fmt.Errorf("invalid label value %q", value)
		}
		out = append(out, label{name, value})
		rest = skipBlank(rest)
		switch {
		case len(rest) > 0 && rest[0] == ',':
			b = rest[1:]
		case len(rest) > 0 && rest[0] == '}':
			return out, rest[1:], nil
		default:
			return nil, nil, fmt.Errorf("unexpected end of label value %q", value)
		}
	}
}

// quoted reads a label value up to its closing quote, unescaping it.
func quoted(b []byte) (string, []byte, error) {
	var sb []byte
	for i := 0; i < len(b); i++ {
		switch c := b[i]; c {
		case '"':
			if sb == nil {
				return string(b[:i]), b[i+1:], nil
			}
			return string(sb), b[i+1:], nil
		case '\\':
			if sb == nil {
				sb = append([]byte(nil), b[:i]...)
			}
			if i+1 == len(b) {
				return "", nil, fmt.Errorf("unexpected end of label value")
			}
			i++
			switch b[i] {
			case '\\', '"':
				sb = append(sb, b[i])
			case 'n':
				sb = append(sb, '\n')
			default:
				return "", nil, fmt.Errorf("invalid escape sequence '\\%c'", b[i])
			}
		case '\n':
			return "", nil, fmt.Errorf("label value with a line break")
		default:
			if sb != nil {
				sb = append(sb, c)
			}
		}
	}
	return "", nil, fmt.Errorf("unexpected end of label value")
}

// parseValue parses a sample's value as the text format writes it: a Go
// float, NaN or ±Inf, with no hexadecimal exponent or underscore.
func parseValue(b []byte) (float64, error) {
	if bytes.ContainsAny(b, "pP_") {
		return 0, fmt.Errorf("unsupported character in float")
	}
	return strconv.ParseFloat(string(b), 64)
}
