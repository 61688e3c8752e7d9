package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/internal/pgsql"
	"github.com/oncemill/oncemill/sqlschema"
)

// postgresDialect is PostgreSQL through database/sql: pgx's stdlib or
// lib/pq. Its statements are those of dedup/postgres on the same tables
// (dedup/internal/pgsql, with the reasoning of each), sent one
// statement per call; every placeholder is $n, which both drivers take.
type postgresDialect struct{}

func (postgresDialect) schema() sqlschema.Dialect { return sqlschema.Postgres }

// sqlState is the SQLSTATE of a server's answer: *pgconn.PgError (pgx's
// stdlib) and *pq.Error (lib/pq) both have it, so neither driver is
// imported for its error type.
type sqlState interface{ SQLState() string }

func stateOf(err error) (string, bool) {
	var s sqlState
	if errors.As(err, &s) {
		return s.SQLState(), true
	}
	return "", false
}

func (postgresDialect) answered(err error) bool {
	_, ok := stateOf(err)
	return ok
}

// conflict and unavailable class the server's answer by its SQLSTATE as
// dedup/postgres does (pgsql.Class): a read-only server and tables the
// store cannot use (missing, not granted) are unavailability too.
func (postgresDialect) conflict(err error) bool {
	code, ok := stateOf(err)
	return ok && pgsql.Class(code) == dedup.ErrConflict
}

func (postgresDialect) unavailable(err error) bool {
	if code, ok := stateOf(err); ok {
		return pgsql.Class(code) == dedup.ErrUnavailable
	}
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || errors.Is(err, pgconn.ErrConnClosed) || pgconn.SafeToRetry(err)
}

func (postgresDialect) sessionEnded(err error) bool {
	code, _ := stateOf(err)
	return code == "57P01" || code == "57P02" // admin_shutdown (pg_terminate_backend too), crash_shutdown
}

// notSent is pgx's own word only: lib/pq reports an io.EOF after a
// statement was sent as driver.ErrBadConn, which therefore says nothing
// about whether it ran.
func (postgresDialect) notSent(err error) bool {
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || pgconn.SafeToRetry(err)
}

func (postgresDialect) undefinedTable(err error) bool {
	code, _ := stateOf(err)
	return pgsql.UndefinedTable(code)
}

// closed asks pgx's connection under the stdlib, or lib/pq's through
// driver.Validator.
func (postgresDialect) closed(dc any) bool {
	if c, ok := dc.(interface{ Conn() *pgx.Conn }); ok {
		return c.Conn().IsClosed()
	}
	valid, ok := validated(dc)
	return ok && !valid
}

// postgresSQL is the dialect's statements, rendered for one set of
// tables: dedup/postgres's, and a peek of its own, whose columns suit
// database/sql's scanning.
type postgresSQL struct {
	pgsql.Queries
	peek string
}

func (postgresDialect) ops(names sqlschema.Names) ops {
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts)
	return &postgresOps{sql: postgresSQL{
		Queries: pgsql.New(names),
		peek: r.Replace(`SELECT status, attempts, result, first_failed_at,
	CASE WHEN status = 'processing' AND lease_until > clock_timestamp() THEN lease_until END
FROM {T} WHERE consumer = $1 AND key = $2 AND expires_at > now()`),
	}}
}

// postgresOps runs the dialect's statements.
type postgresOps struct{ sql postgresSQL }

func (q *postgresOps) start(ctx context.Context, db *sql.DB, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	var (
		status string
		c      dedup.Claim
		first  sql.NullTime
	)
	err := db.QueryRowContext(ctx, q.sql.Start, key.Consumer, key.Key, window.Seconds()).Scan(&status, &c.Attempts, &c.Result, &first)
	if err != nil {
		if maybeSent(postgresDialect{}, err) {
			return dedup.Claim{State: dedup.StateNew}, err
		}
		return dedup.Claim{}, err
	}
	c.FirstFailedAt = first.Time
	switch status {
	case "new":
		c.State = dedup.StateNew
	case "done":
		c.State = dedup.StateDone
	default:
		c.State, c.Result = dedup.StateDead, nil
	}
	return c, nil
}

func (q *postgresOps) unstart(ctx context.Context, db *sql.DB, key dedup.Key) error {
	_, err := db.ExecContext(ctx, q.sql.Unstart, key.Consumer, key.Key)
	return err
}

