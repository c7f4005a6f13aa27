package bench

import (
	"bufio"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Quantiles are latency percentiles in modelled seconds.
type Quantiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
}

func quantiles(xs []float64) Quantiles {
	s := slices.Clone(xs)
	slices.Sort(s)
	return Quantiles{sortedPercentile(s, 50), sortedPercentile(s, 90), sortedPercentile(s, 99)}
}

// StrategyReport is one strategy's measurements. Latencies and rates are
// in modelled time (wall time × speedup).
type StrategyReport struct {
	// Strategy is the column's label: the strategy, with "/disagg:P:D"
	// on a disaggregated fleet.
	Strategy string `json:"strategy"`
	// Fleet describes the fleet it ran on.
	Fleet string `json:"fleet"`
	// Requests were sent; OK completed; Errors failed.
	Requests int `json:"requests"`
	OK       int `json:"ok"`
	Errors   int `json:"errors"`
	// ErrorSample is one error message, if any.
	ErrorSample string `json:"error_sample,omitempty"`

	TTFT Quantiles `json:"ttft_s"`
	// TTFTMean is the mean TTFT of the successful requests, in seconds.
	TTFTMean float64   `json:"ttft_mean_s"`
	ITL      Quantiles `json:"itl_s"`
	E2E      Quantiles `json:"e2e_s"`

	// Duration is from the first arrival to the last completion.
	Duration        float64 `json:"duration_s"`
	RequestsPerSec  float64 `json:"requests_per_s"`
	OutputTokPerSec float64 `json:"output_tokens_per_s"`

	PromptTokens int64   `json:"prompt_tokens"`
	CachedTokens int64   `json:"cached_tokens"`
	HitRate      float64 `json:"kv_hit_rate"`
	// ShortHitRate is the hit rate of the prompts of at most ShortPrompt
	// tokens: those prefix_aware hashes whole (PrefixLength characters
	// cover about 1,024 tokens), whose key changes with every turn.
	ShortHitRate float64 `json:"kv_hit_rate_short_prompts"`
	ShortPrompts int     `json:"short_prompts"`

	// Shares are each worker's fraction of completed requests (the decode
	// workers' on a disaggregated fleet).
	Shares   map[string]float64 `json:"worker_shares"`
	MinShare float64            `json:"min_share"`
	MaxShare float64            `json:"max_share"`
	Ideal    float64            `json:"ideal_share"`
	Spills   int                `json:"spills"`

	// DecisionP50us and DecisionP99us are the scheduler's routing decision
	// latency (baton_routing_decision_seconds), microseconds of wall time.
	// Virtual: the run was simulated on the virtual clock (bench/vsim),
	// which has no wall-clock figures.
	Virtual       bool    `json:"virtual,omitempty"`
	DecisionP50us float64 `json:"routing_decision_p50_us"`
	DecisionP99us float64 `json:"routing_decision_p99_us"`
	// DecisionCPUP50us and DecisionCPUP99us are the same decisions' CPU
	// time on their thread (baton_routing_decision_cpu_seconds): what the
	// decision cost, without the time it waited for a CPU. 0 when the
	// scheduler does not report it.
	DecisionCPUP50us float64 `json:"routing_decision_cpu_p50_us,omitempty"`
	DecisionCPUP99us float64 `json:"routing_decision_cpu_p99_us,omitempty"`
	// PartsUs are the p50 and p99 of each part of the routing profile
	// (baton_routing_part_seconds: its filters, each scorer, the picker),
	// microseconds of wall time, by part.
	PartsUs map[string][2]float64 `json:"routing_parts_us,omitempty"`
	// SyncLagMs is the p50 and p99 of the time from one replica's commit
	// of a decision to its application on another
	// (baton_replica_sync_lag_seconds, interpolated within its buckets),
	// wall milliseconds; zero when the replicas did not share.
	SyncLagMs [2]float64 `json:"replica_sync_lag_ms,omitzero"`
	// SyncUnseen is what the lag cost (baton_replica_sync_unseen_seconds):
	// the share of the decisions the replicas received that reached one
	// only after one of its picks that came after them, and the p50 and
	// p99 of how long before that pick they were made, wall milliseconds;
	// zero when none did.
	SyncUnseen [3]float64 `json:"replica_sync_unseen,omitzero"`

	// LagP99ms and LagMaxms are how late the load generator sent requests
	// (wall milliseconds).
	LagP99ms float64 `json:"send_lag_p99_ms"`
	LagMaxms float64 `json:"send_lag_max_ms"`
	// CPUStretch is the simulated engines' busy wall time over their
	// modelled step time: about 1 when the CPU keeps up.
	CPUStretch float64 `json:"cpu_stretch"`
	// Counters are the scheduler counters that moved during the run
	// (disaggregation decisions, fallbacks, breaker trips, cached tokens
	// by tier, ...), by name{labels}.
	Counters map[string]float64 `json:"scheduler_counters,omitempty"`
	Warnings []string           `json:"warnings,omitempty"`

	// TTFTs are every successful request's TTFT, for the CDF plot.
	TTFTs []float64 `json:"-"`
	// Results are the requests' outcomes, for Report.PerRequest.
	Results []Result `json:"-"`
}

