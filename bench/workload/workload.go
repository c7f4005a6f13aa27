// Package workload generates the request sequences baton bench replays:
// synthetic shapes (long-context, sharegpt, agentic) and replays of public
// traces (mooncake, azure). Every generator is deterministic under its
// seed, so every routing strategy of one bench run sees byte-identical
// requests in the same order at the same times.
package workload

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"
)

// Message is one chat message. Its text is a shared lead (a document that
// many requests quote, held once for all of them) followed by Content;
// Text returns it whole, and JSON encodes it whole as "content".
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	lead    string
}

// Text returns the message's whole text.
func (m Message) Text() string { return m.lead + m.Content }

// MarshalJSON encodes the message as the chat API has it.
func (m Message) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}{m.Role, m.Text()})
}

// Request is one request of a workload.
type Request struct {
	// At is the arrival offset from the start of the run in trace time
	// (before --speedup). Synthetic workloads leave it zero: the runner
	// draws Poisson arrivals.
	At time.Duration
	// Messages is the chat conversation sent to /v1/chat/completions.
	Messages []Message
	// MaxTokens caps the completion.
	MaxTokens int
	// Model is the model requested, a LoRA adapter's name (lora); empty:
	// the run's model.
	Model string
}

// RoutingText renders the messages exactly as baton's front end and the
// simulated engine do (`<|role|>\n` + content + `\n` per message), so the
// cache limits computed over it use the keys the workers store.
func (r *Request) RoutingText() string {
	n := 0
	for _, m := range r.Messages {
		n += len("<|") + len(m.Role) + len("|>\n") + len(m.lead) + len(m.Content) + 1
	}
	var b strings.Builder
	b.Grow(n)
	for _, m := range r.Messages {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		b.WriteString(m.lead)
		b.WriteString(m.Content)
		b.WriteByte('\n')
	}
	return b.String()
}

// Workload is a generated request sequence.
type Workload struct {
	Name     string
	Requests []Request
	// Timed reports that Requests carry their own arrival times (traces).
	Timed bool
	// Describe says in one line what was generated.
	Describe string
	// Adapters are the LoRA adapters of the run's model its requests
	// name, which an in-process fleet serves.
	Adapters []string
}

// Names of the workloads.
var Names = []string{"long-context", "sharegpt", "agentic", "lora", "mooncake", "azure"}

// CharsPerToken matches the simulated engine: one token per 4 characters.
const CharsPerToken = 4

// text writes n characters of deterministic pseudo-English into b.
func text(b *strings.Builder, rng *rand.Rand, n int) {
	start := b.Len()
	for b.Len()-start < n {
		w := vocab[rng.IntN(len(vocab))]
		if b.Len() > start {
			b.WriteByte(' ')
		}
		b.WriteString(w)
	}
	s := b.String()[:start+n]
	b.Reset()
	b.WriteString(s)
}

// Text returns n characters of deterministic text from rng.
func Text(rng *rand.Rand, n int) string {
	var b strings.Builder
	b.Grow(n + 16)
	text(&b, rng, n)
	return b.String()
}

var vocab = strings.Fields(`the of and to in is that for it as was with be by on not he this are or his
from at which but have an they you were her she there been one all we their has would when if so no
will more can out up into do about than them some could may time only other new these two first any
like very after where most made through between over years back such must also just those many under
cache block worker prefix model token request router latency throughput memory batch engine attention
document question answer context system tool result call agent history turn session value state query`)

// rngFor returns a PCG generator for (seed, stream), so separate parts of
// a workload draw independent, stable sequences.
func rngFor(seed uint64, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed, stream*0x9e3779b97f4a7c15+1))
}

// uniformInt returns an int in [lo, hi].
func uniformInt(rng *rand.Rand, lo, hi int) int {
	if hi <= lo {
		return lo
	}
	return lo + rng.IntN(hi-lo+1)
}

// logNormalInt returns a log-normal int with the given median and sigma,
// clamped to [lo, hi].
func logNormalInt(rng *rand.Rand, median float64, sigma float64, lo, hi int) int {
	v := int(math.Round(median * math.Exp(sigma*rng.NormFloat64())))
	return min(max(v, lo), hi)
}

// Popularity of the long-context documents.
const (
	Uniform = "uniform"
	Zipf    = "zipf"
)

