package forwarder

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/sqlschema"
)

// lagSQL measures the backlog of an outbox table: shared by [Relay.Lag],
// [OutboxLag] and [SQLOutboxLag].
type lagSQL struct {
	// count is the pending rows, those that wait (on a database with
	// snapshots) and the age of the oldest (µs).
	count string
	// holder is, with snapshots, the oldest transaction with an id, open
	// or prepared, on the whole server: it is the snapshot's xmin, what
	// rows wait for. With READ UNCOMMITTED it is a session's open
	// transaction. Either way its columns are a [Holder]'s, its age in µs
	// (see [lagSQL.findHolder]).
	holder string
	// With READ UNCOMMITTED, instead of count: lanes is per lane the
	// committed rows, the lowest id, the age of the oldest row (µs);
	// lowest is per lane the lowest id of any row, committed or not, read
	// uncommitted; inFlight is a row's writer (its session's connection
	// id) and age (µs), read uncommitted.
	lanes, lowest, inFlight string
	lockOrdered             bool
	// scheduled is the scheduled table's rows and the earliest due time
	// (µs), NULL when empty.
	scheduled string
}

// newLagSQL returns the lag queries of an outbox table of names on a
// database of d, for relays that wait for older transactions unless
// lockOrdered.
func newLagSQL(d *sqldb.Dialect, names sqlschema.Names, lockOrdered bool) lagSQL {
	q := newOutboxLagSQL(d, names, lockOrdered)
	q.scheduled = `SELECT COUNT(*), ` + nextDue(d) + ` FROM ` + names.Scheduled
	return q
}