// Report is a whole bench run.
type Report struct {
	Command     string   `json:"command"`
	Workload    string   `json:"workload"`
	Describe    string   `json:"workload_description"`
	Requests    int      `json:"requests"`
	Workers     int      `json:"workers"`
	Model       string   `json:"model"`
	GPU         string   `json:"gpu"`
	Target      string   `json:"target,omitempty"`
	Speedup     float64  `json:"speedup"`
	Rate        float64  `json:"rate"`
	OfferedRate float64  `json:"offered_rate"`
	Concurrency int      `json:"concurrency"`
	Seed        uint64   `json:"seed"`
	Fleets      []string `json:"fleets,omitempty"`
	SharedTier  bool     `json:"shared_tier"`
	// Calibration explains the rate, when it was derived from a target load.
	Calibration string           `json:"calibration,omitempty"`
	Limits      *Limits          `json:"limits,omitempty"`
	Strategies  []StrategyReport `json:"strategies"`
	// PerRequest makes WriteFiles write requests.jsonl as well.
	PerRequest bool `json:"-"`
}

// ShortPrompt is the prompt length, in tokens, up to which the report
// counts a prompt as short: prefix_aware's default 4,096-character prefix
// at about 4 characters per token.
const ShortPrompt = 1024

// summarize turns the results of one strategy into its report.
// workers is the fleet's count of token-streaming workers.
func summarize(strategy string, rs []Result, o *Options, workers int, wall float64) *StrategyReport {
	sc := o.Speedup
	r := &StrategyReport{Strategy: strategy, Requests: len(rs), Shares: map[string]float64{}, Results: rs}
	var ttft, itl, e2e, lags []float64
	var outTok, shortPrompt, shortCached int64
	first, last := math.Inf(1), 0.0
	counts := map[string]int{}
	for i := range rs {
		x := &rs[i]
		lags = append(lags, x.Lag*1e3)
		if x.Err != "" {
			r.Errors++
			if r.ErrorSample == "" {
				r.ErrorSample = x.Err
			}
			continue
		}
		r.OK++
		ttft = append(ttft, x.TTFT*sc)
		e2e = append(e2e, x.E2E*sc)
		for _, g := range x.Gaps {
			itl = append(itl, g*sc)
		}
		r.PromptTokens += int64(x.PromptTokens)
		r.CachedTokens += int64(x.CachedTokens)
		if x.PromptTokens <= ShortPrompt {
			shortPrompt += int64(x.PromptTokens)
			shortCached += int64(x.CachedTokens)
			r.ShortPrompts++
		}
		outTok += int64(x.CompletionTokens)
		if x.Spill {
			r.Spills++
		}
		counts[x.Worker]++
		first = min(first, x.Done-x.E2E)
		last = max(last, x.Done)
	}
	r.TTFT, r.ITL, r.E2E = quantiles(ttft), quantiles(itl), quantiles(e2e)
	r.TTFTs = ttft
	r.TTFTMean = mean(ttft)
	if r.OK > 0 && last > first {
		r.Duration = (last - first) * sc
		r.RequestsPerSec = float64(r.OK) / r.Duration
		r.OutputTokPerSec = float64(outTok) / r.Duration
	}
	r.HitRate = HitRate(r.CachedTokens, r.PromptTokens)
	r.ShortHitRate = HitRate(shortCached, shortPrompt)
	n := workers
	if o.Target != "" || n == 0 {
		n = max(len(counts), o.Workers)
	}
	if n > 0 {
		r.Ideal = 1 / float64(n)
	}
	r.MinShare = 1
	if len(counts) < n {
		r.MinShare = 0
	}
	for w, c := range counts {
		s := float64(c) / float64(max(r.OK, 1))
		r.Shares[w] = s
		r.MinShare = min(r.MinShare, s)
		r.MaxShare = max(r.MaxShare, s)
	}
	if r.OK == 0 {
		r.MinShare = 0
	}
	lq := quantiles(lags)
	r.LagP99ms = lq.P99
	r.LagMaxms = slices.Max(append(lags, 0))
	return r
}

