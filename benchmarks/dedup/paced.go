package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// pacedRun is one strategy of the paced latency runs: what a batch costs
// a delivery in latency when messages arrive at a steady rate instead of
// all at once.
type pacedRun struct {
	Strategy string
	// Linger is the batched inbox's Batch.Linger; zero for the others.
	Linger time.Duration
}

// pacedRuns are the strategies the paced runs compare: the raw SQL, the
// default inbox, and group commit with no linger and with a short one.
func pacedRuns() []pacedRun {
	return []pacedRun{
		{Strategy: stRaw},
		{Strategy: stPostgres},
		{Strategy: stPGBatch},
		{Strategy: stPGBatch, Linger: 2 * time.Millisecond},
	}
}

// PacedResult is one paced latency measurement.
type PacedResult struct {
	Strategy string
	Linger   time.Duration
	// Rate is the offered rate in msgs/s, Achieved the rate at which the
	// messages were acked (N over the time from the first arrival to the
	// last ack).
	Rate, Achieved float64
	Workers, N     int
	// P50, P99 and Max are the latencies from each message's arrival (its
	// place in the schedule) to its ack: the queueing for a free worker,
	// the wait for a batch and the batch's own run all count.
	P50, P99, Max time.Duration
	// Commits counts the COMMIT statements sent.
	Commits int64
	Effects effectCounts
	// Lost counts the stream's keys without an effect.
	Lost int
}

// Name is the strategy as the paced table shows it.
func (r PacedResult) Name() string {
	if r.Linger > 0 {
		return fmt.Sprintf("%s, Linger %s", r.Strategy, r.Linger)
	}
	return r.Strategy
}

// paced delivers stream s to strategy run at cfg.PacedRate msgs/s, open
// loop: message i arrives at i/rate after the start, whether or not the
// workers have kept up, and waits in a queue for one of workers free
// workers, as a subscriber's buffer would hold it. A delivery nacked
// (a key in flight) goes to the back of the queue; its latency runs on
// from its arrival.
func (e *env) paced(ctx context.Context, run pacedRun, s *stream, rate float64, workers int) (r PacedResult, err error) {
	r = PacedResult{Strategy: run.Strategy, Linger: run.Linger, Rate: rate, Workers: workers, N: len(s.Msgs)}
	var d strategyDef
	for _, x := range append(baselineDefs(), strategies()...) {
		if x.Name == run.Strategy {
			d = x
		}
	}
	if d.Name == "" {
		return r, fmt.Errorf("unknown strategy %q", run.Strategy)
	}
	fx, err := e.newFixture(ctx, d)
	if err != nil {
		return r, err
	}
	defer func() { err = errors.Join(err, fx.close()) }()
	p, err := fx.start(ctx, d, procOptions{ExpectedKeys: uint(len(s.Msgs)), Linger: run.Linger})
	if err != nil {
		return r, err
	}
	defer p.stop()
	if err := e.warmConnections(ctx, workers, nil, d.Redis); err != nil {
		return r, err
	}

	runCtx, cancel := context.WithTimeoutCause(ctx, e.cfg.RunTimeout, errTimeout)
	defer cancel()
	n := len(s.Msgs)
	interval := time.Duration(float64(time.Second) / rate)
	queue := make(chan int, 2*n) // every message once, and room for as many redeliveries
	lat := make([]time.Duration, n)
	var (
		mu       sync.Mutex
		acked    int
		lastAck  time.Time
		failures int
		firstErr error
		commits  int64
		allDone  = make(chan struct{})
	)
	start := time.Now()
	go func() {
		t := time.NewTimer(0)
		defer t.Stop()
		for i := range n {
			if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
				t.Reset(wait)
				select {
				case <-t.C:
				case <-runCtx.Done():
					return
				}
			}
			queue <- i
		}
	}()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				var pos int
				select {
				case pos = <-queue:
				case <-allDone:
					return
				case <-runCtx.Done():
					return
				}
				dl := &delivery{}
				_, herr := p.handler(p.message(&s.Msgs[pos], dl))
				now := time.Now()
				mu.Lock()
				commits += dl.commits.Load()
				if herr != nil {
					failures++
					if firstErr == nil {
						firstErr = herr
					}
					if failures > n {
						cancel()
					}
					mu.Unlock()
					queue <- pos
					continue
				}
				lat[pos] = now.Sub(start.Add(time.Duration(pos) * interval))
				acked++
				lastAck = now
				if acked == n {
					close(allDone)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if acked < n {
		return r, fmt.Errorf("%d of %d messages not acked (%v; first delivery error: %v)", n-acked, n, context.Cause(runCtx), firstErr)
	}
	r.Achieved = float64(n) / lastAck.Sub(start).Seconds()
	r.Commits = commits
	slices.Sort(lat)
	r.P50, r.P99, r.Max = quantile(lat, 0.50), quantile(lat, 0.99), lat[n-1]
	if r.Effects, err = fx.countEffects(ctx); err != nil {
		return r, err
	}
	r.Lost = s.Keys - r.Effects.Keys
	return r, nil
}

