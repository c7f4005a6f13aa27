// Package calibration measures an engine behind its OpenAI API and fits
// the cost figures kv_aware estimates its time to first token with
// (workers/engine/cost.Figures): the effective prefill FLOP/s from the
// time to first token of prompts of several lengths, cold and then warm
// (the difference is the prefill of what was not cached, whatever the
// engine's fixed overheads); the decode step from the gaps between the
// tokens of one stream; the HBM bandwidth from how much longer the step
// of several streams decoding together is with long prompts than with
// short ones. The model's shape (layers, hidden size, KV bytes per block)
// comes from a preset, since the API does not tell it. baton calibrate
// prints the result as a worker's cost block.
package calibration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/batonllm/baton/workers/engine/cost"
)

// Config says what to measure. The zero value of every field but URL
// means its default.
type Config struct {
	// URL is the engine's base URL, as http://10.0.0.7:8000. Required.
	URL string
	// Model is the model requested; "" asks the engine's /v1/models.
	Model string
	// Preset is the model preset (cost.Models) whose shape the figures
	// assume; "" means cost.DefaultModel.
	Preset string
	// Lengths are the prompt lengths measured, in tokens of about 4
	// characters; default 1,024, 2,048 and 4,096.
	Lengths []int
	// Repeats is how many prompts of each length, decode streams and
	// batches of each kind are measured, the least time to first token
	// kept, and the median step (of a batch: its least round's); default 3.
	Repeats int
	// DecodeTokens is the tokens each decode stream generates; default 64.
	DecodeTokens int
	// Batch and BatchContext are the streams decoded together, and the
	// prompt tokens of each, for the HBM bandwidth; default 8 of 4,096
	// (4.3 GB of KV for Llama-3.1-8B). Batch -1 skips it.
	Batch, BatchContext int
	// MaxRequests bounds the requests sent; default 200. Timeout bounds
	// the whole measurement; default 5 minutes.
	MaxRequests int
	Timeout     time.Duration
	// Progress, if set, hears a line per measurement.
	Progress io.Writer
	// Client sends the requests; nil means a client of its own, whose
	// connections close when Run returns.
	Client *http.Client
}

func (c Config) withDefaults() Config {
	if len(c.Lengths) == 0 {
		c.Lengths = []int{1024, 2048, 4096}
	}
	if c.Preset == "" {
		c.Preset = cost.DefaultModel
	}
	if c.Repeats <= 0 {
		c.Repeats = 3
	}
	if c.DecodeTokens <= 1 {
		c.DecodeTokens = 64
	}
	if c.Batch == 0 {
		c.Batch = 8
	}
	if c.BatchContext <= 0 {
		c.BatchContext = 4096
	}
	if c.MaxRequests <= 0 {
		c.MaxRequests = 200
	}
	if c.Timeout <= 0 {
		c.Timeout = 5 * time.Minute
	}
	c.URL = strings.TrimRight(c.URL, "/")
	return c
}

// Prefill is one prompt length's measurement: the engine's prompt tokens,
// the tokens it found cached the second time, and the least of the two
// times to first token over the repeats.
type Prefill struct {
	Tokens, Cached int
	Cold, Warm     time.Duration
}

// Result is what was measured and the figures fitted to it.
type Result struct {
	// Figures are the preset's, with FLOPS, DecodeStepSeconds and (when
	// measured) HBMBytesPerSecond fitted.
	Figures cost.Figures
	// HBMMeasured says HBMBytesPerSecond was fitted.
	HBMMeasured bool
	Prefills    []Prefill
	// Step is the decode step at batch 1; BatchStep and BatchBaseStep
	// the steps (the least round's median gap) of Batch streams of
	// BatchContext tokens and of short ones, whose KV differs by
	// BatchTokens tokens.
	Step, BatchStep, BatchBaseStep time.Duration
	BatchTokens                    int
	Requests                       int
}

// ErrBudget: the measurement needed more requests than MaxRequests.
var ErrBudget = errors.New("request budget spent")

