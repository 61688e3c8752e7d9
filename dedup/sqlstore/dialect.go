package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/sqlschema"
)

// Dialect is a database family the store speaks: its statements and how
// its drivers report errors, each dialect in a file of its own. Use
// [Postgres] or [MySQL]; the zero Dialect is refused by [Config.Validate].
type Dialect struct{ d dialect }

var (
	// Postgres is PostgreSQL 13 or newer through pgx's stdlib
	// (github.com/jackc/pgx/v5/stdlib) or lib/pq, on the tables of
	// [sqlschema.Postgres]: the same tables and statements as
	// dedup/postgres, so the two stores may share them.
	Postgres = Dialect{postgresDialect{}}
	// MySQL is MySQL 8.0 or newer, or MariaDB 10.6 or newer, through
	// go-sql-driver/mysql, on the InnoDB tables of [sqlschema.MySQL].
	MySQL = Dialect{mysqlDialect{}}
)

// String returns the dialect's name: "postgres" or "mysql".
func (d Dialect) String() string {
	if d.d == nil {
		return "none"
	}
	return string(d.d.schema())
}

// Schema returns the [sqlschema.Dialect] whose migrations create the
// dialect's tables, for [sqlschema.MigrateSQL].
func (d Dialect) Schema() sqlschema.Dialect {
	if d.d == nil {
		return ""
	}
	return d.d.schema()
}

// dialect is one database family: its statements for a set of tables and
// its drivers' errors. The store decides the class of an error from these
// answers alone, in one place ([Store.interpret], [classify]).
type dialect interface {
	// schema is the family's migrations.
	schema() sqlschema.Dialect
	// ops renders the family's statements for the tables names.
	ops(names sqlschema.Names) ops

	// answered reports whether err is the server's own answer to a
	// statement, so that the statement's outcome is known (it failed).
	answered(err error) bool
	// conflict reports whether the server aborted the statement or the
	// transaction for a conflict with another transaction: a
	// serialization failure, a deadlock, a lock wait that timed out. The
	// transaction can run again at once.
	conflict(err error) bool
	// unavailable reports whether the server answered that it cannot
	// serve (shutting down, out of connections, read-only after a
	// failover) or that the store cannot use its own tables (missing, or
	// not granted to its user), or the driver says the connection
	// failed. It is asked of the store's own statements only.
	unavailable(err error) bool
	// sessionEnded reports whether err is the server's answer that the
	// session itself ended (it was killed, the server shut down): the
	// transaction on it is gone, even if the driver has not closed the
	// connection yet.
	sessionEnded(err error) bool
	// notSent reports whether the driver says that nothing of the
	// statement reached the server, so that it did not run.
	notSent(err error) bool
	// undefinedTable reports whether the server answered that a table
	// or the schema does not exist.
	undefinedTable(err error) bool
	// closed reports whether the driver connection dc (what
	// [sql.Conn.Raw] hands over) is closed or broken.
	closed(dc any) bool
}

// ops is what the store does on its database, for one set of tables.
// Methods return the driver's errors as they are; the store interprets
// them. Keys are the callers' keys: an implementation that stores them
// otherwise (MySQL's digest of a long key) does so itself.
type ops interface {
	// start counts an attempt of key unless it is done or dead, and
	// answers a done or dead key (see dedup.TxStore.InboxStart). With an
	// error, it returns a Claim whose State is StateNew when the counting
	// statement was sent and may have run, else the zero Claim.
	start(ctx context.Context, db *sql.DB, key dedup.Key, window time.Duration) (dedup.Claim, error)
	// unstart takes back one started attempt of key.
	unstart(ctx context.Context, db *sql.DB, key dedup.Key) error
	// claim claims key in tx (see dedup.InboxTx.InboxClaim), deleting
	// its start count in tx when it takes the key.
	claim(ctx context.Context, tx *sql.Tx, key dedup.Key, window time.Duration) (dedup.Claim, error)
	// bury marks the claimed key dead in tx.
	bury(ctx context.Context, tx *sql.Tx, key dedup.Key, f dedup.Failure) error
	// complete stores result with the claimed key in tx.
	complete(ctx context.Context, tx *sql.Tx, key dedup.Key, result []byte) error
	// fail records a failed attempt, leaving a done or dead key alone.
	fail(ctx context.Context, db *sql.DB, key dedup.Key, f dedup.Failure, window time.Duration) error
	// grant writes grant on a dead key, reporting whether it was dead.
	grant(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error)
	// reopen makes a dead key whose grant is grant failed again with its
	// counts reset, and forgets its started attempts, at once.
	reopen(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error)
	// granted reports whether key's record holds grant.
	granted(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error)
	// deadCopy counts a copy of a dead key.
	deadCopy(ctx context.Context, db *sql.DB, key dedup.Key) error
	// peek reads key's committed, unexpired record (see dedupdriver.Peeker).
	peek(ctx context.Context, db *sql.DB, key dedup.Key) (dedup.Claim, error)
	// hasRecord reports whether key has a record, expired or not.
	hasRecord(ctx context.Context, db *sql.DB, key dedup.Key) (bool, error)
	// doneKeys queries the keys of consumer done at or after since and
	// not expired: one column, the stored key.
	doneKeys(ctx context.Context, db *sql.DB, consumer string, since time.Time) (*sql.Rows, error)
	// deleteExpired deletes at most limit expired records (and at most
	// limit expired start counts), never waiting for a row another
	// transaction holds, and returns how many records it deleted.
	deleteExpired(ctx context.Context, db *sql.DB, limit int) (int, error)
}

