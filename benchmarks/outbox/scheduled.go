package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
	"github.com/oncemill/oncemill/forwarder"
)

// ScheduledResult is how late scheduled messages arrived at a steady rate
// of due times, and, in the same run, the latency of immediate ones.
type ScheduledResult struct {
	// Rate is the due messages per second, Window how long they came
	// due, Ahead how long before its due time each was written.
	Rate   int
	Window time.Duration
	Ahead  time.Duration
	// Due counts the scheduled messages written, Arrived those that
	// arrived, Early those that arrived before their due time, Dups the
	// second copies of any message.
	Due, Arrived, Early, Dups int
	// P50, P99 and Max are the lateness (arrival − due time) of the
	// scheduled messages, the ones that never arrived counting as
	// infinitely late.
	P50, P99, Max          time.Duration
	P50Missing, P99Missing bool
	// Immediate counts the immediate messages committed meanwhile (one
	// per transaction, Rate/10 per second), ImmArrived those that
	// arrived; ImmP50 and ImmP99 their latency, arrival − the return of
	// Commit.
	Immediate, ImmArrived        int
	ImmP50, ImmP99               time.Duration
	ImmP50Missing, ImmP99Missing bool
	// Statements is what the relay sent per second over the window,
	// counted by a pgx QueryTracer on its pool.
	Statements float64
}