// Run measures the engine cfg names.
func Run(ctx context.Context, cfg Config) (Result, error) {
	cfg = cfg.withDefaults()
	if cfg.URL == "" {
		return Result{}, errors.New("no engine URL")
	}
	eng, err := cost.NewEngine(cfg.Preset, cost.DefaultGPU, 1)
	if err != nil {
		return Result{}, fmt.Errorf("preset: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if cfg.Client == nil {
		tr := &http.Transport{MaxIdleConnsPerHost: 64}
		defer tr.CloseIdleConnections()
		cfg.Client = &http.Client{Transport: tr}
	}
	m := &meter{cfg: cfg}
	if m.model = cfg.Model; m.model == "" {
		if m.model, err = m.firstModel(ctx); err != nil {
			return Result{}, err
		}
	}
	res := Result{Figures: cost.DefaultFigures}
	res.Figures.Layers, res.Figures.Hidden, res.Figures.KVBytesPerBlock = eng.Model.Layers, eng.Model.Hidden, eng.KVBytesPerBlock()

	// Prefill: cold, then the same prompt warm.
	var num, den float64 // least squares of t = flops/FLOPS through the origin
	for _, n := range cfg.Lengths {
		var p Prefill
		var colds, warms []time.Duration
		for r := range cfg.Repeats {
			prompt := promptText(fmt.Sprintf("p%d-%d-%d", n, r, time.Now().UnixNano()), n)
			cold, err := m.stream(ctx, prompt, 1)
			if err != nil {
				return res, err
			}
			warm, err := m.stream(ctx, prompt, 1)
			if err != nil {
				return res, err
			}
			colds, warms = append(colds, cold.first), append(warms, warm.first)
			p.Tokens, p.Cached = cold.prompt, warm.cached
		}
		// The least: delays (a step in progress, the host's scheduling)
		// only add to a time to first token.
		p.Cold, p.Warm = slices.Min(colds), slices.Min(warms)
		res.Prefills = append(res.Prefills, p)
		f := res.Figures
		f.FLOPS = 1
		flops := f.PrefillSeconds(p.Tokens, 0) - f.PrefillSeconds(p.Tokens-p.Cached, p.Cached)
		t := (p.Cold - p.Warm).Seconds()
		m.progress("prefill %d tokens: cold %v, warm %v (%d cached)", p.Tokens, p.Cold.Round(time.Microsecond), p.Warm.Round(time.Microsecond), p.Cached)
		if t > 0 && flops > 0 {
			num += flops * flops
			den += flops * t
		}
	}
	if den <= 0 {
		return res, errors.New("warm prompts were no faster than cold ones: does the engine cache prefixes?")
	}
	res.Figures.FLOPS = num / den

	// Decode: the gaps between one stream's tokens.
	var singles []sample
	for r := range cfg.Repeats {
		s, err := m.stream(ctx, promptText(fmt.Sprintf("d%d-%d", r, time.Now().UnixNano()), 16), cfg.DecodeTokens)
		if err != nil {
			return res, err
		}
		singles = append(singles, s)
	}
	var steps []time.Duration
	for _, s := range singles {
		g, _ := inStep([]sample{s})
		steps = append(steps, g...)
	}
	if len(steps) == 0 {
		return res, errors.New("decode streams carried no tokens apart: is the engine streaming token by token?")
	}
	res.Step = median(steps) / time.Duration(tokensPerChunk(singles))
	res.Figures.DecodeStepSeconds = res.Step.Seconds()
	m.progress("decode step at batch 1: %v", res.Step.Round(time.Microsecond))

	if cfg.Batch > 0 {
		if err := m.batch(ctx, &res); err != nil {
			return res, err
		}
	}
	res.Requests = m.requests
	return res, nil
}

// shortContext is the prompt, in tokens, of the batch the long one is
// compared with.
const shortContext = 16

// minGrowth is the least growth of the decode step, as a fraction of the
// short batch's, from which the HBM bandwidth is fitted: below it the
// difference is mostly the host's jitter.
const minGrowth = 0.05

// batch measures the decode step of cfg.Batch streams decoding together,
// with prompts of cfg.BatchContext tokens and with short ones, in turn,
// cfg.Repeats times each, and fits the HBM bandwidth to the difference.
// Both batches emit as many tokens a step, so what a step costs per
// stream (the engine's bookkeeping, the host writing and reading the
// chunks) cancels, and the difference is the reading of the long
// prompts' KV. The long prompts are prefilled first, so that an engine
// caching prefixes starts every round's streams in step.
func (m *meter) batch(ctx context.Context, res *Result) error {
	cfg := m.cfg
	salt := time.Now().UnixNano()
	long, short := make([]string, cfg.Batch), make([]string, cfg.Batch)
	for i := range cfg.Batch {
		long[i] = promptText(fmt.Sprintf("b%d-%d", i, salt), cfg.BatchContext)
		short[i] = promptText(fmt.Sprintf("s%d-%d", i, salt), shortContext)
	}
	if _, err := m.together(ctx, long, 1); err != nil {
		return err
	}
	// Each round's step is its median gap; each batch's is its least
	// round's. A loaded host only ever delays a step, and by how much
	// changes from round to round: the least round carries the least of
	// it, alike for both batches, where a median over all rounds would
	// keep whichever batch met the busier moments slower.
	var longSteps, shortSteps []time.Duration
	var all []sample
	longTokens, shortTokens := 0, 0
	for r := range cfg.Repeats {
		// Alternate which goes first, so that a drift of the host's
		// load weighs on both alike.
		order := []bool{r%2 == 0, r%2 != 0}
		for _, isLong := range order {
			prompts := short
			if isLong {
				prompts = long
			}
			out, err := m.together(ctx, prompts, cfg.DecodeTokens)
			if err != nil {
				return err
			}
			gaps, tokens := inStep(out)
			if len(gaps) == 0 {
				continue
			}
			all = append(all, out...)
			if isLong {
				longSteps, longTokens = append(longSteps, median(gaps)), tokens
			} else {
				shortSteps, shortTokens = append(shortSteps, median(gaps)), tokens
			}
		}
	}
	if len(longSteps) == 0 || len(shortSteps) == 0 {
		m.progress("batch of %d: the streams never decoded together; HBM bandwidth not measured", cfg.Batch)
		return nil
	}
	k := time.Duration(tokensPerChunk(all))
	res.BatchStep, res.BatchBaseStep = slices.Min(longSteps)/k, slices.Min(shortSteps)/k
	res.BatchTokens = longTokens - shortTokens
	m.progress("decode step of %d streams: %v over %d tokens of KV, %v over %d", cfg.Batch,
		res.BatchStep.Round(time.Microsecond), longTokens, res.BatchBaseStep.Round(time.Microsecond), shortTokens)
	extra := (res.BatchStep - res.BatchBaseStep).Seconds()
	if extra < minGrowth*res.BatchBaseStep.Seconds() || res.BatchTokens <= 0 {
		m.progress("the step grew by less than %.0f%% with the KV read; HBM bandwidth not measured (raise --batch or --batch-context)", 100*minGrowth)
		return nil
	}
	perToken := float64(res.Figures.KVBytesPerBlock) / float64(cost.BlockTokens)
	res.Figures.HBMBytesPerSecond = float64(res.BatchTokens) * perToken / extra
	res.HBMMeasured = true
	return nil
}

// together streams every prompt at once, for maxTokens tokens each.
func (m *meter) together(ctx context.Context, prompts []string, maxTokens int) ([]sample, error) {
	out := make([]sample, len(prompts))
	errs := make([]error, len(prompts))
	var wg sync.WaitGroup
	for i, p := range prompts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = m.stream(ctx, p, maxTokens)
		}()
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// tokensPerChunk is how many tokens the engine sends a chunk: 1 unless it
// holds them back on purpose (vLLM's --stream-interval), the odd chunk
// carrying two (a reader late by a step) rounded away.
func tokensPerChunk(out []sample) int {
	tokens, chunks := 0, 0
	for _, s := range out {
		tokens, chunks = tokens+s.tokens-1, chunks+len(s.at)-1
	}
	if chunks <= 0 {
		return 1
	}
	return max(1, int(math.Round(float64(tokens)/float64(chunks))))
}

// inStep returns the gaps between consecutive chunks of each stream
// while every stream decodes (from the last stream's first token to the
// first stream's last), and the prompt tokens of all. Steps are told by
// their median gap: a step the host delayed, or two tokens sent as one
// chunk, skew a mean but barely move a median.
func inStep(out []sample) (gaps []time.Duration, tokens int) {
	from, to := out[0].firstAt, out[0].last
	for _, s := range out {
		from, to = later(from, s.firstAt), earlier(to, s.last)
		tokens += s.prompt
	}
	for _, s := range out {
		var prev time.Time
		for _, t := range s.at {
			if t.Before(from) || t.After(to) {
				continue
			}
			if !prev.IsZero() {
				gaps = append(gaps, t.Sub(prev))
			}
			prev = t
		}
	}
	return gaps, tokens
}

// YAML renders the fitted figures as a worker's cost block.
func (r Result) YAML() string {
	var b strings.Builder
	f := r.Figures
	fmt.Fprintf(&b, "cost:\n")
	fmt.Fprintf(&b, "  flops: %.4g\n", f.FLOPS)
	fmt.Fprintf(&b, "  decode_step_seconds: %.4g\n", f.DecodeStepSeconds)
	if r.HBMMeasured {
		fmt.Fprintf(&b, "  hbm_bytes_per_second: %.4g\n", f.HBMBytesPerSecond)
	}
	fmt.Fprintf(&b, "  layers: %d\n  hidden: %d\n  kv_bytes_per_block: %d\n", f.Layers, f.Hidden, f.KVBytesPerBlock)
	return b.String()
}

// meter sends the measurement's requests.
type meter struct {
	cfg      Config
	model    string
	mu       sync.Mutex
	requests int
}

func (m *meter) progress(format string, args ...any) {
	if m.cfg.Progress != nil {
		fmt.Fprintf(m.cfg.Progress, format+"\n", args...)
	}
}

// sample is one stream's timing.
type sample struct {
	first          time.Duration // from the request to the first token
	firstAt, last  time.Time
	at             []time.Time // of each chunk with text
	tokens         int         // generated, as its usage says (else chunks)
	prompt, cached int
}

// chunk is what a stream's chunk tells.
type chunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Timings *struct {
		CacheN  int `json:"cache_n"`
		PromptN int `json:"prompt_n"`
	} `json:"timings"`
}