// checkHealth adds warnings when the machine, not the modelled GPUs, may
// have shaped the numbers.
func (r *StrategyReport) checkHealth(o *Options) {
	if r.CPUStretch > 1.15 {
		r.Warnings = append(r.Warnings, fmt.Sprintf(
			"CPU-bound: the simulated engines' steps took %.0f%% longer in wall time than modelled; latencies are inflated — lower --speedup", (r.CPUStretch-1)*100))
	}
	// A send 50 ms (wall) late, or later than a tenth of the median
	// modelled TTFT in wall time, distorts the arrival process.
	limit := 50.0
	if !math.IsNaN(r.TTFT.P50) && r.TTFT.P50 > 0 {
		limit = min(limit, r.TTFT.P50/o.Speedup*1e3/10)
	}
	if o.Concurrency == 0 && r.LagP99ms > max(limit, 5) {
		r.Warnings = append(r.Warnings, fmt.Sprintf(
			"load generator lag: p99 %.1f ms (wall) behind schedule — the CPU cannot keep up with --speedup %g", r.LagP99ms, o.Speedup))
	}
	if r.Errors > 0 {
		r.Warnings = append(r.Warnings, fmt.Sprintf("%d of %d requests failed, e.g. %s", r.Errors, r.Requests, r.ErrorSample))
	}
}

func f1(v float64, scale float64, prec int) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	return strconv.FormatFloat(v*scale, 'f', prec, 64)
}

func pct(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	return fmt.Sprintf("%+.0f%%", v)
}

// row is one metric of the Markdown and CSV tables.
type row struct {
	name   string
	value  func(*StrategyReport) float64
	scale  float64
	prec   int
	change bool // report the change vs random
}

var rows = []row{
	{"TTFT p50 (ms)", func(r *StrategyReport) float64 { return r.TTFT.P50 }, 1e3, 0, true},
	{"TTFT p90 (ms)", func(r *StrategyReport) float64 { return r.TTFT.P90 }, 1e3, 0, true},
	{"TTFT p99 (ms)", func(r *StrategyReport) float64 { return r.TTFT.P99 }, 1e3, 0, true},
	{"TTFT mean (ms)", func(r *StrategyReport) float64 { return r.TTFTMean }, 1e3, 0, true},
	{"ITL p50 (ms)", func(r *StrategyReport) float64 { return r.ITL.P50 }, 1e3, 1, true},
	{"ITL p90 (ms)", func(r *StrategyReport) float64 { return r.ITL.P90 }, 1e3, 1, true},
	{"E2E p50 (s)", func(r *StrategyReport) float64 { return r.E2E.P50 }, 1, 2, true},
	{"E2E p90 (s)", func(r *StrategyReport) float64 { return r.E2E.P90 }, 1, 2, true},
	{"E2E p99 (s)", func(r *StrategyReport) float64 { return r.E2E.P99 }, 1, 2, true},
	{"throughput (req/s)", func(r *StrategyReport) float64 { return r.RequestsPerSec }, 1, 2, true},
	{"output tokens/s", func(r *StrategyReport) float64 { return r.OutputTokPerSec }, 1, 0, true},
	{"KV hit rate (%)", func(r *StrategyReport) float64 { return r.HitRate }, 100, 1, true},
	{"KV hit rate, prompts ≤ 1,024 tok (%)", func(r *StrategyReport) float64 {
		if r.ShortPrompts == 0 {
			return math.NaN()
		}
		return r.ShortHitRate
	}, 100, 1, true},
	{"min worker share (%)", func(r *StrategyReport) float64 { return r.MinShare }, 100, 1, false},
	{"max worker share (%)", func(r *StrategyReport) float64 { return r.MaxShare }, 100, 1, false},
	{"overflow spills", func(r *StrategyReport) float64 { return float64(r.Spills) }, 1, 0, false},
	{"requests ok", func(r *StrategyReport) float64 { return float64(r.OK) }, 1, 0, false},
	{"errors", func(r *StrategyReport) float64 { return float64(r.Errors) }, 1, 0, false},
	{"routing decision p50 (µs)", func(r *StrategyReport) float64 { return wall(r, r.DecisionP50us) }, 1, 2, false},
	{"routing decision p99 (µs)", func(r *StrategyReport) float64 { return wall(r, r.DecisionP99us) }, 1, 2, false},
	{"routing decision thread CPU p50 (µs)", func(r *StrategyReport) float64 { return measured(r, r.DecisionCPUP50us) }, 1, 2, false},
	{"routing decision thread CPU p99 (µs)", func(r *StrategyReport) float64 { return measured(r, r.DecisionCPUP99us) }, 1, 2, false},
	{"send lag p99 (wall ms)", func(r *StrategyReport) float64 { return wall(r, r.LagP99ms) }, 1, 1, false},
	{"CPU stretch (wall/modelled)", func(r *StrategyReport) float64 {
		if r.CPUStretch == 0 {
			return math.NaN()
		}
		return r.CPUStretch
	}, 1, 2, false},
}