// scheduledStage runs one relay with its defaults on a fresh outbox,
// publishing to GoChannel; scheduled messages come due at cfg.Rate per
// second for cfg.Duration, each written cfg.Ahead before its due time
// (a transaction every 10ms), while immediate messages are committed at
// cfg.Rate/10 per second, one per transaction. It measures the scheduled
// messages' lateness, arrival − due time, and the immediate ones'
// latency, arrival − commit.
func (e *env) scheduledStage(ctx context.Context) (ScheduledResult, error) {
	cfg := e.cfg
	r := ScheduledResult{Rate: cfg.Rate, Window: cfg.Duration, Ahead: cfg.Ahead}
	id := benchutil.RandomID()
	o, err := newOurs(ctx, e, id)
	if err != nil {
		return r, fmt.Errorf("migrate: %w", err)
	}
	defer func() {
		if err := o.cleanup(context.WithoutCancel(ctx)); err != nil {
			e.logger.Error("drop schema", err, nil)
		}
	}()
	topic := "bench_dest_" + id
	sk, err := e.newSink(ctx, brokerGo, topic)
	if err != nil {
		return r, err
	}
	defer func() {
		if err := sk.close(); err != nil {
			e.logger.Error("close sink", err, nil)
		}
	}()

	counter := &statementCounter{}
	pcfg, err := pgxpool.ParseConfig(cfg.DSN)
	if err != nil {
		return r, fmt.Errorf("parse DSN: %w", err)
	}
	pcfg.ConnConfig.Tracer = counter
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return r, fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	stop, err := o.startOn(ctx, pool, 1, sk.pub)
	if err != nil {
		return r, fmt.Errorf("start relay: %w", err)
	}
	defer func() {
		if stop != nil {
			_ = stop()
		}
	}()

	// Warm up: a few immediate events, so that the relay runs.
	const warm = 20
	warmMsgs := make([]*message.Message, warm)
	for i := range warmMsgs {
		warmMsgs[i] = newEvent(-1 - i)
	}
	if err := e.inTx(ctx, func(tx pgx.Tx) error { return o.write(ctx, tx, topic, warmMsgs) }); err != nil {
		return r, fmt.Errorf("warm-up: %w", err)
	}
	if _, ok := sk.rec.waitFor(ctx, warm, 10*time.Second); !ok {
		return r, errors.New("warm-up events did not arrive within 10s")
	}

	// Message i is due at began + Ahead + i/Rate, and written in the
	// first transaction of the 10ms ticks at most Ahead before that.
	var (
		mu      sync.Mutex
		dues    = make(map[string]time.Time)
		commits = make(map[string]time.Time)
		wg      sync.WaitGroup
		errs    = make([]error, 2)
		total   = int(int64(cfg.Rate) * int64(cfg.Duration) / int64(time.Second))
		began   = time.Now()
		first   = began.Add(cfg.Ahead)
		step    = time.Second / time.Duration(cfg.Rate)
	)
	wg.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; i < total && ctx.Err() == nil; {
			var batch []*message.Message
			horizon := time.Now().Add(cfg.Ahead)
			for ; i < total; i++ {
				due := first.Add(time.Duration(i) * step)
				if due.After(horizon) {
					break
				}
				m := newEvent(i)
				forwarder.PublishAt(m, due)
				batch = append(batch, m)
				mu.Lock()
				dues[m.UUID] = due
				mu.Unlock()
			}
			if len(batch) > 0 {
				if err := e.inTx(ctx, func(tx pgx.Tx) error { return o.write(ctx, tx, topic, batch) }); err != nil {
					errs[0] = fmt.Errorf("write scheduled: %w", err)
					return
				}
			}
			select {
			case <-tick.C:
			case <-ctx.Done():
			}
		}
	})
	wg.Go(func() {
		// Immediate events at Rate/10 per second, from the first due
		// time to the last.
		every := max(10*step, time.Millisecond)
		sleep(ctx, time.Until(first))
		end := first.Add(cfg.Duration)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for seq := 0; time.Now().Before(end) && ctx.Err() == nil; seq++ {
			m := newEvent(1_000_000 + seq)
			if err := e.inTx(ctx, func(tx pgx.Tx) error { return o.write(ctx, tx, topic, []*message.Message{m}) }); err != nil {
				errs[1] = fmt.Errorf("write immediate: %w", err)
				return
			}
			t := time.Now()
			mu.Lock()
			commits[m.UUID] = t
			mu.Unlock()
			select {
			case <-tick.C:
			case <-ctx.Done():
			}
		}
	})
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return r, err
	}
	last := first.Add(time.Duration(total-1) * step)
	sleep(ctx, time.Until(last))
	windowEnd := time.Now()
	sk.rec.waitFor(ctx, warm+len(dues)+len(commits), cfg.Drain)
	err = stop()
	stop = nil
	if err != nil {
		return r, fmt.Errorf("stop relay: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}

	counter.mu.Lock()
	n := 0
	for _, st := range counter.stmts {
		if !st.at.Before(first) && st.at.Before(windowEnd) {
			n++
		}
	}
	counter.mu.Unlock()
	r.Statements = float64(n) / windowEnd.Sub(first).Seconds()

	arrivals, dups := sk.rec.snapshot()
	r.Dups = dups
	r.Due = len(dues)
	late := make([]time.Duration, 0, len(dues))
	for id, due := range dues {
		if a, ok := arrivals[id]; ok {
			d := a.Sub(due)
			if d < 0 {
				r.Early++
			}
			late = append(late, d)
		}
	}
	r.Arrived = len(late)
	sort.Slice(late, func(i, j int) bool { return late[i] < late[j] })
	r.P50, r.P50Missing = percentile(late, r.Due, 0.50)
	r.P99, r.P99Missing = percentile(late, r.Due, 0.99)
	if len(late) > 0 {
		r.Max = late[len(late)-1]
	}

	r.Immediate = len(commits)
	lats := make([]time.Duration, 0, len(commits))
	for id, c := range commits {
		if a, ok := arrivals[id]; ok {
			lats = append(lats, a.Sub(c))
		}
	}
	r.ImmArrived = len(lats)
	sort.Slice(lats, func(i, j int) bool { return lats[i] < lats[j] })
	r.ImmP50, r.ImmP50Missing = percentile(lats, r.Immediate, 0.50)
	r.ImmP99, r.ImmP99Missing = percentile(lats, r.Immediate, 0.99)

	fmt.Fprintf(cfg.Out, "scheduled: %d/%d due messages arrived (%d early, %d duplicates), lateness p50 %s p99 %s max %s; immediate %d/%d arrived, latency p50 %s p99 %s; relay %.0f statements/s\n",
		r.Arrived, r.Due, r.Early, r.Dups, fmtLat(r.P50, r.P50Missing), fmtLat(r.P99, r.P99Missing), fmtLat(r.Max, false),
		r.ImmArrived, r.Immediate, fmtLat(r.ImmP50, r.ImmP50Missing), fmtLat(r.ImmP99, r.ImmP99Missing), r.Statements)
	return r, nil
}
