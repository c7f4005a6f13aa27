package vllmtest

import (
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/workers/openai/openaitest"
)

// Special token ids, as Llama 3's tokenizer numbers them.
const (
	bos         = 128000
	startHeader = 128006
	endHeader   = 128007
	eot         = 128009
)

// vocab is the number of ordinary token ids, below the special ones.
const vocab = 127000

// Message is a chat message as the server reads it: content is a string or
// a list of parts, whose text parts it reads.
type Message = openaitest.Message

// Tokenize is the server's tokenizer: each whitespace-separated word, cut
// into pieces of at most 4 bytes, is a token whose id is a hash of the
// piece. It is appended to dst.
func Tokenize(dst []uint32, text string) []uint32 {
	for _, w := range strings.Fields(text) {
		for len(w) > 0 {
			n := min(len(w), 4)
			dst = append(dst, 1000+uint32(xxhash.Sum64String(w[:n])%(vocab-1000)))
			w = w[n:]
		}
	}
	return dst
}

// ChatTokens applies the server's chat template (Llama 3's shape) to msgs
// and tokenizes the result: the begin-of-text token, then each message as
// a header with its role, its text and an end-of-turn token, then, with
// addGenerationPrompt, the assistant's header.
func ChatTokens(msgs []Message, addGenerationPrompt bool) []uint32 {
	out := []uint32{bos}
	header := func(role string) {
		out = append(out, startHeader)
		out = Tokenize(out, role)
		out = append(out, endHeader)
	}
	for _, m := range msgs {
		header(m.Role)
		out = Tokenize(out, m.Text())
		out = append(out, eot)
	}
	if addGenerationPrompt {
		header("assistant")
	}
	return out
}

// CompletionTokens tokenizes a completion's prompt, after the
// begin-of-text token when addSpecialTokens (vLLM's default for
// completions).
func CompletionTokens(prompt string, addSpecialTokens bool) []uint32 {
	var out []uint32
	if addSpecialTokens {
		out = append(out, bos)
	}
	return Tokenize(out, prompt)
}
