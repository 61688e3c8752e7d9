package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

// Results is everything one benchmark run measured.
type Results struct {
	// ServerVersion names the NATS server measured against.
	ServerVersion string
	// Conns is the pool's size.
	Conns int
	// Samples are the single runs, in the order they ran; Rows aggregate
	// them per kind and subscriber, in report order.
	Samples []Sample
	Rows    []Row
}

// Row is one subscriber in one kind of run over its repetitions.
type Row struct {
	System, Kind string
	Reps         int
	// MsgsPerSec is the median over the repetitions, Min and Max the
	// range; RatioStock is MsgsPerSec over watermill-nats's (pkg/nats) in
	// the same kind of run, 0 when that row did not run.
	MsgsPerSec, Min, Max, RatioStock float64
	// P50, P99 and Max latency, medians over the repetitions.
	P50, P99, MaxLatency time.Duration
	// The rest are summed over the repetitions.
	N, Deliveries, InProgress int64
	Doubled, Lost             int
	Errors                    int64
}

func (r Row) ok() bool { return r.Doubled == 0 && r.Lost == 0 }

// kinds are the kinds of run, in report order.
func kinds() []string { return []string{kindThroughput, kindLatency, kindInProgress} }

// Run runs every subscriber cfg.Reps times in the throughput run, then
// once each in the latency and the in-progress run, and returns the
// results measured so far with the first error. Within a repetition the
// subscribers take turns, starting one later each time.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	// Loggers print from the subscribers' and handlers' goroutines.
	cfg.Out = benchutil.SyncWriter(cfg.Out)
	e, closeEnv, err := newEnv(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer closeEnv()
	res := &Results{ServerVersion: e.version, Conns: int(poolSize(cfg))}
	syss := cfg.systems()
	type turn struct {
		kind string
		rep  int
	}
	var turns []turn
	for rep := range cfg.Reps {
		turns = append(turns, turn{kindThroughput, rep})
	}
	turns = append(turns, turn{kindLatency, 0}, turn{kindInProgress, 0})
	total := len(turns) * len(syss)
	started := time.Now()
	for ti, tn := range turns {
		for i := range syss {
			sys := syss[(i+ti)%len(syss)]
			smp, err := e.run(ctx, sys, tn.kind, tn.rep)
			if err != nil {
				res.Rows = aggregate(res.Samples, cfg)
				return res, fmt.Errorf("%s, %s run, repetition %d: %w", label(sys, cfg), tn.kind, tn.rep+1, err)
			}
			res.Samples = append(res.Samples, smp)
			flag := ""
			if smp.Errors > 0 {
				flag = fmt.Sprintf(", %d errors logged", smp.Errors)
			}
			if !smp.Effects.ok() {
				flag += "  <-- WRONG EFFECTS"
			}
			lat := ""
			if smp.P99 > 0 {
				lat = fmt.Sprintf(", latency p50 %s p99 %s max %s", fmtDur(smp.P50), fmtDur(smp.P99), fmtDur(smp.Max))
			}
			fmt.Fprintf(cfg.Out, "[%2d/%d %s] %-12s %-18s rep %d: %7.0f msgs/s (%s)%s, %d deliveries of %d messages, %d while in progress, %d effect rows: %d doubled, %d lost%s\n",
				len(res.Samples), total, fmtElapsed(time.Since(started)), tn.kind, sys, tn.rep+1, smp.MsgsPerSec,
				smp.Elapsed.Round(time.Millisecond), lat, smp.Deliveries, smp.N, smp.InProgress,
				smp.Effects.Rows, smp.Effects.Doubled, smp.Effects.Lost, flag)
		}
	}
	res.Rows = aggregate(res.Samples, cfg)
	return res, nil
}

// aggregate makes the report's rows from the samples: per kind and
// subscriber, in that order.
func aggregate(samples []Sample, cfg Config) []Row {
	var rows []Row
	for _, kind := range kinds() {
		for _, sys := range cfg.systems() {
			r := Row{System: sys, Kind: kind}
			var rates []float64
			var p50s, p99s, maxs []time.Duration
			for _, s := range samples {
				if s.System != sys || s.Kind != kind {
					continue
				}
				r.Reps++
				rates = append(rates, s.MsgsPerSec)
				p50s, p99s, maxs = append(p50s, s.P50), append(p99s, s.P99), append(maxs, s.Max)
				r.N += int64(s.N)
				r.Deliveries += s.Deliveries
				r.InProgress += s.InProgress
				r.Doubled += s.Effects.Doubled
				r.Lost += s.Effects.Lost
				r.Errors += s.Errors
			}
			if r.Reps == 0 {
				continue
			}
			r.MsgsPerSec, r.Min, r.Max = median(rates), slices.Min(rates), slices.Max(rates)
			r.P50, r.P99, r.MaxLatency = medianDur(p50s), medianDur(p99s), medianDur(maxs)
			rows = append(rows, r)
		}
	}
	for i := range rows {
		if s, ok := findRow(rows, sysStock, rows[i].Kind); ok && s.MsgsPerSec > 0 {
			rows[i].RatioStock = rows[i].MsgsPerSec / s.MsgsPerSec
		}
	}
	return rows
}

// findRow returns the row of sys in kind.
func findRow(rows []Row, sys, kind string) (Row, bool) {
	for _, r := range rows {
		if r.System == sys && r.Kind == kind {
			return r, true
		}
	}
	return Row{}, false
}

// median returns the median of xs (the mean of the middle two for an even
// count); 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func medianDur(ds []time.Duration) time.Duration {
	xs := make([]float64, len(ds))
	for i, d := range ds {
		xs[i] = float64(d)
	}
	return time.Duration(median(xs))
}

func fmtElapsed(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}