// wall is v, a wall-clock figure, or NaN (shown as –) for a run on the
// virtual clock, which has none.
func wall(r *StrategyReport, v float64) float64 {
	if r.Virtual {
		return math.NaN()
	}
	return v
}

// measured is wall(r, v), or NaN where v is 0 or NaN (not reported).
func measured(r *StrategyReport, v float64) float64 {
	if v == 0 || math.IsNaN(v) {
		return math.NaN()
	}
	return wall(r, v)
}

func (rep *Report) base() *StrategyReport {
	for i := range rep.Strategies {
		if rep.Strategies[i].Strategy == "random" {
			return &rep.Strategies[i]
		}
	}
	return nil
}

// Markdown writes the report as Markdown tables.
func (rep *Report) Markdown(w io.Writer) {
	fmt.Fprintf(w, "### baton bench: %s\n\n", rep.Workload)
	if rep.Command != "" {
		fmt.Fprintf(w, "`%s`\n\n", rep.Command)
	}
	fleet := fmt.Sprintf("%d simulated workers (%s on %s), fresh and cold per strategy", rep.Workers, rep.Model, rep.GPU)
	if len(rep.Fleets) > 1 || (len(rep.Fleets) == 1 && rep.Fleets[0] != fmt.Sprintf("%d colocated", rep.Workers)) {
		fleet = fmt.Sprintf("simulated fleets %s (%s on %s), fresh and cold per column; a disagg:P:D column ran on P prefill and D decode workers, its worker shares are over the decode workers",
			strings.Join(rep.Fleets, "; "), rep.Model, rep.GPU)
	}
	if rep.SharedTier {
		fleet += "; the workers of each fleet share an in-process KV tier (--shared-tier)"
	}
	if rep.Target != "" {
		fleet = "target " + rep.Target
	}
	offered := fmt.Sprintf("offered %.2f req/s (modelled)", rep.OfferedRate)
	if rep.OfferedRate == 0 {
		offered = "all offered at once" // every arrival at 0: no rate
	}
	fmt.Fprintf(w, "%s; %d requests: %s; %s; speedup %g; seed %d.",
		fleet, rep.Requests, rep.Describe, offered, rep.Speedup, rep.Seed)
	if rep.Concurrency > 0 {
		fmt.Fprintf(w, " Concurrency cap %d.", rep.Concurrency)
	}
	fmt.Fprintln(w, " Latencies and rates in modelled time.")
	if rep.Calibration != "" {
		fmt.Fprintf(w, "\n%s\n", rep.Calibration)
	}
	fmt.Fprintln(w)
	base := rep.base()
	hdr := "| metric |"
	sep := "|---|"
	for _, s := range rep.Strategies {
		hdr += " " + s.Strategy + " |"
		sep += "---:|"
		if base != nil && s.Strategy != "random" {
			hdr += " vs random |"
			sep += "---:|"
		}
	}
	fmt.Fprintln(w, hdr)
	fmt.Fprintln(w, sep)
	for _, rw := range rows {
		line := "| " + rw.name + " |"
		for i := range rep.Strategies {
			s := &rep.Strategies[i]
			line += " " + f1(rw.value(s), rw.scale, rw.prec) + " |"
			if base != nil && s.Strategy != "random" {
				c := "|"
				if rw.change {
					if strings.HasPrefix(rw.name, "KV hit rate") {
						c = " – |"
						if d := (rw.value(s) - rw.value(base)) * 100; !math.IsNaN(d) {
							c = fmt.Sprintf(" %+.1f pp |", d)
						}
					} else {
						c = " " + pct(Change(rw.value(s), rw.value(base))) + " |"
					}
				}
				line += c
			}
		}
		fmt.Fprintln(w, line)
	}
	if rep.Limits != nil {
		fmt.Fprintf(w, "\n%s\n", rep.Limits.Sentence())
	}
	for _, s := range rep.Strategies {
		if len(s.Counters) == 0 {
			continue
		}
		keys := slices.Sorted(maps.Keys(s.Counters))
		var parts []string
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, s.Counters[k]))
		}
		fmt.Fprintf(w, "\nScheduler counters (%s): %s.\n", s.Strategy, strings.Join(parts, "; "))
	}
	for _, s := range rep.Strategies {
		if len(s.PartsUs) == 0 {
			continue
		}
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(s.PartsUs)) {
			q := s.PartsUs[k]
			parts = append(parts, fmt.Sprintf("%s %.1f / %.1f", k, q[0], q[1]))
		}
		fmt.Fprintf(w, "\nRouting parts (%s), p50 / p99 µs: %s.\n", s.Strategy, strings.Join(parts, "; "))
	}
	for _, s := range rep.Strategies {
		if s.SyncLagMs != [2]float64{} {
			fmt.Fprintf(w, "\nReplica sharing lag (%s), from a decision's commit to its application on another replica, p50 / p99 ms: %.2f / %.2f.\n",
				s.Strategy, s.SyncLagMs[0], s.SyncLagMs[1])
		}
		if s.SyncUnseen != [3]float64{} {
			fmt.Fprintf(w, "\nReplica decisions unseen by a pick (%s): %.1f%% of the decisions received reached a replica only after one of its picks that came after them, made p50 / p99 ms before it: %.3f / %.3f.\n",
				s.Strategy, 100*s.SyncUnseen[0], s.SyncUnseen[1], s.SyncUnseen[2])
		}
	}
	for _, s := range rep.Strategies {
		for _, wr := range s.Warnings {
			fmt.Fprintf(w, "\n**Warning (%s):** %s\n", s.Strategy, wr)
		}
	}
}

