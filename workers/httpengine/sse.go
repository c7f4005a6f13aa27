package httpengine

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"sync"

	"github.com/batonllm/baton/workers/engine"
)

const (
	// readBufSize is the event-stream read buffer: a chunk of vLLM's holds
	// one token and its envelope (~300 bytes), with logprobs a few KiB.
	readBufSize = 64 << 10
	// maxLineSize bounds one event-stream line, so a broken engine cannot
	// make us buffer without end.
	maxLineSize = 16 << 20
)

var errLineTooLong = errors.New("event-stream line too long")

// lineReader reads an event stream line by line, terminators included.
// Lines that fit its buffer cost no allocation; longer ones are assembled
// in a scratch slice reused from line to line.
type lineReader struct {
	r    *bufio.Reader
	src  eofReader
	long []byte
}

// eofReader notes when its reader has said the stream ended.
type eofReader struct {
	r   io.Reader
	eof bool
}

func (e *eofReader) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err == io.EOF {
		e.eof = true
	}
	return n, err
}

func newLineReader(r io.Reader) *lineReader {
	lr := &lineReader{src: eofReader{r: r}}
	lr.r = bufio.NewReaderSize(&lr.src, readBufSize)
	return lr
}

// readers keeps the read buffers of finished relays: a fresh 64 KiB one
// per request costs more than the rest of the relay of a short answer.
var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, readBufSize) }}

// pooledLineReader is newLineReader with a buffer from the pool; release
// returns it once no line it returned is used any more.
func pooledLineReader(r io.Reader) *lineReader {
	lr := &lineReader{r: readers.Get().(*bufio.Reader), src: eofReader{r: r}}
	lr.r.Reset(&lr.src)
	return lr
}

func (lr *lineReader) release() {
	lr.r.Reset(nil)
	readers.Put(lr.r)
	lr.r = nil
}

// fill waits until some of the stream is buffered, or it ends.
func (lr *lineReader) fill() {
	if lr.r.Buffered() == 0 {
		_, _ = lr.r.Peek(1)
	}
}

// lineBuffered reports whether a whole line has already been read, so
// that next will not block.
func (lr *lineReader) lineBuffered() bool {
	b, _ := lr.r.Peek(lr.r.Buffered())
	return bytes.IndexByte(b, '\n') >= 0
}

// ended reports whether the stream's end has been read: what next
// returns from now on is buffered, so that it will not block.
func (lr *lineReader) ended() bool { return lr.src.eof }

// next returns the next line, valid until the following call. At the end
// of the stream it returns the last, unterminated bytes (if any) with io.EOF.
func (lr *lineReader) next() ([]byte, error) {
	line, err := lr.r.ReadSlice('\n')
	if err != bufio.ErrBufferFull {
		return line, err
	}
	lr.long = append(lr.long[:0], line...)
	for {
		line, err = lr.r.ReadSlice('\n')
		lr.long = append(lr.long, line...)
		if len(lr.long) > maxLineSize {
			return nil, errLineTooLong
		}
		if err != bufio.ErrBufferFull {
			return lr.long, err
		}
	}
}

var (
	dataPrefix = []byte("data:")
	doneMarker = []byte("[DONE]")
)

// dataPayload returns the payload of a "data:" line (one optional leading
// space and the line terminator removed), or false for any other line.
func dataPayload(line []byte) ([]byte, bool) {
	p, ok := bytes.CutPrefix(line, dataPrefix)
	if !ok {
		return nil, false
	}
	p = bytes.TrimRight(p, "\r\n")
	p, _ = bytes.CutPrefix(p, []byte(" "))
	return p, true
}

// isBlank reports whether line ends an event.
func isBlank(line []byte) bool {
	return len(line) == 1 && line[0] == '\n' || len(line) == 2 && line[0] == '\r' && line[1] == '\n'
}

