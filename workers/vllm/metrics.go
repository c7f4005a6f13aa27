package vllm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/batonllm/baton/workers/engine"
)

// Engine names whose metrics to read.
type Engine uint8

// Engines.
const (
	VLLM Engine = iota
	SGLang
	// LlamaCPP is llama.cpp's llama-server (with --metrics), whose
	// requests_processing and requests_deferred are its running and
	// waiting requests.
	LlamaCPP
)

func (e Engine) String() string {
	switch e {
	case SGLang:
		return "sglang"
	case LlamaCPP:
		return "llamacpp"
	}
	return "vllm"
}

// ErrGarbage: the metrics text did not parse, or a metric baton reads is
// missing or holds a value it cannot hold (a negative count, a usage above
// 1). Parse's error wraps it, with the reason.
var ErrGarbage = errors.New("unusable engine metrics")

// Metrics is what baton reads of an engine's metrics: engine.Load, which
// every kind of engine's scraper returns.
type Metrics = engine.Load

// names are the metric names of one engine.
type names struct {
	running, waiting string
	usage            []string // the first present is read
	cacheInfo        string   // vLLM's info gauge, labels block_size and num_gpu_blocks
	loraInfo         string   // vLLM's LoRA gauge (Metrics.Adapters)
	kvTokens         string
	rankLabel        string // the label naming a data-parallel rank's series

	read  map[string]struct{} // the names above, set by init
	byLen []sameLen           // the same, grouped by length, set by init
}

// sameLen is the names read of one length.
type sameLen struct {
	n     int
	names []string
}

var engineNames = map[Engine]names{
	VLLM: {
		running:   "vllm:num_requests_running",
		waiting:   "vllm:num_requests_waiting",
		usage:     []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
		cacheInfo: "vllm:cache_config_info",
		loraInfo:  "vllm:lora_requests_info",
		rankLabel: "engine",
	},
	SGLang: {
		running:  "sglang:num_running_reqs",
		waiting:  "sglang:num_queue_reqs",
		usage:    []string{"sglang:token_usage"},
		kvTokens: "sglang:max_total_num_tokens",
		// Its schedulers label their metrics dp_rank under --dp-size.
		rankLabel: "dp_rank",
	},
	LlamaCPP: {
		running: "llamacpp:requests_processing",
		waiting: "llamacpp:requests_deferred",
		usage:   []string{"llamacpp:kv_cache_usage_ratio"}, // before 2025
	},
}

// Parse reads an engine's metrics from the Prometheus text exposition
// format. Metrics it does not read are ignored. On error, which wraps
// ErrGarbage and names every problem, the Metrics hold what could be read:
// the families before a syntax error, the metrics that held sane values.
func Parse(r io.Reader, e Engine) (Metrics, error) {
	return ParseEngine(r, e, "")
}

// ParseEngine is Parse of the series of one data-parallel engine: those
// labelled with its index (vLLM's engine="r", SGLang's dp_rank="r"), and
// those of families that label none. "" reads every series.
//
// Only the lines of the families it reads reach the text parser: an
// engine's page is tens of kilobytes (vLLM's request histograms, the HTTP
// server's and the process's metrics) of which it reads a dozen lines, and
// a scheduler in front of a thousand engines reads four thousand pages a
// second. A syntax error in a family it does not read is not seen.
func ParseEngine(r io.Reader, e Engine, engine string) (Metrics, error) {
	n := engineNames[e]
	buf := pageBuffers.Get().(*pageBuffer)
	defer pageBuffers.Put(buf)
	buf.page.Reset()
	_, rerr := buf.page.ReadFrom(r)
	buf.kept = n.keep(buf.page.Bytes(), buf.kept[:0])
	fams, perr := parseText(buf.kept)
	if perr == nil && rerr != nil {
		perr = rerr
	}
	if engine != "" && n.rankLabel != "" {
		for _, f := range fams {
			f.samples = engineSeries(f.samples, n.rankLabel, engine)
		}
	}
	var problems []string
	if perr != nil {
		problems = append(problems, perr.Error())
	}
	var m Metrics
	running, okR := count(fams, n.running, &problems)
	waiting, okW := count(fams, n.waiting, &problems)
	if okR && okW {
		m.Running, m.Waiting, m.HasLoad = running, waiting, true
	}
	for _, name := range n.usage {
		if fams[name] == nil {
			continue
		}
		if u, ok := usage(fams, name, &problems); ok {
			m.KVUsage, m.HasKVUsage = u, true
		}
		break
	}
	if n.cacheInfo != "" {
		m.BlockSize, m.GPUBlocks = cacheInfo(fams, n.cacheInfo, &problems)
	}
	if n.loraInfo != "" && fams[n.loraInfo] != nil {
		m.Adapters, m.MaxLoRAs, m.HasLoRA = loraInfo(fams[n.loraInfo], &problems)
	}
	if n.kvTokens != "" && fams[n.kvTokens] != nil {
		if v, ok := sum(fams, n.kvTokens, &problems); ok {
			m.KVTokens = int64(v)
		}
	}
	if len(problems) > 0 {
		return m, fmt.Errorf("%w: %s", ErrGarbage, strings.Join(problems, "; "))
	}
	return m, nil
}