// classify returns the dedup sentinel for an infrastructure error of the
// store's own call, or nil for an error of the statement, the message or
// the caller. callerDone reports whether the context of the call that
// failed is done.
//
//   - A deadline or cancellation is the caller's own when callerDone
//     (Watermill's Timeout middleware on the message, a shutdown): the
//     message's, not the store's. One that the caller's context did not
//     cause (a timeout inside the driver) is unavailability.
//   - A conflict the server reports is a conflict to run again.
//   - The server's answer that it cannot serve, and a connection that
//     failed, are unavailability; any other answer of the server is the
//     statement's.
func classify(d dialect, err error, callerDone bool) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		if callerDone {
			return nil
		}
		return dedup.ErrUnavailable
	case d.conflict(err):
		return dedup.ErrConflict
	case d.unavailable(err):
		return dedup.ErrUnavailable
	case d.answered(err):
		return nil
	case connectionError(err):
		return dedup.ErrUnavailable
	}
	return nil
}

// maybeSent reports whether err says that a statement was sent and the
// connection failed before its answer came back, so that it may have run.
func maybeSent(d dialect, err error) bool {
	return !d.answered(err) && !d.notSent(err) && !dialFailed(err) && (d.unavailable(err) || connectionError(err)) &&
		!errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// dialFailed reports whether err is a connection that could not be made:
// nothing was sent on it.
func dialFailed(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// connectionError reports whether err says, in terms database/sql and the
// network share across drivers, that the connection failed: the driver
// marked it bad, it was closed, the socket broke or was refused. It is
// asked of the store's own calls only, never of a handler's error.
func connectionError(err error) bool {
	var netErr net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// validated reports whether dc, a driver connection, says it is valid
// through database/sql's driver.Validator; ok is false when it cannot tell.
func validated(dc any) (valid, ok bool) {
	v, ok := dc.(driver.Validator)
	if !ok {
		return false, false
	}
	return v.IsValid(), true
}

// claimOf is the Claim of a key's record read in a claim's transaction.
func claimOf(key dedup.Key, status string, attempts int, result []byte, firstFailed time.Time) (dedup.Claim, error) {
	c := dedup.Claim{Attempts: attempts, FirstFailedAt: firstFailed}
	switch status {
	case "done":
		c.State, c.Result = dedup.StateDone, result
	case "dead":
		c.State = dedup.StateDead
	default:
		return dedup.Claim{}, errLeaseMode(key, status)
	}
	return c, nil
}

// errLeaseMode is the error of a transactional claim that finds a key held
// in lease mode (dedup/postgres's leases, on tables the stores share).
func errLeaseMode(key dedup.Key, status string) error {
	return fmt.Errorf("key %q of consumer %q is %q: it is claimed in lease mode; use one mode per consumer", key.Key, key.Consumer, status)
}

// peekOf is the Claim of a key's committed record, read without a claim.
func peekOf(status string, attempts int, result []byte, firstFailed time.Time, leasedUntil time.Time) dedup.Claim {
	c := dedup.Claim{Attempts: attempts, FirstFailedAt: firstFailed}
	switch {
	case status == "done":
		c.State, c.Result = dedup.StateDone, result
	case status == "dead":
		c.State = dedup.StateDead
	case !leasedUntil.IsZero():
		c.State, c.Until = dedup.StateInFlight, leasedUntil
	default:
		c.State = dedup.StateNew
	}
	return c
}

// affected returns a result's rows affected, for statements whose count
// says what they did.
func affected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// errStillFailed is the error of a claim that waited for a concurrent
// claimer of a failed key and found it failed still: the other rolled
// back its claim after this one looked.
func errStillFailed(key dedup.Key) error {
	return fmt.Errorf("key %q of consumer %q is still failed after a concurrent claim", key.Key, key.Consumer)
}
