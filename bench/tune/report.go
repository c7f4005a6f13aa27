package tune

import (
	"cmp"
	"encoding/csv"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/batonllm/baton/bench/vsim"
	"github.com/batonllm/baton/scheduler/routing"
)

// Markdown writes the report: the targets, the best configuration as a
// config snippet, the goodput against GPUs, and every candidate.
func (r *Report) Markdown(w io.Writer) {
	o := r.Options
	fmt.Fprintf(w, "# baton tune\n\n")
	if r.Command != "" {
		fmt.Fprintf(w, "`%s`\n\n", r.Command)
	}
	fmt.Fprintf(w, "%s; %d requests, offered %.2f req/s (modelled); %s on %s; seed %d. Targets: TTFT p90 ≤ %v, ITL p90 ≤ %v. "+
		"Goodput is the requests per modelled second whose TTFT and whose own ITL p90 meet the targets; a configuration meets the targets when the fleet's p90s do. "+
		"%d configurations simulated on the virtual clock (bench/vsim), %d events in %.1f s.\n\n",
		r.Describe, r.Requests, r.OfferedRate, cmp.Or(o.Base.Model, "llama-3.1-8b"), cmp.Or(o.Base.GPU, "h100"), o.Base.Seed,
		o.SLOTTFT, o.SLOITL, len(r.Candidates), r.Events, r.Elapsed.Seconds())
	b := r.Best
	fmt.Fprintf(w, "## Best on %d GPUs\n\n%s: goodput %.2f req/s (%.1f%% of requests), TTFT p50/p90 %.0f/%.0f ms, ITL p90 %.1f ms, hit rate %.1f%%; targets %s.\n\n```yaml\n%s```\n\n",
		b.Config.GPUs(), b.Config.Label(), b.Goodput, b.Attainment*100, b.TTFTP50*1e3, b.TTFTP90*1e3, b.ITLP90*1e3, b.HitRate*100,
		map[bool]string{true: "met", false: "NOT met"}[b.MeetsSLO], r.YAML())
	fmt.Fprintf(w, "## Goodput against GPUs (the best routing above)\n\n| GPUs | fleet | goodput (req/s) | meets targets | TTFT p90 (ms) | ITL p90 (ms) |\n|---:|---|---:|---|---:|---:|\n")
	for _, c := range r.ByGPUs {
		fmt.Fprintf(w, "| %d | %s | %.2f | %s | %.0f | %.1f |\n", c.Config.GPUs(), c.Config.Label(), c.Goodput, yesNo(c.MeetsSLO), c.TTFTP90*1e3, c.ITLP90*1e3)
	}
	fmt.Fprintf(w, "\n## Every configuration, best first\n\n| configuration | stage | GPUs | goodput (req/s) | attained (%%) | meets targets | TTFT p50 (ms) | TTFT p90 (ms) | ITL p90 (ms) | hit rate (%%) | throughput (req/s) | errors |\n|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|\n")
	for _, c := range r.Candidates {
		fmt.Fprintf(w, "| %s | %s | %d | %.2f | %.1f | %s | %.0f | %.0f | %.1f | %.1f | %.2f | %d |\n", c.Config.Label(), c.Stage, c.Config.GPUs(),
			c.Goodput, c.Attainment*100, yesNo(c.MeetsSLO), c.TTFTP50*1e3, c.TTFTP90*1e3, c.ITLP90*1e3, c.HitRate*100, c.Throughput, c.Errors)
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// CSV writes one row per candidate, best first.
func (r *Report) CSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	cw.Write([]string{"configuration", "stage", "gpus", "workers", "prefill", "decode", "strategy", "concurrency_threshold",
		"min_remote_prefill_tokens", "goodput_rps", "attainment", "meets_slo", "ttft_p50_s", "ttft_p90_s", "itl_p90_s",
		"hit_rate", "throughput_rps", "errors", "events", "wall_s"})
	f := func(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }
	for _, c := range r.Candidates {
		k := c.Config
		cw.Write([]string{k.Label(), c.Stage, strconv.Itoa(k.GPUs()), strconv.Itoa(k.Workers), strconv.Itoa(k.Prefill),
			strconv.Itoa(k.Decode), k.Strategy, strconv.Itoa(k.ConcurrencyThreshold), strconv.Itoa(k.MinRemotePrefillTokens),
			f(c.Goodput), f(c.Attainment), strconv.FormatBool(c.MeetsSLO), f(c.TTFTP50), f(c.TTFTP90), f(c.ITLP90),
			f(c.HitRate), f(c.Throughput), strconv.Itoa(c.Errors), strconv.FormatInt(c.Events, 10), f(c.Wall.Seconds())})
	}
	cw.Flush()
	return cw.Error()
}

// YAML is the best configuration as a snippet of baton serve's config:
// the routing, and the workers by role (addresses to fill in).
func (r *Report) YAML() string {
	return Snippet(r.Best.Config)
}

// Snippet renders c as a baton serve config snippet.
func Snippet(c vsim.Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s (baton tune)\nstrategy: %s\n", c.Label(), c.Strategy)
	if c.Strategy == routing.PrefixAware || c.Strategy == routing.KVAware {
		fmt.Fprintf(&b, "concurrency_threshold: %d\n", c.ConcurrencyThreshold)
	}
	if c.Disaggregated() {
		fmt.Fprintf(&b, "disaggregation:\n  decode_strategy: %s\n  min_remote_prefill_tokens: %d\n", cmp.Or(c.DecodeStrategy, routing.LeastOutstanding), c.MinRemotePrefillTokens)
	}
	b.WriteString("workers:\n")
	add := func(role string, n int) {
		for i := range n {
			fmt.Fprintf(&b, "  - name: %s-%d\n    address: %s-%d:50051  # your worker's address\n    role: %s\n", role, i, role, i, role)
		}
	}
	add("both", c.Workers)
	add("prefill", c.Prefill)
	add("decode", c.Decode)
	return b.String()
}

// Plot writes goodput.png: the best goodput at each fleet size, colocated
// and disaggregated, against the offered rate.
func (r *Report) Plot(path string) error {
	p := plot.New()
	p.Title.Text = "Goodput against GPUs (" + r.Workload + ")"
	p.X.Label.Text = "GPUs"
	p.Y.Label.Text = "goodput (requests/s meeting both targets)"
	series := []struct {
		name string
		keep func(vsim.Config) bool
	}{
		{"best", func(vsim.Config) bool { return true }},
		{"colocated", func(c vsim.Config) bool { return !c.Disaggregated() }},
		{"disaggregated", func(c vsim.Config) bool { return c.Disaggregated() }},
	}
	for i, s := range series {
		var pts plotter.XYs
		for _, g := range r.Options.GPUCounts {
			best := -1.0
			for _, c := range r.Candidates {
				if c.Config.GPUs() == g && sameRouting(c.Config, r.Routing) && s.keep(c.Config) {
					best = max(best, c.Goodput)
				}
			}
			if best >= 0 {
				pts = append(pts, plotter.XY{X: float64(g), Y: best})
			}
		}
		if len(pts) == 0 {
			continue
		}
		l, sc, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		l.Color, sc.Color = plotutil.Color(i), plotutil.Color(i)
		if i == 0 {
			l.Width = vg.Points(2.5)
		}
		p.Add(l, sc)
		p.Legend.Add(s.name, l, sc)
	}
	if r.OfferedRate > 0 && len(r.Options.GPUCounts) > 0 {
		lo, hi := float64(r.Options.GPUCounts[0]), float64(r.Options.GPUCounts[len(r.Options.GPUCounts)-1])
		l, err := plotter.NewLine(plotter.XYs{{X: lo, Y: r.OfferedRate}, {X: hi, Y: r.OfferedRate}})
		if err != nil {
			return err
		}
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(4)}
		p.Add(l)
		p.Legend.Add("offered", l)
	}
	p.Legend.Top, p.Legend.Left = false, false
	p.Y.Min = 0
	p.Y.Max = max(p.Y.Max, r.OfferedRate) * 1.1
	p.Add(plotter.NewGrid())
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

// WriteFiles writes report.md, candidates.csv, best.yaml and goodput.png
// into dir and returns their paths.
func (r *Report) WriteFiles(dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var files []string
	write := func(name string, fn func(io.Writer) error) error {
		path := filepath.Join(dir, name)
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		if err := fn(f); err != nil {
			f.Close()
			return err
		}
		files = append(files, path)
		return f.Close()
	}
	if err := write("report.md", func(w io.Writer) error { r.Markdown(w); return nil }); err != nil {
		return files, err
	}
	if err := write("candidates.csv", r.CSV); err != nil {
		return files, err
	}
	if err := write("best.yaml", func(w io.Writer) error { _, err := io.WriteString(w, r.YAML()); return err }); err != nil {
		return files, err
	}
	path := filepath.Join(dir, "goodput.png")
	if err := r.Plot(path); err != nil {
		return files, err
	}
	return append(files, path), nil
}