// engineSeries returns the samples of ss whose label is engine, or ss
// when none has the label.
func engineSeries(ss []sample, label, engine string) []sample {
	var out []sample
	labelled := false
	for _, s := range ss {
		if v, ok := s.label(label); ok {
			labelled = true
			if v == engine {
				out = append(out, s)
			}
		}
	}
	if !labelled {
		return ss
	}
	return out
}

// sum returns the sum of a family's samples, each finite and not
// negative; ok is false (with a problem noted) otherwise, or when the
// family is missing.
func sum(fams map[string]*family, name string, problems *[]string) (float64, bool) {
	f := fams[name]
	if f == nil || len(f.samples) == 0 {
		*problems = append(*problems, name+" missing")
		return 0, false
	}
	var total float64
	for i := range f.samples {
		v := f.val(&f.samples[i])
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > 1<<53 {
			*problems = append(*problems, fmt.Sprintf("%s: %v is not a count", name, v))
			return 0, false
		}
		total += v
	}
	return total, true
}

// count is sum, for a family that counts requests.
func count(fams map[string]*family, name string, problems *[]string) (int, bool) {
	v, ok := sum(fams, name, problems)
	if !ok {
		return 0, false
	}
	if v > math.MaxInt32 {
		*problems = append(*problems, fmt.Sprintf("%s: %v is not a count", name, v))
		return 0, false
	}
	return int(math.Round(v)), true
}

// usage returns the mean of a family's samples, each a fraction 0–1.
func usage(fams map[string]*family, name string, problems *[]string) (float64, bool) {
	f := fams[name]
	if f == nil || len(f.samples) == 0 {
		return 0, false
	}
	var total float64
	for i := range f.samples {
		v := f.val(&f.samples[i])
		if !(v >= 0 && v <= 1) { // NaN too
			*problems = append(*problems, fmt.Sprintf("%s: %v is not a fraction 0–1", name, v))
			return 0, false
		}
		total += v
	}
	return total / float64(len(f.samples)), true
}

// cacheInfo reads vLLM's cache_config_info labels: the block size (of the
// first sample) and the GPU blocks of every sample (one per data-parallel
// engine). A missing family is no problem: not every version has it.
func cacheInfo(fams map[string]*family, name string, problems *[]string) (blockSize int, gpuBlocks int64) {
	f := fams[name]
	if f == nil {
		return 0, 0
	}
	for _, s := range f.samples {
		for _, l := range s.labels {
			switch l.name {
			case "block_size":
				v, err := strconv.Atoi(l.value)
				if err != nil || v <= 0 || v > 1<<20 {
					*problems = append(*problems, fmt.Sprintf("%s: block_size %q is not a block size", name, l.value))
					return 0, 0
				}
				if blockSize == 0 {
					blockSize = v
				}
			case "num_gpu_blocks":
				if l.value == "None" || l.value == "" {
					continue // before the engine profiled its memory
				}
				v, err := strconv.ParseInt(l.value, 10, 64)
				if err != nil || v < 0 || v > 1<<40 {
					*problems = append(*problems, fmt.Sprintf("%s: num_gpu_blocks %q is not a count", name, l.value))
					return 0, 0
				}
				gpuBlocks += v
			}
		}
	}
	return blockSize, gpuBlocks
}

// loraInfo reads vLLM's lora_requests_info: of each engine's series (one
// engine, or one per engine label), the one set last, whose value is the
// time it was set; the adapters its running_lora_adapters and
// waiting_lora_adapters name, and its max_lora (summed over engines).
func loraInfo(f *family, problems *[]string) (adapters []string, maxLoRAs int, ok bool) {
	name := f.name
	latest := map[string]*sample{} // engine → its latest series
	for i := range f.samples {
		s := &f.samples[i]
		engine, _ := s.label("engine")
		if v := f.val(s); math.IsNaN(v) {
			*problems = append(*problems, fmt.Sprintf("%s: %v is not a time", name, v))
			return nil, 0, false
		} else if cur := latest[engine]; cur == nil || v > f.val(cur) {
			latest[engine] = s
		}
	}
	for _, s := range latest {
		for _, l := range s.labels {
			switch l.name {
			case "max_lora":
				v, err := strconv.Atoi(l.value)
				if err != nil || v < 0 || v > 1<<20 {
					*problems = append(*problems, fmt.Sprintf("%s: max_lora %q is not a count", name, l.value))
					return nil, 0, false
				}
				maxLoRAs += v
			case "running_lora_adapters", "waiting_lora_adapters":
				for _, a := range strings.Split(l.value, ",") {
					if a = strings.TrimSpace(a); a != "" && !slices.Contains(adapters, a) {
						adapters = append(adapters, a)
					}
				}
			}
		}
	}
	slices.Sort(adapters)
	return adapters, maxLoRAs, len(latest) > 0
}