// valueStart returns the first byte of the value of key ("\"usage\"") in
// the JSON object data, or 0 if key does not occur as a key. A quoted key
// cannot occur inside a JSON string (its quotes would be escaped), so a
// match followed by a colon is a key; this lets the relay skip decoding
// the chunks that cannot matter.
func valueStart(data []byte, key string) byte {
	var first byte
	anyValue(data, key, func(v []byte) bool {
		if len(v) > 0 {
			first = v[0]
		}
		return true
	})
	return first
}

func skipSpace(b []byte) int {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// usageJSON is OpenAI's usage object.
type usageJSON struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// timingsJSON is what this package reads of llama-server's timings: the
// prompt tokens it found cached (cache_n) and those it computed
// (prompt_n).
type timingsJSON struct {
	CacheN  int `json:"cache_n"`
	PromptN int `json:"prompt_n"`
}

// chunkJSON is what this package reads of a completion or chat completion,
// streamed chunk or whole response.
type chunkJSON struct {
	Choices []struct {
		Index int    `json:"index"`
		Text  string `json:"text"` // completions
		Delta *struct {
			Content          string          `json:"content"`
			ReasoningContent string          `json:"reasoning_content"` // vLLM, SGLang
			Reasoning        string          `json:"reasoning"`         // newer vLLM
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"` // chat, streamed
		Message *struct {
			Content string `json:"content"`
		} `json:"message"` // chat, whole
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usageJSON `json:"usage"`
	// Timings is llama-server's account of the request, on its last
	// chunk or whole response: its cached tokens even where its usage
	// has none.
	Timings *timingsJSON `json:"timings"`

	// A mid-stream error: {"error": {...}} (OpenAI, newer vLLM) or a flat
	// {"object": "error", "message": ...} (older vLLM).
	Error   json.RawMessage `json:"error"`
	Object  string          `json:"object"`
	Message string          `json:"message"`
}

// errorMessage returns the chunk's error message, or "" if it is not one.
func (c *chunkJSON) errorMessage() string {
	if c.Object == "error" {
		if c.Message == "" {
			return "unknown error"
		}
		return c.Message
	}
	if len(c.Error) == 0 || string(c.Error) == "null" {
		return ""
	}
	var e struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(c.Error, &e) == nil && e.Message != "" {
		return e.Message
	}
	var s string
	if json.Unmarshal(c.Error, &s) == nil && s != "" {
		return s
	}
	return string(c.Error)
}

// hasGenerated reports whether any choice of a streamed chunk carries
// generated output: text, reasoning or a tool call.
func (c *chunkJSON) hasGenerated() bool {
	for _, ch := range c.Choices {
		if ch.Text != "" {
			return true
		}
		if d := ch.Delta; d != nil {
			if d.Content != "" || d.ReasoningContent != "" || d.Reasoning != "" ||
				nonEmptyArray(d.ToolCalls) {
				return true
			}
		}
	}
	return false
}

// firstChunk reads a streamed chunk until the first one that carries
// generated text: it reports whether this one does, taking its usage and
// finish reason into u. A chunk that carries neither (the common case,
// read before each early chunk is relayed) is scanned, not decoded: text
// is generated when a content, text or reasoning key holds a string that
// is not empty, or tool_calls an array that is not, wherever in the chunk
// (engines put them in a choice's delta, or text in the choice); a key
// found this way is a key, since a quote inside a JSON string is escaped.
// A chunk with a message (a whole answer) or an error is decoded.
func (u *usageTracker) firstChunk(data []byte) bool {
	if k := skipSpace(data); k < len(data) && data[k] == '{' &&
		valueStart(data, `"usage"`) != '{' && valueStart(data, `"timings"`) != '{' &&
		valueStart(data, `"finish_reason"`) != '"' && !bytes.Contains(data, []byte(`"error"`)) &&
		!bytes.Contains(data, []byte(`"message"`)) {
		for _, key := range []string{`"content"`, `"text"`, `"reasoning_content"`, `"reasoning"`} {
			if anyValue(data, key, func(v []byte) bool { return len(v) > 1 && v[0] == '"' && v[1] != '"' }) {
				return true
			}
		}
		return anyValue(data, `"tool_calls"`, nonEmptyArray)
	}
	var c chunkJSON
	if json.Unmarshal(data, &c) != nil {
		return false
	}
	u.take(&c)
	return c.hasGenerated()
}

// anyValue reports whether the value of any occurrence of key in data
// (from its first byte to the end of data) satisfies f, trying them in
// order until one does. Keys are found as valueStart says.
func anyValue(data []byte, key string, f func(v []byte) bool) bool {
	for {
		i := bytes.Index(data, []byte(key))
		if i < 0 {
			return false
		}
		data = data[i+len(key):]
		j := skipSpace(data)
		if j >= len(data) || data[j] != ':' {
			continue
		}
		data = data[j+1:]
		if f(data[skipSpace(data):]) {
			return true
		}
	}
}

// nonEmptyArray reports whether v is a JSON array with an element.
func nonEmptyArray(v []byte) bool {
	v = v[skipSpace(v):]
	if len(v) == 0 || v[0] != '[' {
		return false
	}
	k := 1 + skipSpace(v[1:])
	return k < len(v) && v[k] != ']'
}

// usageTracker gathers the usage and finish reason of a relayed response.
type usageTracker struct {
	usage   *usageJSON
	timings *timingsJSON
	finish  string
}

// observe reads what matters of one chunk (its usage and first finish
// reason), decoding it only when it carries one of them.
func (u *usageTracker) observe(data []byte) {
	hasUsage := valueStart(data, `"usage"`) == '{' || valueStart(data, `"timings"`) == '{'
	hasFinish := u.finish == "" && valueStart(data, `"finish_reason"`) == '"'
	if !hasUsage && !hasFinish {
		return
	}
	if !hasUsage {
		if f, ok := plainString(data, `"finish_reason"`); ok {
			u.finish = f
			return
		}
	}
	var c chunkJSON
	if json.Unmarshal(data, &c) != nil {
		return
	}
	u.take(&c)
}

// plainString returns the first non-empty string value of key in data,
// when it has no escapes; otherwise false, and the caller decodes. Keys
// are found as valueStart finds them; the values of every occurrence are
// scanned in order, as take reads the choices.
func plainString(data []byte, key string) (string, bool) {
	var str string
	var ok bool
	anyValue(data, key, func(v []byte) bool {
		if len(v) == 0 || v[0] != '"' {
			return false
		}
		v = v[1:]
		end := bytes.IndexAny(v, `"\`)
		if end < 0 || v[end] == '\\' {
			return true // an escape: the caller decodes
		}
		if end > 0 {
			str, ok = string(v[:end]), true
			return true
		}
		return false
	})
	return str, ok
}

func (u *usageTracker) take(c *chunkJSON) {
	if c.Usage != nil {
		u.usage = c.Usage
	}
	if c.Timings != nil {
		u.timings = c.Timings
	}
	if u.finish == "" {
		for _, ch := range c.Choices {
			if ch.FinishReason != nil && *ch.FinishReason != "" {
				u.finish = *ch.FinishReason
				break
			}
		}
	}
}

// final returns the engine's usage, or nil if it reported none.
func (u *usageTracker) final() *engine.Final {
	if u.usage == nil && u.timings == nil {
		return nil
	}
	f := toFinal(u.usage, u.finish)
	if t := u.timings; t != nil {
		// llama-server's timings say what its usage may not: the prompt
		// tokens it found cached.
		if u.usage == nil {
			f.PromptTokens = t.PromptN + t.CacheN
		}
		if u.usage == nil || u.usage.PromptTokensDetails == nil {
			f.CachedTokens = t.CacheN
		}
	}
	return f
}

func toFinal(u *usageJSON, finish string) *engine.Final {
	f := &engine.Final{FinishReason: finish}
	if u != nil {
		f.PromptTokens = u.PromptTokens
		f.CompletionTokens = u.CompletionTokens
		if u.PromptTokensDetails != nil {
			f.CachedTokens = u.PromptTokensDetails.CachedTokens
		}
	}
	return f
}
