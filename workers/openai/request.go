package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/batonllm/baton/workers/engine"
)

// Kind is the API a request came through.
type Kind int

const (
	// Chat is POST /v1/chat/completions.
	Chat Kind = iota
	// Completion is POST /v1/completions.
	Completion
)

// Paths of the two generation APIs.
const (
	ChatPath       = "/v1/chat/completions"
	CompletionPath = "/v1/completions"
)

// Path returns the API path of k.
func (k Kind) Path() string {
	if k == Completion {
		return CompletionPath
	}
	return ChatPath
}

// Request is a parsed, validated generation request.
type Request struct {
	engine.Request
	Kind Kind
	// IncludeUsage is stream_options.include_usage: a streamed response
	// ends with a chunk carrying usage.
	IncludeUsage bool
}

// MaxStop is the most stop sequences a request may carry, as OpenAI.
const MaxStop = 4

// MaxTokensLimit bounds max_tokens and max_completion_tokens.
const MaxTokensLimit = 1 << 20

type wireMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type wireStreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type wireRequest struct {
	Model               *string            `json:"model"`
	Messages            *[]wireMessage     `json:"messages"`
	Prompt              json.RawMessage    `json:"prompt"`
	MaxTokens           *int               `json:"max_tokens"`
	MaxCompletionTokens *int               `json:"max_completion_tokens"`
	Stop                json.RawMessage    `json:"stop"`
	Stream              *bool              `json:"stream"`
	StreamOptions       *wireStreamOptions `json:"stream_options"`
	N                   *int               `json:"n"`
	PromptCacheKey      *string            `json:"prompt_cache_key"`
}

var roles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true, "function": true}

// Parse parses body as a request of kind k. Fields baton does not act on
// (temperature, tools, ...) are accepted and left to the engine. The
// returned error is an *Error naming the offending parameter.
func Parse(k Kind, body []byte) (*Request, error) {
	var w wireRequest
	if err := json.Unmarshal(body, &w); err != nil {
		return nil, decodeError(err)
	}
	r := &Request{Kind: k}
	r.Path = k.Path()
	r.Body = body

	if w.Model == nil || *w.Model == "" {
		return nil, Invalid("model", "missing_required_parameter", "you must provide a model parameter")
	}
	r.Model = *w.Model

	var err error
	switch k {
	case Chat:
		r.Prompt, err = chatText(w.Messages)
	case Completion:
		r.Prompt, err = promptText(w.Prompt)
	}
	if err != nil {
		return nil, err
	}

	if err := maxTokens(&r.Request, w.MaxTokens, w.MaxCompletionTokens); err != nil {
		return nil, err
	}
	if r.Stop, err = stops(w.Stop); err != nil {
		return nil, err
	}
	if w.N != nil && *w.N != 1 {
		return nil, Invalid("n", "unsupported_value", fmt.Sprintf("n must be 1 (one choice per request), got %d", *w.N))
	}
	r.Stream = w.Stream != nil && *w.Stream
	if w.StreamOptions != nil {
		if !r.Stream {
			return nil, Invalid("stream_options", "invalid_value", "stream_options is only allowed when stream is true")
		}
		r.IncludeUsage = w.StreamOptions.IncludeUsage
	}
	if w.PromptCacheKey != nil {
		if err := ValidTenant(*w.PromptCacheKey); err != nil {
			return nil, Invalid("prompt_cache_key", "invalid_value", "prompt_cache_key "+err.Error())
		}
		r.Tenant = *w.PromptCacheKey
	}
	return r, nil
}

