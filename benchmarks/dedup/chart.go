package main

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Chart draws the throughput of every strategy at concurrency c as grouped
// bars, one group per strategy and one bar per duplicate ratio, each bar
// labelled with its msgs/s, and saves it as a PNG at path.
func Chart(path string, rs []SpeedResult, c int) error {
	var dupPcts []int
	for _, r := range rs {
		if r.Concurrency == c {
			dupPcts = append(dupPcts, r.DupPct)
		}
	}
	dupPcts = distinctInts(dupPcts)
	if len(dupPcts) == 0 {
		return fmt.Errorf("no speed results at concurrency %d", c)
	}
	names := reportOrder(rs)

	p := plot.New()
	p.Title.Text = fmt.Sprintf("Deduplication strategies: throughput by duplicate ratio, %d workers (higher is better)", c)
	p.Title.TextStyle.Font.Size = vg.Points(14)
	p.Y.Label.Text = "messages / s"
	p.Y.Min = 0
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs = vg.Points(12)
	p.Legend.TextStyle.Font.Size = vg.Points(11)
	p.Add(plotter.NewGrid())

	var all []float64
	for _, d := range dupPcts {
		for _, n := range names {
			if r, ok := findSpeed(rs, n, d, c); ok {
				all = append(all, r.MsgsPerSec)
			}
		}
	}
	top := axisTop(all)
	if top < slices.Max(all) {
		p.Y.Label.Text = "messages / s (\"cut\": the bar is taller than the axis)"
	}

	width := vg.Points(16)
	for i, d := range dupPcts {
		vals := make(plotter.Values, len(names))
		labels := plotter.XYLabels{XYs: make(plotter.XYs, len(names)), Labels: make([]string, len(names))}
		for j, n := range names {
			v := 0.0
			if r, ok := findSpeed(rs, n, d, c); ok {
				v = r.MsgsPerSec
			}
			vals[j] = math.Min(v, top)
			labels.XYs[j] = plotter.XY{X: float64(j), Y: vals[j]}
			labels.Labels[j] = kilo(v)
			if v > top {
				labels.Labels[j] += " (cut)"
			}
		}
		bars, err := plotter.NewBarChart(vals, width)
		if err != nil {
			return fmt.Errorf("bars: %w", err)
		}
		offset := width * vg.Length(float64(i)-float64(len(dupPcts)-1)/2)
		bars.Offset = offset
		bars.Color = plotutil.Color(i)
		bars.LineStyle.Width = 0
		p.Add(bars)
		p.Legend.Add(fmt.Sprintf("%d%% duplicates", d), bars)

		lab, err := plotter.NewLabels(labels)
		if err != nil {
			return fmt.Errorf("labels: %w", err)
		}
		for k := range lab.TextStyle {
			lab.TextStyle[k].Font.Size = vg.Points(8)
			lab.TextStyle[k].Rotation = math.Pi / 2
			lab.TextStyle[k].XAlign = draw.XLeft
			lab.TextStyle[k].YAlign = draw.YCenter
		}
		lab.Offset = vg.Point{X: offset, Y: vg.Points(3)}
		p.Add(lab)
	}
	p.Y.Max = top * 1.18 // room for the labels above the tallest bars
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.6, float64(len(names))-0.4 // room for the outer bars
	p.X.Tick.Label.Font.Size = vg.Points(10)
	p.X.Tick.Label.Rotation = math.Pi / 12
	p.X.Tick.Label.XAlign = draw.XRight
	p.X.Tick.Label.YAlign = draw.YTop
	if err := p.Save(15*vg.Inch, 7*vg.Inch, path); err != nil {
		return fmt.Errorf("save chart: %w", err)
	}
	return nil
}

// axisTop is where the Y axis ends: at the largest value, unless the
// largest values are outliers (each more than twice the next), which are
// cut at the first value that is not.
func axisTop(vals []float64) float64 {
	sorted := slices.Clone(vals)
	slices.SortFunc(sorted, func(a, b float64) int { return cmp.Compare(b, a) })
	if len(sorted) == 0 {
		return 1
	}
	top := sorted[0]
	for i := 0; i+1 < len(sorted) && sorted[i] > 2*sorted[i+1]; i++ {
		top = sorted[i+1]
	}
	return math.Max(top, 1)
}

// kilo formats a rate compactly: 950, 12.3k.
func kilo(v float64) string {
	if v >= 1000 {
		return fmt.Sprintf("%.1fk", v/1000)
	}
	return fmt.Sprintf("%.0f", v)
}