// claim is dedup/postgres's claim: the INSERT … ON CONFLICT DO NOTHING
// takes a new key, waiting on a concurrent claimer's uncommitted row; the
// statement's snapshot may miss a row committed meanwhile (read it again);
// a failed key is taken by reclaim's UPDATE, which waits on the row lock.
func (q *postgresOps) claim(ctx context.Context, tx *sql.Tx, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	var (
		status   string
		attempts int
		result   []byte
		first    sql.NullTime
	)
	err := tx.QueryRowContext(ctx, q.sql.Claim, key.Consumer, key.Key, window.Seconds()).Scan(&status, &attempts, &result, &first)
	if errors.Is(err, sql.ErrNoRows) {
		err = tx.QueryRowContext(ctx, q.sql.Read, key.Consumer, key.Key).Scan(&status, &attempts, &result, &first)
	}
	if err == nil && status == "failed" {
		result = nil
		err = tx.QueryRowContext(ctx, q.sql.Reclaim, key.Consumer, key.Key, window.Seconds()).Scan(&attempts, &first)
		if err == nil {
			status = "new"
		} else if errors.Is(err, sql.ErrNoRows) {
			// Another claimer took it first and committed.
			err = tx.QueryRowContext(ctx, q.sql.Read, key.Consumer, key.Key).Scan(&status, &attempts, &result, &first)
			if err == nil && status == "failed" {
				err = errStillFailed(key)
			}
		}
	}
	if err != nil {
		return dedup.Claim{}, err
	}
	if status == "new" {
		return dedup.Claim{State: dedup.StateNew, Attempts: attempts, FirstFailedAt: first.Time}, nil
	}
	return claimOf(key, status, attempts, result, first.Time)
}

func (q *postgresOps) bury(ctx context.Context, tx *sql.Tx, key dedup.Key, f dedup.Failure) error {
	_, err := tx.ExecContext(ctx, q.sql.Bury, key.Consumer, key.Key, f.Err, f.At)
	return err
}

func (q *postgresOps) complete(ctx context.Context, tx *sql.Tx, key dedup.Key, result []byte) error {
	_, err := tx.ExecContext(ctx, q.sql.Complete, key.Consumer, key.Key, result)
	return err
}

func (q *postgresOps) fail(ctx context.Context, db *sql.DB, key dedup.Key, f dedup.Failure, window time.Duration) error {
	_, err := db.ExecContext(ctx, q.sql.Fail, key.Consumer, key.Key, f.Err, f.At, window.Seconds())
	return err
}

func (q *postgresOps) grant(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error) {
	n, err := affected(db.ExecContext(ctx, q.sql.Grant, key.Consumer, key.Key, grant))
	return n == 1, err
}

func (q *postgresOps) reopen(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error) {
	var n int
	err := db.QueryRowContext(ctx, q.sql.Reopen, key.Consumer, key.Key, grant).Scan(&n)
	return n == 1, err
}

func (q *postgresOps) granted(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error) {
	var ok bool
	err := db.QueryRowContext(ctx, q.sql.Granted, key.Consumer, key.Key, grant).Scan(&ok)
	return ok, err
}

func (q *postgresOps) deadCopy(ctx context.Context, db *sql.DB, key dedup.Key) error {
	_, err := db.ExecContext(ctx, q.sql.DeadCopy, key.Consumer, key.Key)
	return err
}

func (q *postgresOps) peek(ctx context.Context, db *sql.DB, key dedup.Key) (dedup.Claim, error) {
	var (
		status   string
		attempts int
		result   []byte
		first    sql.NullTime
		leased   sql.NullTime
	)
	err := db.QueryRowContext(ctx, q.sql.peek, key.Consumer, key.Key).Scan(&status, &attempts, &result, &first, &leased)
	if errors.Is(err, sql.ErrNoRows) {
		return dedup.Claim{State: dedup.StateNew}, nil
	}
	if err != nil {
		return dedup.Claim{}, err
	}
	return peekOf(status, attempts, result, first.Time, leased.Time), nil
}

func (q *postgresOps) hasRecord(ctx context.Context, db *sql.DB, key dedup.Key) (bool, error) {
	var ok bool
	err := db.QueryRowContext(ctx, q.sql.HasRecord, key.Consumer, key.Key).Scan(&ok)
	return ok, err
}

func (q *postgresOps) doneKeys(ctx context.Context, db *sql.DB, consumer string, since time.Time) (*sql.Rows, error) {
	return db.QueryContext(ctx, q.sql.DoneKeys, consumer, since)
}

func (q *postgresOps) deleteExpired(ctx context.Context, db *sql.DB, limit int) (int, error) {
	n, err := affected(db.ExecContext(ctx, q.sql.DeleteExpired, limit))
	return int(n), err
}