// DetectKind tells which API a native (/invocations) body speaks: chat if
// it has "messages", completion if it has "prompt".
func DetectKind(body []byte) (Kind, error) {
	var probe struct {
		Messages json.RawMessage `json:"messages"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(body, &probe); err != nil {
		return 0, decodeError(err)
	}
	switch {
	case probe.Messages != nil:
		return Chat, nil
	case probe.Prompt != nil:
		return Completion, nil
	}
	return 0, Invalid("messages", "missing_required_parameter", "the body must carry either messages (chat) or prompt (completion)")
}

// ValidTenant checks a tenant id (prompt_cache_key or X-Prefix-Aware-Id):
// 1–64 printable ASCII characters, not starting with a space.
func ValidTenant(s string) error {
	switch {
	case s == "":
		return errors.New("must not be empty")
	case len(s) > 64:
		return fmt.Errorf("must be at most 64 characters, got %d", len(s))
	case s[0] == ' ':
		return errors.New("must not start with a space")
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return fmt.Errorf("must be printable ASCII, got byte 0x%02x at %d", s[i], i)
		}
	}
	return nil
}

func decodeError(err error) *Error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		if te.Field == "" {
			return Invalid("", "invalid_json", "the request body must be a JSON object, got "+te.Value)
		}
		want := jsonType(te.Type.Kind().String())
		if num, ok := strings.CutPrefix(te.Value, "number "); ok && want == "integer" {
			if f, err := strconv.ParseFloat(num, 64); err == nil && math.Abs(f) >= math.MaxInt64 {
				return Invalid(te.Field, "invalid_value", fmt.Sprintf("%s is out of range, got %s", te.Field, num))
			}
			return Invalid(te.Field, "invalid_type", fmt.Sprintf("%s must be an integer, got %s", te.Field, num))
		}
		return Invalid(te.Field, "invalid_type", fmt.Sprintf("%s must be of type %s, got %s", te.Field, want, te.Value))
	}
	return Invalid("", "invalid_json", "we could not parse the JSON body of your request: "+err.Error())
}

func jsonType(goKind string) string {
	switch goKind {
	case "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64":
		return "integer"
	case "float32", "float64":
		return "number"
	case "bool":
		return "boolean"
	case "slice":
		return "array"
	case "struct", "map":
		return "object"
	}
	return goKind
}

// chatText renders messages as routing text: each message as its role and
// its text content, in order. Equal conversations give equal text however
// their JSON was laid out.
func chatText(msgs *[]wireMessage) (string, error) {
	if msgs == nil {
		return "", Invalid("messages", "missing_required_parameter", "you must provide a messages parameter")
	}
	if len(*msgs) == 0 {
		return "", Invalid("messages", "empty_array", "messages must contain at least one message")
	}
	var b strings.Builder
	for i, m := range *msgs {
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == "" {
			return "", Invalid(param+".role", "missing_required_parameter", param+" must have a role")
		}
		if !roles[m.Role] {
			return "", Invalid(param+".role", "invalid_value", fmt.Sprintf("%s.role must be one of system, developer, user, assistant, tool, got %q", param, m.Role))
		}
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		if err := contentText(&b, m.Content, param+".content"); err != nil {
			return "", err
		}
		b.WriteByte('\n')
	}
	return b.String(), nil
}

func contentText(b *strings.Builder, raw json.RawMessage, param string) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil // assistant messages with tool calls carry no content
	}
	if raw[0] == '"' {
		if appendString(b, raw) {
			return nil
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return Invalid(param, "invalid_type", param+" must be a string or an array of content parts")
		}
		b.WriteString(s)
		return nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return Invalid(param, "invalid_type", param+" must be a string or an array of content parts")
	}
	for i, p := range parts {
		if p.Type == "" {
			return Invalid(fmt.Sprintf("%s[%d].type", param, i), "missing_required_parameter", "content parts must have a type")
		}
		if p.Type == "text" {
			if p.Text == nil {
				return Invalid(fmt.Sprintf("%s[%d].text", param, i), "missing_required_parameter", "text content parts must have text")
			}
			b.WriteString(*p.Text)
		}
	}
	return nil
}

func promptText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", Invalid("prompt", "missing_required_parameter", "you must provide a prompt parameter")
	}
	var s string
	if raw[0] == '"' {
		var b strings.Builder
		if appendString(&b, raw) {
			return b.String(), nil
		}
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", Invalid("prompt", "invalid_type", "prompt must be a string or an array of one string")
		}
		return s, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return "", Invalid("prompt", "invalid_type", "prompt must be a string or an array of one string (token arrays are not supported)")
	}
	if len(list) != 1 {
		return "", Invalid("prompt", "unsupported_value", fmt.Sprintf("prompt must hold exactly one string (send one request per prompt), got %d", len(list)))
	}
	return list[0], nil
}

// appendString appends the JSON string literal raw, unquoted, to b and
// reports true, when raw is a literal of the body Parse has already
// validated and holds no \u escape or invalid UTF-8; otherwise it appends
// nothing and the caller decodes raw with encoding/json. Prompts are the
// bulk of a request: decoding them a second time through encoding/json's
// scanner cost more than the rest of parsing.
func appendString(b *strings.Builder, raw []byte) bool {
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return false
	}
	s := raw[1 : len(raw)-1]
	if !utf8.Valid(s) {
		return false
	}
	i := bytes.IndexByte(s, '\\')
	if i < 0 {
		b.Write(s)
		return true
	}
	if bytes.Contains(s[i:], []byte(`\u`)) {
		return false
	}
	out := make([]byte, 0, len(s))
	for {
		out = append(out, s[:i]...)
		if i+1 >= len(s) {
			return false // not a valid literal
		}
		c := s[i+1]
		switch c {
		case '"', '\\', '/':
		case 'b':
			c = '\b'
		case 'f':
			c = '\f'
		case 'n':
			c = '\n'
		case 'r':
			c = '\r'
		case 't':
			c = '\t'
		default:
			return false
		}
		out = append(out, c)
		s = s[i+2:]
		if i = bytes.IndexByte(s, '\\'); i < 0 {
			b.Write(append(out, s...))
			return true
		}
	}
}

func maxTokens(r *engine.Request, maxTokens, maxCompletion *int) error {
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", maxTokens}, {"max_completion_tokens", maxCompletion}} {
		if f.v == nil {
			continue
		}
		if *f.v < 1 || *f.v > MaxTokensLimit {
			return Invalid(f.name, "invalid_value", fmt.Sprintf("%s must be between 1 and %d, got %d", f.name, MaxTokensLimit, *f.v))
		}
		if r.MaxTokens == 0 || *f.v < r.MaxTokens {
			r.MaxTokens = *f.v
		}
	}
	return nil
}

func stops(raw json.RawMessage) ([]string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, Invalid("stop", "invalid_type", "stop must be a string or an array of strings")
		}
		if s == "" {
			return nil, nil
		}
		return []string{s}, nil
	}
	var list []string
	if err := json.Unmarshal(raw, &list); err != nil {
		return nil, Invalid("stop", "invalid_type", "stop must be a string or an array of strings")
	}
	if len(list) > MaxStop {
		return nil, Invalid("stop", "invalid_value", fmt.Sprintf("stop may hold at most %d sequences, got %d", MaxStop, len(list)))
	}
	out := list[:0]
	for _, s := range list {
		if s != "" {
			out = append(out, s)
		}
	}
	return out, nil
}