// pageBuffer holds a page read and the lines of it kept for the parser.
type pageBuffer struct {
	page bytes.Buffer
	kept []byte
}

var pageBuffers = sync.Pool{New: func() any { return new(pageBuffer) }}

// keep appends to dst the lines of page that belong to the families n
// reads: their samples and their HELP and TYPE comments. Other comments
// and other families' lines are left out.
//
// Most of a page is other families' samples (vLLM's histograms), so a
// sample line that starts at its first byte is matched without reading
// its name through: a name read is in the line only if the byte after
// its length ends a name, and only then are the bytes compared; so is
// the name of a HELP or TYPE comment written as the format's writers
// write it ("# HELP name"). Other lines (a leading blank, other spacing)
// are read by lineName, as keepSlow reads every line (FuzzKeep checks
// the two agree).
func (n names) keep(page, dst []byte) []byte { return n.keepLines(page, dst, false) }

// keepSlow is keep reading every line's name: what keep must agree with.
func (n names) keepSlow(page, dst []byte) []byte { return n.keepLines(page, dst, true) }

func (n names) keepLines(page, dst []byte, slow bool) []byte {
	for len(page) > 0 {
		line := page
		if i := bytes.IndexByte(page, '\n'); i >= 0 {
			line, page = page[:i+1], page[i+1:]
		} else {
			page = nil
		}
		var ok bool
		switch c := line[0]; {
		case slow || (c == '#' || isBlankByte(c)) && !helpOrType(line):
			_, ok = n.read[string(lineName(line))]
		case c == '#':
			ok = n.startsWithRead(line[7:])
		default:
			ok = n.startsWithRead(line)
		}
		if ok {
			dst = append(dst, line...)
			if dst[len(dst)-1] != '\n' {
				dst = append(dst, '\n')
			}
		}
	}
	return dst
}

// helpOrType reports whether line is a HELP or TYPE comment spaced as the
// format's writers space it: "# HELP name".
func helpOrType(line []byte) bool {
	return len(line) > 7 && (string(line[:7]) == "# HELP " || string(line[:7]) == "# TYPE ") && !isBlankByte(line[7])
}

// startsWithRead reports whether line, a sample's without leading blanks,
// is of a family n reads: lineName(line) is one of its names.
func (n names) startsWithRead(line []byte) bool {
	for _, g := range n.byLen {
		if len(line) <= g.n {
			break // byLen is by length, shortest first
		}
		switch line[g.n] {
		case '{', ' ', '\t', '\r', '\n':
		default:
			continue
		}
		for _, name := range g.names {
			if string(line[:g.n]) == name {
				return true
			}
		}
	}
	return false
}

// lineName returns the metric name a line of the text format is a sample
// of, or its HELP or TYPE comment is about; nil for other lines.
func lineName(line []byte) []byte {
	line = skipBlank(line)
	if len(line) > 0 && line[0] == '#' {
		kw, rest := field(skipBlank(line[1:]))
		if string(kw) != "HELP" && string(kw) != "TYPE" {
			return nil
		}
		line = skipBlank(rest)
	}
	i := 0
	for i < len(line) && isNameByte(line[i]) {
		i++
	}
	if i == len(line) {
		return nil // a name must be followed by something
	}
	switch line[i] {
	case '{', ' ', '\t', '\r', '\n':
		return line[:i]
	}
	return nil
}

// The names each engine's keep reads, as a set.
func init() {
	for e, n := range engineNames {
		n.read = map[string]struct{}{}
		for _, f := range append([]string{n.running, n.waiting, n.cacheInfo, n.loraInfo, n.kvTokens}, n.usage...) {
			if f != "" {
				n.read[f] = struct{}{}
			}
		}
		n.byLen = groupByLen(n.read)
		engineNames[e] = n
	}
}

// groupByLen returns the names of set grouped by length, shortest first.
func groupByLen(set map[string]struct{}) []sameLen {
	var groups []sameLen
	for name := range set {
		i := slices.IndexFunc(groups, func(g sameLen) bool { return g.n == len(name) })
		if i < 0 {
			groups = append(groups, sameLen{n: len(name)})
			i = len(groups) - 1
		}
		groups[i].names = append(groups[i].names, name)
	}
	slices.SortFunc(groups, func(a, b sameLen) int { return a.n - b.n })
	return groups
}
