package bench

import (
	"cmp"
	"maps"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// maxWorkerBars is the most workers the share plot draws a bar each for.
const maxWorkerBars = 64

// Plots writes ttft_cdf.png, worker_share.png and hit_rate.png into dir.
func (rep *Report) Plots(dir string) ([]string, error) {
	var files []string
	save := func(p *plot.Plot, name string) error {
		path := filepath.Join(dir, name)
		if err := p.Save(8*vg.Inch, 5*vg.Inch, path); err != nil {
			return err
		}
		files = append(files, path)
		return nil
	}

	// TTFT CDF per strategy.
	p := plot.New()
	p.Title.Text = "TTFT CDF (" + rep.Workload + ")"
	p.X.Label.Text = "time to first token (ms, modelled)"
	p.Y.Label.Text = "fraction of requests"
	for i := range rep.Strategies {
		s := &rep.Strategies[i]
		xs := slices.Clone(s.TTFTs)
		slices.Sort(xs)
		pts := make(plotter.XYs, len(xs))
		for j, x := range xs {
			pts[j] = plotter.XY{X: x * 1e3, Y: float64(j+1) / float64(len(xs))}
		}
		if len(pts) == 0 {
			continue
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return files, err
		}
		l.Color = plotutil.Color(i)
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(s.Strategy, l)
	}
	p.Legend.Top, p.Legend.Left = false, false
	p.Add(plotter.NewGrid())
	if err := save(p, "ttft_cdf.png"); err != nil {
		return files, err
	}

	// Per-worker share, grouped by strategy.
	var names []string
	for _, s := range rep.Strategies {
		for w := range s.Shares {
			if !slices.Contains(names, w) {
				names = append(names, w)
			}
		}
	}
	slices.Sort(names)
	p = plot.New()
	p.Title.Text = "Share of requests per worker"
	p.Y.Label.Text = "share (%)"
	if len(names) > maxWorkerBars {
		// Too many workers for a bar each: each strategy's shares from
		// the largest down, a line.
		p.X.Label.Text = "workers, from the busiest"
		for i, s := range rep.Strategies {
			shares := slices.Collect(maps.Values(s.Shares))
			for len(shares) < rep.Workers { // those that served nothing
				shares = append(shares, 0)
			}
			slices.SortFunc(shares, func(a, b float64) int { return cmp.Compare(b, a) })
			xys := make(plotter.XYs, len(shares))
			for j, v := range shares {
				xys[j] = plotter.XY{X: float64(j), Y: v * 100}
			}
			l, err := plotter.NewLine(xys)
			if err != nil {
				return files, err
			}
			l.Color = plotutil.Color(i)
			p.Add(l)
			p.Legend.Add(s.Strategy, l)
		}
		if len(rep.Strategies) > 0 && rep.Strategies[0].Ideal > 0 {
			ideal := rep.Strategies[0].Ideal * 100
			if l, err := plotter.NewLine(plotter.XYs{{X: 0, Y: ideal}, {X: float64(max(len(names), rep.Workers) - 1), Y: ideal}}); err == nil {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
				p.Add(l)
				p.Legend.Add("ideal 1/N", l)
			}
		}
		p.Legend.Top = true
	} else {
		width := vg.Points(min(60, 300/float64(max(len(names), 1))) / float64(max(len(rep.Strategies), 1)))
		for i, s := range rep.Strategies {
			vals := make(plotter.Values, len(names))
			for j, w := range names {
				vals[j] = s.Shares[w] * 100
			}
			b, err := plotter.NewBarChart(vals, width)
			if err != nil {
				return files, err
			}
			b.Color = plotutil.Color(i)
			b.LineStyle.Width = 0
			b.Offset = vg.Length(float64(i)-float64(len(rep.Strategies)-1)/2) * width
			p.Add(b)
			p.Legend.Add(s.Strategy, b)
		}
		if len(rep.Strategies) > 0 && rep.Strategies[0].Ideal > 0 {
			ideal := rep.Strategies[0].Ideal * 100
			l, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: ideal}, {X: float64(len(names)) - 0.5, Y: ideal}})
			if err == nil {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
				p.Add(l)
				p.Legend.Add("ideal 1/N", l)
			}
		}
		p.NominalX(names...)
		p.Legend.Top = true
	}
	if err := save(p, "worker_share.png"); err != nil {
		return files, err
	}

	// Hit rate per strategy against the limits.
	p = plot.New()
	p.Title.Text = "KV hit rate against the bounds"
	p.Y.Label.Text = "cached / prompt tokens (%)"
	var labels []string
	vals := plotter.Values{}
	for _, s := range rep.Strategies {
		labels = append(labels, s.Strategy)
		vals = append(vals, s.HitRate*100)
	}
	if rep.Limits != nil {
		labels = append(labels, "pooled LRU (ref.)", "MIN bound", "infinite")
		vals = append(vals, rep.Limits.Pooled*100, rep.Limits.Belady*100, rep.Limits.Infinite*100)
	}
	if len(vals) > 0 {
		b, err := plotter.NewBarChart(vals, vg.Points(40))
		if err != nil {
			return files, err
		}
		b.Color = plotutil.Color(0)
		p.Add(b)
		p.NominalX(labels...)
	}
	p.Y.Min, p.Y.Max = 0, 100
	if err := save(p, "hit_rate.png"); err != nil {
		return files, err
	}
	return files, nil
}
