package vllm

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
)

// The /tokenize answer of a long prompt is mostly one array of integers,
// which encoding/json decodes through reflection at a few hundred
// nanoseconds a token: parseTokenizeResponse reads the common shape
// itself and leaves anything else to encoding/json.

var errShape = errors.New("not the common shape")

// parseTokenizeResponse decodes a /tokenize answer: its count and tokens.
func parseTokenizeResponse(b []byte) (tokenizeResponse, error) {
	if r, err := scanTokenizeResponse(b); err == nil {
		return r, nil
	}
	var r tokenizeResponse
	err := json.Unmarshal(b, &r)
	return r, err
}

// scanTokenizeResponse reads an object whose "tokens" is an array of
// non-negative integers and whose "count" is one, skipping other members
// whose values are numbers, null, booleans or strings without escapes. It
// returns errShape for anything else (escapes, nested values elsewhere,
// duplicates), which the caller hands to encoding/json.
func scanTokenizeResponse(b []byte) (tokenizeResponse, error) {
	var r tokenizeResponse
	s := scanner{b: b}
	if !s.byte('{') {
		return r, errShape
	}
	seenCount, seenTokens := false, false
	for first := true; ; first = false {
		if s.byte('}') {
			break
		}
		if !first && !s.byte(',') {
			return r, errShape
		}
		key, ok := s.str()
		if !ok || !s.byte(':') {
			return r, errShape
		}
		switch {
		case key == "tokens" && !seenTokens:
			seenTokens = true
			toks, ok := s.uints()
			if !ok {
				return r, errShape
			}
			r.Tokens = toks
		case key == "count" && !seenCount:
			seenCount = true
			n, ok := s.uint()
			if !ok {
				return r, errShape
			}
			r.Count = int(n)
		case strings.EqualFold(key, "tokens") || strings.EqualFold(key, "count"):
			// encoding/json matches keys without regard to case.
			return r, errShape
		default:
			if !s.skipScalar() {
				return r, errShape
			}
		}
	}
	s.space()
	if s.i != len(s.b) || !seenTokens || !seenCount {
		return r, errShape
	}
	return r, nil
}

type scanner struct {
	b []byte
	i int
}

func (s *scanner) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// byte consumes c after optional space.
func (s *scanner) byte(c byte) bool {
	s.space()
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// str reads a string without escapes or control characters (which JSON
// forbids unescaped).
func (s *scanner) str() (string, bool) {
	if !s.byte('"') {
		return "", false
	}
	end := bytes.IndexByte(s.b[s.i:], '"')
	if end < 0 {
		return "", false
	}
	v := s.b[s.i : s.i+end]
	for _, c := range v {
		if c == '\\' || c < 0x20 {
			return "", false
		}
	}
	s.i += end + 1
	return string(v), true
}

// uint reads a non-negative integer that fits in 32 bits.
func (s *scanner) uint() (uint32, bool) {
	s.space()
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		v = v*10 + uint64(s.b[s.i]-'0')
		if v > 1<<32-1 {
			return 0, false
		}
		s.i++
	}
	n := s.i - start
	// No leading zeros (JSON), and a number ends here.
	if n == 0 || n > 1 && s.b[start] == '0' {
		return 0, false
	}
	if s.i < len(s.b) {
		switch s.b[s.i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	return uint32(v), true
}

// uints reads an array of non-negative integers.
func (s *scanner) uints() ([]uint32, bool) {
	if !s.byte('[') {
		return nil, false
	}
	// About one token per 5 bytes of the array: "1234,".
	out := make([]uint32, 0, bytes.IndexByte(s.b[s.i:], ']')/5+1)
	if s.byte(']') {
		return out, true
	}
	for {
		v, ok := s.uint()
		if !ok {
			return nil, false
		}
		out = append(out, v)
		if s.byte(']') {
			return out, true
		}
		if !s.byte(',') {
			return nil, false
		}
	}
}

// skipScalar skips a number, null, true, false or a string without
// escapes.
func (s *scanner) skipScalar() bool {
	s.space()
	if s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '"':
		_, ok := s.str()
		return ok
	case c == '-' || c >= '0' && c <= '9':
		for s.i < len(s.b) && bytes.IndexByte([]byte("+-.eE0123456789"), s.b[s.i]) >= 0 {
			s.i++
		}
		return true
	}
	for _, lit := range []string{"null", "true", "false"} {
		if bytes.HasPrefix(s.b[s.i:], []byte(lit)) {
			s.i += len(lit)
			return true
		}
	}
	return false
}