// writePaced renders the paced latency table.
func writePaced(b *strings.Builder, res *Results, cfg Config) {
	if len(res.Paced) == 0 {
		return
	}
	first := res.Paced[0]
	fmt.Fprintf(b, "### Latency at a steady %.0f msgs/s\n\n", first.Rate)
	fmt.Fprintf(b, "%d messages at %.0f%% duplicates arrive one every %s (open loop: on schedule whether or not the workers keep up) and wait for one of %d workers; latency runs from a message's arrival to its ack, so the wait for a worker, for a batch and the batch's own run all count.\n\n",
		first.N, cfg.CrashDupRatio*100, time.Duration(float64(time.Second)/first.Rate), first.Workers)
	b.WriteString("| Strategy | offered msgs/s | acked msgs/s | p50 | p99 | max | msgs/COMMIT | double / lost keys |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range res.Paced {
		per := "—"
		if r.Commits > 0 {
			per = fmt.Sprintf("%.1f", float64(r.N)/float64(r.Commits))
		}
		fmt.Fprintf(b, "| %s | %.0f | %.0f | %s | %s | %s | %s | %d / %d |\n",
			r.Name(), r.Rate, r.Achieved, fmtMs(r.P50), fmtMs(r.P99), fmtMs(r.Max), per, r.Effects.Doubles, r.Lost)
	}
	b.WriteString("\n")
}

// pacedTargets checks what a batch costs in latency: at a rate the
// consumer keeps up with, a delivery in a batch waits at most the Linger
// and its batch mates' run, so its p99 stays within the Linger of the
// unbatched inbox's p99 plus one more run of it (the p50 of the unbatched
// inbox stands for one run).
func pacedTargets(rs []PacedResult) []Target {
	var ts []Target
	var base PacedResult
	for _, r := range rs {
		if r.Strategy == stPostgres && r.Linger == 0 {
			base = r
		}
	}
	if base.Strategy == "" {
		return nil
	}
	for _, r := range rs {
		if r.Strategy != stPGBatch {
			continue
		}
		bound := base.P99 + r.Linger + base.P50
		ts = append(ts, Target{
			Text: fmt.Sprintf("%s at %.0f msgs/s: p99 ≤ postgres-inbox's p99 + Linger + one run (its p50): %s vs %s + %s + %s = %s",
				r.Name(), r.Rate, fmtMs(r.P99), fmtMs(base.P99), r.Linger, fmtMs(base.P50), fmtMs(bound)),
			Pass: r.P99 <= bound,
		})
	}
	for _, r := range rs {
		ts = append(ts, Target{
			Text: fmt.Sprintf("%s keeps up with %.0f msgs/s (acked ≥ 95%% of offered): %.0f msgs/s", r.Name(), r.Rate, r.Achieved),
			Pass: r.Achieved >= 0.95*r.Rate,
		})
	}
	return ts
}
