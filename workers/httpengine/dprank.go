package httpengine

import "strconv"

// HeaderDPRank is the header by which vLLM's OpenAI server (started with
// --data-parallel-size) hands a request to one data-parallel rank, whose
// engine and KV cache are its own; without it vLLM balances by load.
const HeaderDPRank = "X-data-parallel-rank"

// WithDataParallelRank sends every request to data-parallel rank r of the
// engine (HeaderDPRank).
func WithDataParallelRank(r int) Option {
	return func(c *Client) { c.dpRank = strconv.Itoa(r) }
}
