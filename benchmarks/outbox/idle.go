package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/benchmarks/internal/benchutil"
)

// IdleResult is what one relay sent to PostgreSQL while its outbox stayed
// empty.
type IdleResult struct {
	// Window is how long the relay ran.
	Window time.Duration
	// Statements counts every statement on the relay's pool (each Exec
	// and Query, BEGIN and COMMIT included), from Run's start.
	Statements int
	// PerSecond is Statements / Window.
	PerSecond float64
	// LastHalf is the rate over the second half of the window, once any
	// start-up has passed.
	LastHalf float64
	// ByKind counts the statements by their first two words (the first
	// upper-cased), enough to tell them apart.
	ByKind map[string]int
	// Pings counts the pool's liveness pings (on acquiring a connection
	// idle for more than 1s, pgxpool's default); they are not statements
	// the tracer sees.
	Pings int
}

// statementCounter is a pgx.QueryTracer that notes when each statement
// started and its first two words.
type statementCounter struct {
	mu    sync.Mutex
	stmts []statement
	pings atomic.Int64
}

// statement is one traced statement: when it started, its first two
// words.
type statement struct {
	at   time.Time
	kind string
}

// TraceQueryStart counts the statement.
func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	kind := "?"
	if f := strings.Fields(data.SQL); len(f) > 0 {
		f[0] = strings.ToUpper(f[0])
		kind = strings.TrimRight(strings.Join(f[:min(len(f), 2)], " "), ",;")
	}
	c.mu.Lock()
	c.stmts = append(c.stmts, statement{at: time.Now(), kind: kind})
	c.mu.Unlock()
	return ctx
}

// TraceQueryEnd does nothing.
func (*statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// idleStage runs one relay, with its defaults, on an empty outbox for
// cfg.Idle and counts the statements it sends.
func (e *env) idleStage(ctx context.Context) (IdleResult, error) {
	r := IdleResult{Window: e.cfg.Idle}
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
	sk, err := e.newSink(ctx, brokerGo, "bench_dest_"+id)
	if err != nil {
		return r, err
	}
	defer func() {
		if err := sk.close(); err != nil {
			e.logger.Error("close sink", err, nil)
		}
	}()

	counter := &statementCounter{}
	pcfg, err := pgxpool.ParseConfig(e.cfg.DSN)
	if err != nil {
		return r, fmt.Errorf("parse DSN: %w", err)
	}
	pcfg.ConnConfig.Tracer = counter
	pcfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
		if p.IdleDuration > time.Second {
			counter.pings.Add(1)
			return true
		}
		return false
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return r, fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()

	began := time.Now()
	stop, err := o.startOn(ctx, pool, 1, sk.pub)
	if err != nil {
		return r, fmt.Errorf("start relay: %w", err)
	}
	sleep(ctx, r.Window)
	ended := time.Now()
	if err := stop(); err != nil {
		return r, fmt.Errorf("stop relay: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return r, err
	}

	counter.mu.Lock()
	defer counter.mu.Unlock()
	half := began.Add(ended.Sub(began) / 2)
	late := 0
	r.ByKind = make(map[string]int)
	for _, st := range counter.stmts {
		if st.at.Before(ended) {
			r.Statements++
			r.ByKind[st.kind]++
			if !st.at.Before(half) {
				late++
			}
		}
	}
	r.Window = ended.Sub(began)
	r.PerSecond = float64(r.Statements) / r.Window.Seconds()
	r.LastHalf = float64(late) / ended.Sub(half).Seconds()
	r.Pings = int(counter.pings.Load())
	fmt.Fprintf(e.cfg.Out, "idle relay: %d statements in %s, %.2f/s (last half %.2f/s): %s; %d pool pings\n",
		r.Statements, r.Window.Round(time.Millisecond), r.PerSecond, r.LastHalf, fmtKinds(r.ByKind), r.Pings)
	return r, nil
}

// fmtKinds renders statement counts by kind, most frequent first.
func fmtKinds(kinds map[string]int) string {
	keys := slices.Collect(maps.Keys(kinds))
	slices.SortFunc(keys, func(a, b string) int {
		if kinds[a] != kinds[b] {
			return kinds[b] - kinds[a]
		}
		return strings.Compare(a, b)
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, kinds[k])
	}
	return strings.Join(parts, ", ")
}

// sleep waits for d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
