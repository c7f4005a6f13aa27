package sim

import (
	"context"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"

	"github.com/batonllm/baton/transfer/blockkey"
	"github.com/batonllm/baton/workers/engine"
)

// Tokenizer is the simulated engine's tokenizer: every blockkey.CharsPerToken
// characters (runes) of the routing text are one token, the last one
// possibly shorter, as the engine counts prompt tokens. A token's id is a
// hash of its characters, so equal text gives equal ids. It lets the
// scheduler's token-keyed path run without a real engine; its methods are
// safe for concurrent use.
type Tokenizer struct{}

// Tokenize returns the tokens of req.Prompt. It never blocks nor fails.
func (Tokenizer) Tokenize(_ context.Context, req *engine.Request) ([]uint32, error) {
	text := req.Prompt
	out := make([]uint32, 0, blockkey.Tokens(len(text)))
	for len(text) > 0 {
		n, chars := 0, 0
		for n < len(text) && chars < blockkey.CharsPerToken {
			_, size := utf8.DecodeRuneInString(text[n:])
			n += size
			chars++
		}
		out = append(out, uint32(xxhash.Sum64String(text[:n])))
		text = text[n:]
	}
	return out, nil
}