// LongContextConfig shapes the long-context workload.
type LongContextConfig struct {
	Documents      int     // D shared documents
	DocTokens      int     // tokens per document (8,000)
	QuestionTokens [2]int  // unique question, tokens (100–300)
	OutputTokens   [2]int  // max_tokens (100–300)
	Popularity     string  // uniform or zipf
	ZipfS          float64 // Zipf exponent (> 1), default 1.1
}

// DefaultLongContext is SageMaker's long-context shape with D documents.
func DefaultLongContext(docs int) LongContextConfig {
	return LongContextConfig{Documents: docs, DocTokens: 8000, QuestionTokens: [2]int{100, 300},
		OutputTokens: [2]int{100, 300}, Popularity: Uniform, ZipfS: 1.1}
}

// LongContext generates n requests: each one document (a shared 8,000-token
// prefix) plus a short unique question, in one user message.
func LongContext(cfg LongContextConfig, n int, seed uint64) (*Workload, error) {
	if cfg.Documents < 1 || cfg.DocTokens < 1 || n < 0 {
		return nil, fmt.Errorf("long-context: need documents ≥ 1 and doc tokens ≥ 1, got %d and %d", cfg.Documents, cfg.DocTokens)
	}
	docs := make([]string, cfg.Documents)
	for i := range docs {
		rng := rngFor(seed, 1000+uint64(i))
		docs[i] = fmt.Sprintf("Document %d.\n", i) + Text(rng, cfg.DocTokens*CharsPerToken-len(fmt.Sprintf("Document %d.\n", i)))
	}
	rng := rngFor(seed, 1)
	var zipf *rand.Zipf
	switch cfg.Popularity {
	case Uniform, "":
	case Zipf:
		s := cfg.ZipfS
		if s <= 1 {
			s = 1.1
		}
		zipf = rand.NewZipf(rng, s, 1, uint64(cfg.Documents-1))
	default:
		return nil, fmt.Errorf("long-context: popularity must be uniform or zipf, got %q", cfg.Popularity)
	}
	w := &Workload{Name: "long-context", Requests: make([]Request, n),
		Describe: fmt.Sprintf("%d documents × %d tokens (%s popularity), questions %d–%d tokens, max_tokens %d–%d",
			cfg.Documents, cfg.DocTokens, orDefault(cfg.Popularity, Uniform), cfg.QuestionTokens[0], cfg.QuestionTokens[1], cfg.OutputTokens[0], cfg.OutputTokens[1])}
	for i := range w.Requests {
		var d int
		if zipf != nil {
			d = int(zipf.Uint64())
		} else {
			d = rng.IntN(cfg.Documents)
		}
		q := uniformInt(rng, cfg.QuestionTokens[0], cfg.QuestionTokens[1])
		head := fmt.Sprintf("\n\nQuestion %d: ", i)
		question := head + Text(rng, max(q*CharsPerToken-len(head), 1))
		w.Requests[i] = Request{
			Messages:  []Message{{Role: "user", lead: docs[d], Content: question}},
			MaxTokens: uniformInt(rng, cfg.OutputTokens[0], cfg.OutputTokens[1]),
		}
	}
	return w, nil
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// ShareGPTConfig shapes the sharegpt workload.
type ShareGPTConfig struct {
	// Conversations open at once; each request continues a random open
	// conversation, and a finished one is replaced by a new one.
	Active int
}

// ShareGPT generates n requests from multi-turn chats whose history grows
// turn by turn. The distributions follow published ShareGPT statistics
// (vLLM's and SGLang's benchmark loaders, the Mooncake and
// CachedAttention papers): turns per conversation uniform in 2–12 (mean
// 7, ShareGPT's multi-turn subset averages about 5–8 after filtering);
// user messages log-normal, median 60 tokens (σ 1.0, 8–1,500); assistant
// replies log-normal, median 220 tokens (σ 0.6, 16–1,024), which is also
// each turn's max_tokens. A short system prompt (120 tokens) is shared by
// every conversation, as in a chat product. The assistant text in a
// conversation's history is generated here, not taken from the server's
// answers, so the request sequence is identical for every strategy.
func ShareGPT(cfg ShareGPTConfig, n int, seed uint64) (*Workload, error) {
	if cfg.Active < 1 {
		cfg.Active = 32
	}
	system := Text(rngFor(seed, 7), 120*CharsPerToken)
	type conv struct {
		msgs  []Message
		turns int
		done  int
		rng   *rand.Rand
	}
	next := uint64(0)
	newConv := func() *conv {
		next++
		r := rngFor(seed, 10000+next)
		return &conv{msgs: []Message{{Role: "system", Content: system}}, turns: uniformInt(r, 2, 12), rng: r}
	}
	open := make([]*conv, cfg.Active)
	for i := range open {
		open[i] = newConv()
	}
	pick := rngFor(seed, 2)
	w := &Workload{Name: "sharegpt", Requests: make([]Request, n),
		Describe: fmt.Sprintf("%d open conversations, 2–12 turns, user ~LN(60 tok), assistant ~LN(220 tok)", cfg.Active)}
	for i := range w.Requests {
		k := pick.IntN(len(open))
		c := open[k]
		user := logNormalInt(c.rng, 60, 1.0, 8, 1500)
		c.msgs = append(c.msgs, Message{Role: "user", Content: Text(c.rng, user*CharsPerToken)})
		reply := logNormalInt(c.rng, 220, 0.6, 16, 1024)
		w.Requests[i] = Request{Messages: append([]Message(nil), c.msgs...), MaxTokens: reply}
		c.msgs = append(c.msgs, Message{Role: "assistant", Content: Text(c.rng, reply*CharsPerToken)})
		if c.done++; c.done >= c.turns {
			open[k] = newConv()
		}
	}
	return w, nil
}

// AgenticConfig shapes the agentic workload.
type AgenticConfig struct {
	Agents int // distinct agent kinds (system prompt + tool schema)
	Active int // sessions open at once
}

// Agentic generates n requests of tool-using agent sessions: each session
// starts from its agent kind's long system prompt (3,000 tokens) and tool
// schema (1,500 tokens), then grows by an assistant tool call (40–160
// tokens) and a tool result (log-normal, median 400 tokens, 50–4,000) per
// step, for 5–30 steps. Each request asks for the next tool call
// (max_tokens 40–160).
func Agentic(cfg AgenticConfig, n int, seed uint64) (*Workload, error) {
	if cfg.Agents < 1 {
		cfg.Agents = 4
	}
	if cfg.Active < 1 {
		cfg.Active = 24
	}
	systems := make([]string, cfg.Agents)
	for i := range systems {
		r := rngFor(seed, 500+uint64(i))
		systems[i] = fmt.Sprintf("You are agent %d.\n", i) + Text(r, 3000*CharsPerToken) +
			"\n\nTools (JSON schema):\n" + Text(r, 1500*CharsPerToken)
	}
	type session struct {
		msgs  []Message
		steps int
		done  int
		rng   *rand.Rand
	}
	next := uint64(0)
	newSession := func() *session {
		next++
		r := rngFor(seed, 20000+next)
		task := Text(r, uniformInt(r, 50, 300)*CharsPerToken)
		return &session{msgs: []Message{{Role: "system", Content: systems[r.IntN(cfg.Agents)]}, {Role: "user", Content: task}},
			steps: uniformInt(r, 5, 30), rng: r}
	}
	open := make([]*session, cfg.Active)
	for i := range open {
		open[i] = newSession()
	}
	pick := rngFor(seed, 3)
	w := &Workload{Name: "agentic", Requests: make([]Request, n),
		Describe: fmt.Sprintf("%d agent kinds (3,000-token system + 1,500-token tools), %d open sessions of 5–30 tool steps", cfg.Agents, cfg.Active)}
	for i := range w.Requests {
		k := pick.IntN(len(open))
		s := open[k]
		call := uniformInt(s.rng, 40, 160)
		w.Requests[i] = Request{Messages: append([]Message(nil), s.msgs...), MaxTokens: call}
		s.msgs = append(s.msgs,
			Message{Role: "assistant", Content: `{"tool_call": "` + Text(s.rng, call*CharsPerToken) + `"}`},
			Message{Role: "tool", Content: Text(s.rng, logNormalInt(s.rng, 400, 1.0, 50, 4000)*CharsPerToken)})
		if s.done++; s.done >= s.steps {
			open[k] = newSession()
		}
	}
	return w, nil
}