// stream sends one streamed chat completion of prompt for maxTokens
// tokens and times it.
func (m *meter) stream(ctx context.Context, prompt string, maxTokens int) (sample, error) {
	m.mu.Lock()
	if m.requests >= m.cfg.MaxRequests {
		m.mu.Unlock()
		return sample{}, fmt.Errorf("%w (%d)", ErrBudget, m.cfg.MaxRequests)
	}
	m.requests++
	m.mu.Unlock()
	body, _ := json.Marshal(map[string]any{
		"model":          m.model,
		"messages":       []map[string]string{{"role": "user", "content": prompt}},
		"max_tokens":     maxTokens,
		"min_tokens":     maxTokens, // vLLM, SGLang: every stream as long
		"ignore_eos":     true,      // llama-server, vLLM
		"stream":         true,
		"stream_options": map[string]bool{"include_usage": true},
		"cache_prompt":   true,
		"temperature":    0,
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.cfg.URL+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return sample{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := m.cfg.Client.Do(req)
	if err != nil {
		return sample{}, fmt.Errorf("chat completion: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
		return sample{}, fmt.Errorf("chat completion: status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	var s sample
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if bytes.Equal(data, []byte("[DONE]")) {
			break
		}
		now := time.Now()
		var c chunk
		if json.Unmarshal(data, &c) != nil {
			continue
		}
		for _, ch := range c.Choices {
			if ch.Text != "" || ch.Delta.Content != "" {
				if len(s.at) == 0 {
					s.first, s.firstAt = now.Sub(start), now
				}
				s.at = append(s.at, now)
				s.last = now
				break
			}
		}
		if u := c.Usage; u != nil {
			s.prompt, s.tokens = u.PromptTokens, u.CompletionTokens
			if u.PromptTokensDetails != nil {
				s.cached = u.PromptTokensDetails.CachedTokens
			}
		}
		if t := c.Timings; t != nil && s.cached == 0 {
			s.cached = t.CacheN
			if s.prompt == 0 {
				s.prompt = t.PromptN + t.CacheN
			}
		}
	}
	if err := sc.Err(); err != nil {
		return s, fmt.Errorf("reading stream: %w", err)
	}
	if len(s.at) == 0 {
		return s, errors.New("chat completion: the stream carried no text")
	}
	if s.tokens == 0 {
		s.tokens = len(s.at)
	}
	if s.prompt == 0 {
		return s, errors.New("chat completion: no usage (prompt_tokens) reported")
	}
	return s, nil
}

// firstModel returns the first model the engine lists.
func (m *meter) firstModel(ctx context.Context) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, m.cfg.URL+"/v1/models", nil)
	if err != nil {
		return "", err
	}
	resp, err := m.cfg.Client.Do(req)
	if err != nil {
		return "", fmt.Errorf("listing models: %w", err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&list); err != nil || len(list.Data) == 0 {
		return "", fmt.Errorf("listing models: none listed (%v); name one", err)
	}
	return list.Data[0].ID, nil
}

// promptText returns about tokens tokens of text (4 characters each),
// distinct for each seed from its first characters.
func promptText(seed string, tokens int) string {
	var b strings.Builder
	for i := 0; b.Len() < 4*tokens; i++ {
		fmt.Fprintf(&b, "%s w%d ", seed, i)
	}
	return b.String()[:4*tokens]
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func earlier(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
