package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/middleware"
)

// Results is everything one benchmark run measured.
type Results struct {
	// Stream describes the published stream.
	Stream StreamInfo
	// Conns is the pool's size.
	Conns int
	// Samples are the single runs, in the order they ran.
	Samples []Sample
	// Rows aggregate the samples per subscriber and partition count, in
	// report order.
	Rows []Row
}

// StreamInfo describes a stream without its events.
type StreamInfo struct {
	N, Keys, Dups, Orders, MaxSeq int
}

// Row is one subscriber at one partition count over its repetitions.
type Row struct {
	System     string
	Partitions int
	Reps       int
	// MsgsPerSec is the median over the repetitions, Min and Max the
	// range; FirstMsg the median time to the first delivery.
	MsgsPerSec, Min, Max float64
	FirstMsg             time.Duration
	// RatioStock is MsgsPerSec over watermill-kafka's at the same
	// partition count, RatioNoInbox over the no-inbox baseline's; 0 when
	// that row did not run.
	RatioStock, RatioNoInbox float64
	// Deliveries, Doubled, Lost, OrderViolations and Errors are summed
	// over the repetitions; Inbox sums the inbox's counters.
	Deliveries                     int64
	Doubled, Lost, OrderViolations int
	Errors                         int64
	Inbox                          middleware.InboxStats
	// Rows and Keys are the effect rows and distinct keys, summed.
	Rows, Keys int
}

// ok reports whether every repetition of the row left exactly the
// stream's effects, in order.
func (r Row) ok() bool {
	return r.Doubled == 0 && r.Lost == 0 && r.OrderViolations == 0
}

// Run runs every subscriber on every partition count cfg.Reps times and
// returns the results measured so far, with the first error. Within a
// repetition the subscribers take turns, starting one later each time, so
// that no row always runs first.
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

	s := newStream(cfg.N, cfg.Keys, cfg.DupRatio, cfg.Seed)
	res := &Results{
		Stream: StreamInfo{N: len(s.Events), Keys: s.Keys, Dups: s.Dups, Orders: s.Orders, MaxSeq: s.MaxSeq},
		Conns:  int(e.conns),
	}
	fmt.Fprintf(cfg.Out, "stream: %d messages, %d payments (idempotency keys), %d duplicates, %d orders (record keys), up to %d payments per order\n",
		res.Stream.N, s.Keys, s.Dups, s.Orders, s.MaxSeq)
	syss := cfg.systems()
	total := cfg.Reps * len(cfg.Partitions) * len(syss)
	started := time.Now()
	for rep := range cfg.Reps {
		for _, parts := range cfg.Partitions {
			for i := range syss {
				sys := syss[(i+rep)%len(syss)]
				smp, err := e.run(ctx, sys, parts, rep, &s)
				if err != nil {
					res.Rows = aggregate(res.Samples, cfg)
					return res, fmt.Errorf("%s, %d partitions, repetition %d: %w", chartName(sys, cfg), parts, rep+1, err)
				}
				res.Samples = append(res.Samples, smp)
				c := smp.Effects
				flag := ""
				if smp.Errors > 0 {
					flag = fmt.Sprintf(", %d errors logged", smp.Errors)
				}
				if !c.ok() {
					flag += "  <-- WRONG EFFECTS"
				}
				fmt.Fprintf(cfg.Out, "[%2d/%d %s] %-32s p=%d rep %d: %7.0f msgs/s (%s, first message after %s), %d deliveries, at most %d at once, %d effect rows: %d doubled, %d lost, %d order violations%s\n",
					len(res.Samples), total, fmtElapsed(time.Since(started)), chartName(sys, cfg), parts, rep+1, smp.MsgsPerSec,
					smp.Elapsed.Round(time.Millisecond), smp.FirstMsg.Round(time.Millisecond), smp.Deliveries, smp.PeakInFlight,
					c.Rows, c.Doubled, c.Lost, c.OrderViolations, flag)
			}
		}
	}
	res.Rows = aggregate(res.Samples, cfg)
	return res, nil
}

// aggregate makes the report's rows from the samples: per partition count
// and subscriber, in that order.
func aggregate(samples []Sample, cfg Config) []Row {
	var rows []Row
	for _, parts := range cfg.Partitions {
		for _, sys := range cfg.systems() {
			r := Row{System: sys, Partitions: parts}
			var rates []float64
			var firsts []time.Duration
			for _, smp := range samples {
				if smp.System != sys || smp.Partitions != parts {
					continue
				}
				r.Reps++
				rates = append(rates, smp.MsgsPerSec)
				firsts = append(firsts, smp.FirstMsg)
				r.Deliveries += smp.Deliveries
				r.Doubled += smp.Effects.Doubled
				r.Lost += smp.Effects.Lost
				r.OrderViolations += smp.Effects.OrderViolations
				r.Rows += smp.Effects.Rows
				r.Keys += smp.Effects.Keys
				r.Errors += smp.Errors
				r.Inbox = addStats(r.Inbox, smp.Inbox)
			}
			if r.Reps == 0 {
				continue
			}
			r.MsgsPerSec, r.Min, r.Max = median(rates), slices.Min(rates), slices.Max(rates)
			r.FirstMsg = time.Duration(median(durations(firsts)))
			rows = append(rows, r)
		}
	}
	for i := range rows {
		if s, ok := findRow(rows, sysStock, rows[i].Partitions); ok && s.MsgsPerSec > 0 {
			rows[i].RatioStock = rows[i].MsgsPerSec / s.MsgsPerSec
		}
		if b, ok := findRow(rows, sysNoInbox, rows[i].Partitions); ok && b.MsgsPerSec > 0 {
			rows[i].RatioNoInbox = rows[i].MsgsPerSec / b.MsgsPerSec
		}
	}
	return rows
}

// findRow returns the row of sys at parts partitions.
func findRow(rows []Row, sys string, parts int) (Row, bool) {
	for _, r := range rows {
		if r.System == sys && r.Partitions == parts {
			return r, true
		}
	}
	return Row{}, false
}

// addStats adds the inbox counters that the report shows.
func addStats(a, b middleware.InboxStats) middleware.InboxStats {
	a.Applied += b.Applied
	a.Duplicates += b.Duplicates
	a.InFlight += b.InFlight
	a.Failed += b.Failed
	a.Abandoned += b.Abandoned
	a.Infrastructure += b.Infrastructure
	a.ConflictRetries += b.ConflictRetries
	return a
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

func durations(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d)
	}
	return out
}

func fmtElapsed(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
}
