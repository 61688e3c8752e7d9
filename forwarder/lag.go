package forwarder

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/sqlschema"
)

// lagQueries measure the backlog of an outbox table: shared by [Relay.Lag]
// and [OutboxLag].
type lagQueries struct {
	lag, holder string
}

// newLagQueries returns the lag queries on the quoted outbox table t, for
// relays that wait for older transactions unless lockOrdered.
func newLagQueries(t string, lockOrdered bool) lagQueries {
	return lagQueries{
		lag: `SELECT count(*), count(*) FILTER (WHERE NOT (` + due("txid", lockOrdered) + `)),
	COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM ` + t,
		// The oldest transaction with an id, open or prepared, on the
		// whole server: it is the snapshot's xmin, what rows wait for.
		holder: `SELECT * FROM (
	SELECT pid, COALESCE(datname, ''), COALESCE(usename, ''), COALESCE(state, ''), COALESCE(left(query, 200), ''), '' AS gid,
		COALESCE(extract(epoch FROM now() - xact_start), 0)::float8, age(backend_xid) AS age
	FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
	UNION ALL
	SELECT 0, database, owner, 'prepared', '', gid, extract(epoch FROM now() - prepared)::float8, age(transaction)
	FROM pg_prepared_xacts) t
ORDER BY age DESC LIMIT 1`,
	}
}

// Lag is how far a relay is behind, and why.
type Lag struct {
	// Pending counts rows not yet published.
	Pending int
	// OldestAge is the age of the oldest pending row; zero when none.
	OldestAge time.Duration
	// Waiting counts the pending rows that may not go out yet because a
	// transaction older than theirs is still open somewhere on the server.
	// On MySQL it counts the committed rows of the lanes whose lowest row
	// is uncommitted (see [Relay]).
	Waiting int
	// HeldBy is, when Waiting > 0, the oldest transaction open on the
	// server: the one the waiting rows wait for. Nil otherwise. Its
	// details need the pg_read_all_stats role (or superuser) for sessions
	// of other users. On MySQL it is the session that wrote the lowest
	// uncommitted row of a waiting lane (its PID is the connection id the
	// row records); its other details need the PROCESS privilege, and
	// come from InnoDB's view of its transactions, which it refreshes
	// only once nothing has read it for 100ms. Its
	// Age is a lower bound there: the row's age, or the transaction's as
	// InnoDB reports it (to the second) less a second.
	HeldBy *Holder
}

// Holder is an open transaction that holds the outbox back.
type Holder struct {
	// PID is the backend's process id; 0 for a prepared transaction. On
	// MySQL it is the connection id, what KILL takes.
	PID int
	// Database and User are the session's (or prepared transaction's).
	Database, User string
	// State is pg_stat_activity's state ("idle in transaction",
	// "active", …), or "prepared" for a prepared transaction. On MySQL it
	// is the processlist's command ("Sleep" for a session idle in its
	// transaction, "Query", …).
	State string
	// Query is the start of the session's last statement.
	Query string
	// GID is a prepared transaction's identifier.
	GID string
	// Age is how long the transaction has been open (prepared: since
	// PREPARE TRANSACTION).
	Age time.Duration
}

// String describes h for a log line.
func (h Holder) String() string {
	if h.State == "prepared" {
		return fmt.Sprintf("prepared transaction %q in database %q, prepared %s ago (COMMIT PREPARED or ROLLBACK PREPARED it)",
			h.GID, h.Database, roundAge(h.Age))
	}
	return fmt.Sprintf("pid %d in database %q (user %q, %s), open for %s, last statement %q",
		h.PID, h.Database, h.User, h.State, roundAge(h.Age), h.Query)
}

// roundAge rounds d for a log line: to the second from a minute on, to the
// millisecond below.
func roundAge(d time.Duration) time.Duration {
	if d >= time.Minute {
		return d.Round(time.Second)
	}
	return d.Round(time.Millisecond)
}

// Lag returns the outbox's pending rows, the age of the oldest, and what
// holds back those that wait.
func (r *Relay) Lag(ctx context.Context) (Lag, error) {
	return r.db.lag(ctx)
}

func (o *pgOutbox) lag(ctx context.Context) (Lag, error) {
	return measureLag(ctx, o.pool, o.q.lagQueries)
}

// OutboxLag returns what [Relay.Lag] returns, for the outbox table that
// schema names (as given to sqlschema.Migrate), without a relay: for a
// dashboard or an operator's console that watches the outbox from another
// process. It runs the same queries as Relay.Lag of a relay without
// LockOrderedWriters, so its Waiting rows are the ones such a relay would
// hold back. A missing table is an
// error that wraps PostgreSQL's undefined_table (SQLSTATE 42P01).
func OutboxLag(ctx context.Context, pool *pgxpool.Pool, schema sqlschema.Config) (Lag, error) {
	if pool == nil {
		return Lag{}, errors.New("forwarder: OutboxLag: pool is nil")
	}
	schema = schema.WithDefaults()
	if err := schema.Validate(); err != nil {
		return Lag{}, fmt.Errorf("forwarder: OutboxLag: %w", err)
	}
	return measureLag(ctx, pool, newLagQueries(sqlschema.NamesFor(sqlschema.Postgres, schema).Outbox, false))
}

// measureLag runs q on pool.
func measureLag(ctx context.Context, pool *pgxpool.Pool, q lagQueries) (Lag, error) {
	var (
		lag Lag
		age float64
	)
	if err := pool.QueryRow(ctx, q.lag).Scan(&lag.Pending, &lag.Waiting, &age); err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	lag.OldestAge = time.Duration(age * float64(time.Second))
	if lag.Waiting == 0 {
		return lag, nil
	}
	var (
		h    Holder
		open float64
		xage int64
	)
	err := pool.QueryRow(ctx, q.holder).Scan(&h.PID, &h.Database, &h.User, &h.State, &h.Query, &h.GID, &open, &xage)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		// It ended between the two queries.
	case err != nil:
		return Lag{}, fmt.Errorf("forwarder: lag: find the open transaction: %w", err)
	default:
		h.Age = time.Duration(open * float64(time.Second))
		lag.HeldBy = &h
	}
	return lag, nil
}

// lagReading is the relay's last measure of its backlog, shared by the lag
// hooks and the stall check so that one count serves both.
type lagReading struct {
	lag Lag
	err error
	at  time.Time
}

// measure reads the backlog again unless the last reading is younger than
// maxAge.
func (l *lagReading) measure(ctx context.Context, r *Relay, maxAge time.Duration) (Lag, error) {
	if l.at.IsZero() || time.Since(l.at) >= maxAge {
		l.lag, l.err = r.Lag(ctx)
		l.at = time.Now()
	}
	return l.lag, l.err
}

// reportLag measures the backlog and tells the lag hooks.
func (r *Relay) reportLag(ctx context.Context, reading *lagReading) {
	lag, err := reading.measure(ctx, r, 0)
	if err != nil {
		if ctx.Err() == nil {
			r.cfg.Logger.Error("Outbox lag not measured", err, nil)
		}
		return
	}
	r.hooks.OutboxLag(ctx, observe.OutboxLag{Outbox: r.outbox, Pending: lag.Pending, Waiting: lag.Waiting, OldestAge: lag.OldestAge})
}
