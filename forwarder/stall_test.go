package forwarder_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
)

// logLine is one line a test logger received.
type logLine struct {
	level  string // "error", "warn", "info", "debug", "trace"
	msg    string
	err    error
	fields watermill.LogFields
}

// lineLogger is a Watermill logger (no Warn level) that keeps its lines.
type lineLogger struct {
	mu    sync.Mutex
	lines []logLine
}

func (l *lineLogger) add(level, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, logLine{level: level, msg: msg, err: err, fields: fields.Copy()})
}

func (l *lineLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.add("error", msg, err, fields)
}
func (l *lineLogger) Info(msg string, fields watermill.LogFields)  { l.add("info", msg, nil, fields) }
func (l *lineLogger) Debug(msg string, fields watermill.LogFields) { l.add("debug", msg, nil, fields) }
func (l *lineLogger) Trace(msg string, fields watermill.LogFields) { l.add("trace", msg, nil, fields) }
func (l *lineLogger) With(watermill.LogFields) watermill.LoggerAdapter {
	return l
}

// stalls returns the stall lines: at Warn, or at Error with ErrStalled.
func (l *lineLogger) stalls() []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []logLine
	for _, x := range l.lines {
		if x.level == "warn" || errors.Is(x.err, forwarder.ErrStalled) {
			out = append(out, x)
		}
	}
	return out
}

// levels counts the lines by level.
func (l *lineLogger) levels() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]int{}
	for _, x := range l.lines {
		out[x.level]++
	}
	return out
}

// warnLogger is a logger with a Warn level besides Watermill's.
type warnLogger struct{ *lineLogger }

func (w warnLogger) Warn(msg string, fields watermill.LogFields) { w.add("warn", msg, nil, fields) }

// statements counts the statements run on a pool, by a part of their
// text, once they have ended (their rows read).
type statements struct {
	mu  sync.Mutex
	sql []string
}

type sqlKey struct{}

func (s *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}

func (s *statements) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	q, _ := ctx.Value(sqlKey{}).(string)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sql = append(s.sql, q)
}

func (s *statements) count(part string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, q := range s.sql {
		if strings.Contains(q, part) {
			n++
		}
	}
	return n
}

// The relay's backlog count, and its look for the transaction that holds
// the rows, which it runs only when rows wait.
const (
	lagCountSQL = "count(*) FILTER"
	holderSQL   = "pg_prepared_xacts"
)

// tracedBundle is o's outbox on a pool of its own whose statements st
// counts.
func (o privateOutbox) tracedBundle(t *testing.T, st *statements) bundle {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(o.server.URL())
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.Tracer = st
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return bundle{pool: pool, schema: o.b.schema}
}

// openIn opens a transaction with an id on a connection to database db of
// o's server, and returns it with its backend's pid.
func (o privateOutbox) openIn(t *testing.T, db string) (pgx.Tx, int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, strings.Replace(o.server.URL(), "/postgres?", "/"+db+"?", 1))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	return tx, int(conn.PgConn().PID())
}

// TestStallWarning: a transaction in another database that holds the
// outbox for longer than StallWarning is logged, naming its pid, database
// and age, at most once per StallWarning while it lasts (not once per poll)
// and no more once it has ended; a writer in flight, open for less than
// StallWarning, is no stall even while rows wait on it. A logger with a
// Warn method gets the lines there, a Watermill logger at Error with
// ErrStalled.
func TestStallWarning(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t)
	ctx := context.Background()
	_, err := o.pool.Exec(ctx, `CREATE DATABASE reporting`)
	require.NoError(t, err)

	t.Run("a writer in flight is no stall", func(t *testing.T) {
		o.reset(t)
		st := &statements{}
		b := o.tracedBundle(t, st)
		began := time.Now()
		short, _ := o.openIn(t, "reporting")
		o.b.write(t, "orders", event("order-1", 1), event("order-2", 2))

		logger := warnLogger{&lineLogger{}}
		s := &sink{}
		const every = 10 * time.Second
		run(t, newRelay(t, b, s, func(c *forwarder.RelayConfig) { c.StallWarning = every; c.Logger = logger }))
		// The relay's first stall check comes with its first empty look;
		// it looks for the holder only when it finds rows waiting.
		require.Eventually(t, func() bool { return st.count(holderSQL) > 0 }, 30*time.Second, 5*time.Millisecond,
			"the relay saw the rows wait on the writer")
		require.NoError(t, short.Commit(ctx))
		require.Less(t, time.Since(began), every, "the writer must end before StallWarning for this test to mean anything")
		require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 5*time.Millisecond)
		require.Empty(t, logger.stalls(), "a transaction younger than StallWarning is no stall")
	})

	for name, newLogger := range map[string]func() (watermill.LoggerAdapter, *lineLogger){
		"a logger with Warn": func() (watermill.LoggerAdapter, *lineLogger) { l := &lineLogger{}; return warnLogger{l}, l },
		"a Watermill logger": func() (watermill.LoggerAdapter, *lineLogger) { l := &lineLogger{}; return l, l },
	} {
		t.Run(name, func(t *testing.T) {
			o.reset(t)
			logger, lines := newLogger()
			_, hasWarn := logger.(warnLogger)
			st := &statements{}
			b := o.tracedBundle(t, st)
			const every = 300 * time.Millisecond

			began := time.Now()
			long, pid := o.openIn(t, "reporting")
			o.b.write(t, "orders", event("order-1", 1), event("order-2", 2))
			s := &sink{}
			run(t, newRelay(t, b, s, func(c *forwarder.RelayConfig) {
				c.StallWarning = every
				c.PollInterval = 10 * time.Millisecond // many polls per interval
				c.Logger = logger
			}))
			require.Eventually(t, func() bool { return len(lines.stalls()) > 0 }, 30*time.Second, 5*time.Millisecond,
				"the relay logs the stall")
			time.Sleep(time.Until(began.Add(3 * every))) // hold it for about three intervals
			require.Empty(t, s.snapshot(), "nothing went out while the transaction was open")
			require.NoError(t, long.Commit(ctx))
			require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 5*time.Millisecond,
				"the rows go out once it ends")
			elapsed := time.Since(began)

			stalls := lines.stalls()
			t.Logf("%d stall lines over %s, StallWarning %s", len(stalls), elapsed.Round(time.Millisecond), every)
			require.NotEmpty(t, stalls)
			require.LessOrEqual(t, len(stalls), int(elapsed/every),
				"at most one line per StallWarning over %s, the first after one StallWarning", elapsed)
			for _, l := range stalls {
				if hasWarn {
					require.Equal(t, "warn", l.level)
				} else {
					require.Equal(t, "error", l.level)
					require.ErrorIs(t, l.err, forwarder.ErrStalled)
				}
				require.Equal(t, pid, l.fields["holder_pid"])
				require.Equal(t, "reporting", l.fields["holder_database"])
				require.Equal(t, "idle in transaction", l.fields["holder_state"])
				age, err := time.ParseDuration(fmt.Sprint(l.fields["holder_age"]))
				require.NoError(t, err)
				require.GreaterOrEqual(t, age, every, "only a transaction open for StallWarning is a stall")
				require.Contains(t, l.msg, fmt.Sprintf("pid %d in database %q", pid, "reporting"))
				require.Contains(t, l.msg, "open for "+age.String())
			}
			if hasWarn {
				require.Zero(t, lines.levels()["error"], "with a Warn level, nothing at Error")
			}

			// Two more stall checks, with no rows waiting: no more lines.
			checks := st.count(lagCountSQL)
			require.Eventually(t, func() bool { return st.count(lagCountSQL) >= checks+2 }, 30*time.Second, 5*time.Millisecond)
			require.Len(t, lines.stalls(), len(stalls), "the lines stop once the transaction has ended")
		})
	}
}