// WriteFiles writes report.md, report.json, summary.csv, with PerRequest
// requests.jsonl (one line per request of each column: its Result and the
// column), and the plots into dir.
func (rep *Report) WriteFiles(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var files []string
	var md strings.Builder
	rep.Markdown(&md)
	p := filepath.Join(dir, "report.md")
	if err := os.WriteFile(p, []byte(md.String()), 0o644); err != nil {
		return nil, err
	}
	files = append(files, p)

	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return nil, err
	}
	p = filepath.Join(dir, "report.json")
	if err := os.WriteFile(p, append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	files = append(files, p)

	p = filepath.Join(dir, "summary.csv")
	fh, err := os.Create(p)
	if err != nil {
		return nil, err
	}
	cw := csv.NewWriter(fh)
	head := []string{"strategy"}
	for _, rw := range rows {
		head = append(head, rw.name)
	}
	cw.Write(head)
	for i := range rep.Strategies {
		s := &rep.Strategies[i]
		rec := []string{s.Strategy}
		for _, rw := range rows {
			rec = append(rec, f1(rw.value(s), rw.scale, rw.prec+2))
		}
		cw.Write(rec)
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		fh.Close()
		return nil, err
	}
	if err := fh.Close(); err != nil {
		return nil, err
	}
	files = append(files, p)

	if rep.PerRequest {
		p = filepath.Join(dir, "requests.jsonl")
		if err := rep.writeRequests(p); err != nil {
			return files, err
		}
		files = append(files, p)
	}

	pl, err := rep.Plots(dir)
	if err != nil {
		return files, err
	}
	return append(files, pl...), nil
}

// Summarize is the report of one strategy's results rs, in modelled
// seconds, on a fleet of workers token-streaming workers: the bench's
// statistics for runs it did not make (bench/vsim's).
func Summarize(strategy string, rs []Result, workers int) *StrategyReport {
	o := Options{Speedup: 1, Workers: workers}
	return summarize(strategy, rs, &o, workers, 0)
}

// writeRequests writes every column's requests to path as JSON lines.
func (rep *Report) writeRequests(path string) error {
	fh, err := os.Create(path)
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(fh)
	enc := json.NewEncoder(bw)
	for i := range rep.Strategies {
		s := &rep.Strategies[i]
		for _, r := range s.Results {
			line := struct {
				Column string `json:"column"`
				Result
			}{s.Strategy, r}
			if err := enc.Encode(&line); err != nil {
				fh.Close()
				return err
			}
		}
	}
	if err := bw.Flush(); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

// mean is xs's mean, NaN for none.
func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	var sum float64
	for _, x := range xs {
		sum += x
	}
	return sum / float64(len(xs))
}