// newOutboxLagSQL returns the lag queries of the outbox table itself.
func newOutboxLagSQL(d *sqldb.Dialect, names sqlschema.Names, lockOrdered bool) lagSQL {
	t := names.Outbox
	age := `COALESCE(` + d.Micros(d.Now()) + ` - ` + d.Micros("MIN(created_at)") + `, 0)`
	switch {
	case d.ReadUncommitted && !d.Snapshots:
		return lagSQL{
			lanes:    `SELECT lane, COUNT(*), MIN(id), ` + age + ` FROM ` + t + ` GROUP BY lane`,
			lowest:   `SELECT MIN(id), lane FROM ` + t + ` GROUP BY lane`,
			inFlight: d.Rebind(`SELECT writer, ` + d.Micros(d.Now()) + ` - ` + d.Micros("created_at") + ` FROM ` + t + ` WHERE id = ?`),
			// InnoDB's own view of open transactions: trx_started (to the
			// second) and NOW() are both in the session's time zone.
			holder: `SELECT t.trx_mysql_thread_id, COALESCE(p.DB, ''), COALESCE(p.USER, ''), COALESCE(p.COMMAND, ''),
	COALESCE(LEFT(t.trx_query, 200), ''), '', TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6))
FROM information_schema.INNODB_TRX t LEFT JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
WHERE t.trx_mysql_thread_id = ?`,
			lockOrdered: lockOrdered,
		}
	case !d.Snapshots:
		return lagSQL{count: `SELECT COUNT(*), 0, ` + age + ` FROM ` + t}
	}
	return lagSQL{
		count: `SELECT count(*), count(*) FILTER (WHERE NOT (` + due(d, "txid", lockOrdered) + `)), ` + age + ` FROM ` + t,
		holder: `SELECT pid, datname, usename, state, query, gid, ` + d.Micros("now()") + ` - ` + d.Micros("since") + ` FROM (
	SELECT pid, COALESCE(datname, '') AS datname, COALESCE(usename, '') AS usename, COALESCE(state, '') AS state,
		COALESCE(left(query, 200), '') AS query, '' AS gid, COALESCE(xact_start, now()) AS since, age(backend_xid) AS age
	FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
	UNION ALL
	SELECT 0, database, owner, 'prepared', '', gid, prepared, age(transaction)
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
	// is uncommitted (see [Relay]). On SQLite no row waits: it is 0.
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
	// Scheduled counts the rows written with a due time ([PublishAt])
	// that wait in the scheduled table (see [DueAtKey]) and are not
	// among Pending; 0 on a schema without the table.
	Scheduled int
	// NextDue is the earliest due time of the scheduled rows; zero when
	// there are none. One already past, by the database's clock, is a row
	// no relay has moved yet.
	NextDue time.Time
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
	return r.db.lag.measure(ctx, r.db.db)
}

// OutboxLag returns what [Relay.Lag] returns, for the outbox table that
// schema names (as given to sqlschema.Migrate), without a relay: for a
// dashboard or an operator's console that watches the outbox from another
// process. It runs the same queries as Relay.Lag of a relay without
// LockOrderedWriters, so its Waiting rows are the ones such a relay would
// hold back. A missing outbox table is an
// error that wraps PostgreSQL's undefined_table (SQLSTATE 42P01); a
// missing scheduled table (a schema migrated before it) counts no
// scheduled rows.
func OutboxLag(ctx context.Context, pool *pgxpool.Pool, schema sqlschema.Config) (Lag, error) {
	if pool == nil {
		return Lag{}, errors.New("forwarder: OutboxLag: pool is nil")
	}
	return outboxLag(ctx, "OutboxLag", sqldb.Pgx(pool), schema)
}

// SQLOutboxLag returns what [Relay.Lag] returns, for the outbox table that
// schema names (as given to sqlschema.MigrateSQL) on db, a database of
// dialect d (sqlschema.Postgres, sqlschema.MySQL or sqlschema.SQLite),
// without a relay: [OutboxLag] for database/sql. Its Waiting rows are the
// ones a relay without LockOrderedWriters would hold back.
func SQLOutboxLag(ctx context.Context, db *sql.DB, d sqlschema.Dialect, schema sqlschema.Config) (Lag, error) {
	if db == nil {
		return Lag{}, errors.New("forwarder: SQLOutboxLag: db is nil")
	}
	dialect, err := sqldb.For(d)
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: SQLOutboxLag: %w", err)
	}
	return outboxLag(ctx, "SQLOutboxLag", sqldb.SQL(db, dialect), schema)
}

func outboxLag(ctx context.Context, caller string, db sqldb.DB, schema sqlschema.Config) (Lag, error) {
	schema = schema.WithDefaults()
	if err := schema.Validate(); err != nil {
		return Lag{}, fmt.Errorf("forwarder: %s: %w", caller, err)
	}
	return newLagSQL(db.Dialect(), db.Dialect().Names(schema), false).measure(ctx, db)
}

// measure runs q on db: the outbox's lag and the scheduled rows.
func (q lagSQL) measure(ctx context.Context, db sqldb.DB) (Lag, error) {
	lag, err := q.measureOutbox(ctx, db)
	if err != nil {
		return Lag{}, err
	}
	var due *time.Time
	err = db.QueryRow(ctx, q.scheduled).Scan(&lag.Scheduled, sqldb.TimeOrNil(&due))
	switch {
	case db.Dialect().UndefinedTable(err), db.Dialect().AccessDenied(err):
		// A schema migrated before the scheduled table, or a role that
		// may not read it: nothing that this relay moves waits.
		return lag, nil
	case err != nil:
		return Lag{}, fmt.Errorf("forwarder: lag: scheduled rows: %w", err)
	}
	if due != nil {
		lag.NextDue = *due
	}
	return lag, nil
}

// measureOutbox runs q on db's outbox table.
func (q lagSQL) measureOutbox(ctx context.Context, db sqldb.DB) (Lag, error) {
	if q.lanes != "" {
		return q.measureLanes(ctx, db)
	}
	var (
		lag Lag
		age int64
	)
	if err := db.QueryRow(ctx, q.count).Scan(&lag.Pending, &lag.Waiting, &age); err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	lag.OldestAge = time.Duration(age) * time.Microsecond
	if lag.Waiting == 0 || q.holder == "" {
		return lag, nil
	}
	var err error
	if lag.HeldBy, err = q.findHolder(ctx, db); err != nil {
		return Lag{}, err
	}
	return lag, nil
}

// findHolder reads the transaction q.holder finds with args: nil when it
// ended meanwhile (or, on MySQL, the server shows only the sessions of
// this user).
func (q lagSQL) findHolder(ctx context.Context, ex sqldb.Executor, args ...any) (*Holder, error) {
	var (
		h    Holder
		open int64
	)
	err := ex.QueryRow(ctx, q.holder, args...).Scan(&h.PID, &h.Database, &h.User, &h.State, &h.Query, &h.GID, &open)
	switch {
	case errors.Is(err, sqldb.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("forwarder: lag: find the open transaction: %w", err)
	}
	h.Age = time.Duration(open) * time.Microsecond
	return &h, nil
}

// laneCount is one lane's committed rows.
type laneCount struct {
	rows   int
	lowest int64
}

// measureLanes counts the committed rows per lane, then (unless
// lockOrdered) reads each lane's lowest row uncommitted: a lane whose
// lowest row is not its lowest committed one waits, with all its
// committed rows.
func (q lagSQL) measureLanes(ctx context.Context, db sqldb.DB) (Lag, error) {
	type laneLine struct {
		lane  int16
		count laneCount
		age   int64
	}
	rs, err := db.Query(ctx, q.lanes)
	lines, err := sqldb.Collect(rs, err, func(rs sqldb.Rows) (laneLine, error) {
		var l laneLine
		return l, rs.Scan(&l.lane, &l.count.rows, &l.count.lowest, &l.age)
	})
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: %w", err)
	}
	var (
		lag    Lag
		oldest int64
		lanes  = map[int16]laneCount{}
	)
	for _, l := range lines {
		lanes[l.lane] = l.count
		lag.Pending += l.count.rows
		oldest = max(oldest, l.age)
	}
	lag.OldestAge = time.Duration(oldest) * time.Microsecond
	if q.lockOrdered || lag.Pending == 0 {
		return lag, nil
	}

	tx, err := db.Begin(ctx, sqldb.TxOptions{Isolation: sqldb.ReadUncommitted, ReadOnly: true})
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // read only; the outcome is the reads'
	lows, err := queryLaneRows(ctx, tx, q.lowest, nil)
	if err != nil {
		return Lag{}, fmt.Errorf("forwarder: lag: rows in flight: %w", err)
	}
	var blocking int64 // the lowest row in flight of a waiting lane
	for _, l := range lows {
		c, ok := lanes[l.lane]
		if !ok || l.id >= c.lowest {
			continue
		}
		lag.Waiting += c.rows
		if blocking == 0 || l.id < blocking {
			blocking = l.id
		}
	}
	if lag.Waiting == 0 {
		return lag, nil
	}
	var (
		writer uint64
		age    int64
	)
	switch err := tx.QueryRow(ctx, q.inFlight, blocking).Scan(&writer, &age); {
	case errors.Is(err, sqldb.ErrNoRows):
		return lag, nil // rolled back meanwhile
	case err != nil:
		return Lag{}, fmt.Errorf("forwarder: lag: row in flight: %w", err)
	}
	// Without the details (information_schema.INNODB_TRX needs the
	// PROCESS privilege, and a row written otherwise than by the
	// publisher names no writer), the row's age is the transaction's, at
	// least.
	h := Holder{PID: int(writer), State: "in a transaction", Age: time.Duration(age) * time.Microsecond}
	lag.HeldBy = &h
	if writer == 0 {
		return lag, nil
	}
	switch held, err := q.findHolder(ctx, tx, writer); {
	case err != nil && !db.Dialect().AccessDenied(err):
		return Lag{}, err
	case held != nil:
		// trx_started is to the second, rounded down: the transaction
		// has been open for at least the reading less a second, and at
		// least as long as its row.
		held.Age = max(h.Age, held.Age-time.Second)
		lag.HeldBy = held
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
// maxAge; with scheduled, the scheduled rows too (a reading without them
// leaves Scheduled and NextDue as the last reading that had them).
func (l *lagReading) measure(ctx context.Context, r *Relay, maxAge time.Duration, scheduled bool) (Lag, error) {
	if l.at.IsZero() || time.Since(l.at) >= maxAge {
		if scheduled {
			l.lag, l.err = r.Lag(ctx)
		} else {
			n, d := l.lag.Scheduled, l.lag.NextDue
			l.lag, l.err = r.db.lag.measureOutbox(ctx, r.db.db)
			l.lag.Scheduled, l.lag.NextDue = n, d
		}
		l.at = time.Now()
	}
	return l.lag, l.err
}

// reportLag measures the backlog and tells the lag hooks.
func (r *Relay) reportLag(ctx context.Context, reading *lagReading) {
	lag, err := reading.measure(ctx, r, 0, true)
	if err != nil {
		if ctx.Err() == nil {
			r.cfg.Logger.Error("Outbox lag not measured", err, nil)
		}
		return
	}
	r.hooks.OutboxLag(ctx, observe.OutboxLag{Outbox: r.outbox, Pending: lag.Pending, Waiting: lag.Waiting, OldestAge: lag.OldestAge, Scheduled: lag.Scheduled})
}