// TestPreparedTransactionHoldsTheOutbox: a prepared transaction in another
// database holds the outbox like an open one; Lag names it (state
// "prepared", its gid and database, no pid) and so does the stall line,
// until COMMIT PREPARED or ROLLBACK PREPARED ends it.
func TestPreparedTransactionHoldsTheOutbox(t *testing.T) {
	t.Parallel()
	o := newPrivateOutbox(t, "max_prepared_transactions = 4")
	ctx := context.Background()
	_, err := o.pool.Exec(ctx, `CREATE DATABASE ledger`)
	require.NoError(t, err)
	conn, err := pgx.Connect(ctx, strings.Replace(o.server.URL(), "/postgres?", "/ledger?", 1))
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `CREATE TABLE entries (n int)`)
	require.NoError(t, err)

	for i, end := range []string{"COMMIT PREPARED", "ROLLBACK PREPARED"} {
		t.Run(end, func(t *testing.T) {
			o.reset(t)
			gid := fmt.Sprintf("payment-%d", i)
			for _, q := range []string{`BEGIN`, `INSERT INTO entries VALUES (1)`, `PREPARE TRANSACTION '` + gid + `'`} {
				_, err := conn.Exec(ctx, q)
				require.NoError(t, err)
			}
			o.b.write(t, "orders", event("order-1", 1), event("order-2", 2))

			logger := warnLogger{&lineLogger{}}
			s := &sink{}
			r := newRelay(t, o.b, s, func(c *forwarder.RelayConfig) {
				c.StallWarning = 200 * time.Millisecond
				c.Logger = logger
			})
			run(t, r)
			require.Eventually(t, func() bool { return len(logger.stalls()) > 0 }, 30*time.Second, 5*time.Millisecond,
				"the relay logs the stall")
			require.Empty(t, s.snapshot(), "nothing went out while the transaction was prepared")

			lag, err := r.Lag(ctx)
			require.NoError(t, err)
			require.Equal(t, 2, lag.Pending)
			require.Equal(t, 2, lag.Waiting)
			require.NotNil(t, lag.HeldBy)
			require.Equal(t, "prepared", lag.HeldBy.State)
			require.Equal(t, gid, lag.HeldBy.GID)
			require.Equal(t, "ledger", lag.HeldBy.Database)
			require.Equal(t, "postgres", lag.HeldBy.User)
			require.Zero(t, lag.HeldBy.PID, "a prepared transaction has no backend")
			require.Contains(t, lag.HeldBy.String(), fmt.Sprintf("prepared transaction %q in database %q", gid, "ledger"))
			for _, l := range logger.stalls() {
				require.Equal(t, gid, l.fields["holder_gid"])
				require.Equal(t, "ledger", l.fields["holder_database"])
				require.Equal(t, "prepared", l.fields["holder_state"])
				require.Contains(t, l.msg, fmt.Sprintf("prepared transaction %q", gid))
			}

			_, err = conn.Exec(ctx, end+` '`+gid+`'`)
			require.NoError(t, err)
			require.Eventually(t, func() bool { return len(s.snapshot()) == 2 }, 30*time.Second, 5*time.Millisecond,
				"the rows go out once it ends")
			// The rows are deleted when the batch that published them
			// commits, a moment after the publish.
			require.Eventually(t, func() bool {
				lag, err = r.Lag(ctx)
				require.NoError(t, err)
				return lag.Pending == 0
			}, 30*time.Second, 5*time.Millisecond, "the outbox empties")
			require.Nil(t, lag.HeldBy)
		})
	}
	var n int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM entries`).Scan(&n))
	require.Equal(t, 1, n, "the committed one's row, not the rolled back one's")
}
