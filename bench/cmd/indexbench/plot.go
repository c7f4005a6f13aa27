package main

import (
	"fmt"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// plots writes, per index kind, achieved against offered ops/s
// (index_<kind>_throughput.png) and the query p99 against offered ops/s
// (index_<kind>_latency.png), one line per fleet size and block count.
func plots(dir string, all []result) ([]string, error) {
	var files []string
	kinds := []string{}
	for _, r := range all {
		if !slices.Contains(kinds, r.kind) {
			kinds = append(kinds, r.kind)
		}
	}
	for _, kind := range kinds {
		for _, fig := range []struct {
			name, y string
			val     func(s step) float64
		}{
			{"throughput", "achieved (ops/s)", func(s step) float64 { return s.achieved }},
			{"latency", "query p99 (µs)", func(s step) float64 { return us(s.q99) }},
		} {
			p := plot.New()
			p.Title.Text = fmt.Sprintf("KV index (%s): %s against offered load", kind, fig.y)
			p.X.Label.Text = "offered (ops/s)"
			p.Y.Label.Text = fig.y
			p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
			p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
			i := 0
			lo, hi := 0.0, 0.0
			for _, r := range all {
				if r.kind != kind || len(r.steps) == 0 {
					continue
				}
				pts := make(plotter.XYs, 0, len(r.steps))
				for _, s := range r.steps {
					if v := fig.val(s); v > 0 {
						pts = append(pts, plotter.XY{X: s.offered, Y: v})
					}
					if lo == 0 || s.offered < lo {
						lo = s.offered
					}
					hi = max(hi, s.offered)
				}
				if len(pts) == 0 {
					continue
				}
				l, sc, err := plotter.NewLinePoints(pts)
				if err != nil {
					return files, err
				}
				l.Color, sc.Color = plotutil.Color(i), plotutil.Color(i)
				l.Dashes = plotutil.Dashes(i / 7)
				sc.Shape = plotutil.Shape(i)
				p.Add(l, sc)
				p.Legend.Add(fmt.Sprintf("W=%d, %s blocks", r.workers, si(float64(r.target))), l, sc)
				i++
			}
			// Ticks at the offered rates, which double from the first.
			var ticks []plot.Tick
			for r := lo; r > 0 && r <= hi*1.01; r *= 2 {
				ticks = append(ticks, plot.Tick{Value: r, Label: si(r)})
			}
			p.X.Tick.Marker = plot.ConstantTicks(ticks)
			if fig.name == "throughput" && hi > 0 {
				ideal, err := plotter.NewLine(plotter.XYs{{X: lo, Y: lo}, {X: hi, Y: hi}})
				if err != nil {
					return files, err
				}
				ideal.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
				p.Add(ideal)
				p.Legend.Add("achieved = offered", ideal)
			}
			p.Legend.Top, p.Legend.Left = true, true
			p.Add(plotter.NewGrid())
			path := filepath.Join(dir, fmt.Sprintf("index_%s_%s.png", kind, fig.name))
			if err := p.Save(8*vg.Inch, 5*vg.Inch, path); err != nil {
				return files, err
			}
			files = append(files, path)
		}
	}
	return files, nil
}
