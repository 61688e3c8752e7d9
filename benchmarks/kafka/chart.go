package main

import (
	"fmt"
	"math"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// chartName is a subscriber's name under its bars.
func chartName(sys string, cfg Config) string {
	switch sys {
	case sysStock:
		return "watermill-kafka (stock)"
	case sysSerial:
		return "oncemill, 1 in flight"
	case sysParallel:
		return fmt.Sprintf("oncemill key-parallel (%d)", cfg.maxInFlight())
	case sysPipelined:
		return fmt.Sprintf("key-parallel (%d), pipelined", cfg.maxInFlight())
	case sysBatched:
		return fmt.Sprintf("key-parallel (%d), batched", cfg.maxInFlight())
	case sysBatchHandler:
		return fmt.Sprintf("key-parallel (%d), batch handler", cfg.maxInFlight())
	case sysNoInbox:
		return fmt.Sprintf("key-parallel (%d), no inbox", cfg.maxInFlight())
	}
	return sys
}

// Chart draws the median throughput of every subscriber as grouped bars,
// one group per subscriber and one bar per partition count, each labelled
// with its msgs/s, and saves it as a PNG at path.
func Chart(path string, rows []Row, cfg Config) error {
	var names, syss []string
	for _, sys := range cfg.systems() {
		for _, r := range rows {
			if r.System == sys {
				names, syss = append(names, chartName(sys, cfg)), append(syss, sys)
				break
			}
		}
	}
	if len(syss) == 0 {
		return fmt.Errorf("no results to chart")
	}

	p := plot.New()
	p.Title.Text = "Kafka → inbox → PostgreSQL: consumer throughput, median msgs/s (higher is better)"
	p.Title.TextStyle.Font.Size = vg.Points(14)
	p.Y.Label.Text = "messages / s"
	p.Y.Min = 0
	p.Y.Tick.Marker = intTicks{}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs = vg.Points(12)
	p.Legend.YOffs = -vg.Points(12)
	p.Legend.TextStyle.Font.Size = vg.Points(11)
	p.Add(plotter.NewGrid())

	top := 1.0
	for _, r := range rows {
		top = math.Max(top, r.MsgsPerSec)
	}
	width := vg.Points(28)
	for i, parts := range cfg.Partitions {
		vals := make(plotter.Values, len(syss))
		labels := plotter.XYLabels{XYs: make(plotter.XYs, len(syss)), Labels: make([]string, len(syss))}
		for j, sys := range syss {
			v := 0.0
			if r, ok := findRow(rows, sys, parts); ok {
				v = r.MsgsPerSec
			}
			vals[j] = v
			labels.XYs[j] = plotter.XY{X: float64(j), Y: v}
			labels.Labels[j] = kilo(v)
		}
		bars, err := plotter.NewBarChart(vals, width)
		if err != nil {
			return fmt.Errorf("bars: %w", err)
		}
		offset := width * vg.Length(float64(i)-float64(len(cfg.Partitions)-1)/2)
		bars.Offset = offset
		bars.Color = plotutil.Color(i)
		bars.LineStyle.Width = 0
		p.Add(bars)
		p.Legend.Add(fmt.Sprintf("%d partition%s", parts, plural(parts)), bars)

		lab, err := plotter.NewLabels(labels)
		if err != nil {
			return fmt.Errorf("labels: %w", err)
		}
		for k := range lab.TextStyle {
			lab.TextStyle[k].Font.Size = vg.Points(10)
			lab.TextStyle[k].XAlign = draw.XCenter
			lab.TextStyle[k].YAlign = draw.YBottom
		}
		lab.Offset = vg.Point{X: offset, Y: vg.Points(3)}
		p.Add(lab)
	}
	p.Y.Max = top * 1.15 // room for the labels above the tallest bars
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.6, float64(len(names))-0.4
	p.X.Tick.Label.Font.Size = vg.Points(11)
	if err := p.Save(12*vg.Inch, 6*vg.Inch, path); err != nil {
		return fmt.Errorf("save chart: %w", err)
	}
	return nil
}

// intTicks are gonum's default ticks labelled as whole numbers.
type intTicks struct{}

// Ticks returns the default ticks between lo and hi with integer labels.
func (intTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', 0, 64)
		}
	}
	return ts
}

// kilo formats a rate compactly: 950, 12.3k.
func kilo(v float64) string {
	if v >= 1000 {
		return fmt.Sprintf("%.1fk", v/1000)
	}
	return fmt.Sprintf("%.0f", v)
}
