package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/oncemill/oncemill/dedup"
)

// The classes of an error of a store's own statement, in one place for
// every dialect and driver: the infrastructure's (unavailable, a conflict
// to run again) or the statement's. They are never asked of an error a
// handler returned: its own failure is the message's whatever it wraps.

// Class returns the dedup sentinel for an infrastructure error of a call
// the store made, or nil for an error of the statement, the message or the
// caller. callerDone reports whether the context of the call that failed
// is done.
//
//   - A connect that failed is unavailability: nothing reached the server.
//   - A deadline or cancellation is the caller's own when callerDone
//     (Watermill's Timeout middleware on the message, a shutdown): the
//     message's, not the store's. One that the caller's context did not
//     cause (a timeout inside the driver or the pool) is unavailability.
//   - The server's answer is a conflict to run again (a serialization
//     failure, a deadlock, a lock wait that timed out, a busy database),
//     unavailability (shutting down, out of connections, read only, tables
//     the store cannot use: missing or not granted), or the statement's.
//   - A connection that failed is unavailability.
func (d *Dialect) Class(err error, callerDone bool) error {
	switch {
	case err == nil:
		return nil
	case dialFailed(err):
		return dedup.ErrUnavailable
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err):
		if callerDone {
			return nil
		}
		return dedup.ErrUnavailable
	case d.Conflict(err):
		return dedup.ErrConflict
	case d.unavailable(err) || d.UndefinedTable(err) || d.AccessDenied(err):
		return dedup.ErrUnavailable
	case d.answered(err):
		return nil
	case connectionError(err):
		return dedup.ErrUnavailable
	}
	return nil
}

// MaybeSent reports whether err says that a statement was sent and the
// connection failed before its answer came back, so that it may have run:
// not the server's answer, not a connect that failed, not an error the
// driver knows was raised before anything was sent, not the caller's own
// cancellation.
func (d *Dialect) MaybeSent(err error) bool {
	return err != nil && !d.answered(err) && !d.notSent(err) && !dialFailed(err) &&
		(d.unavailable(err) || connectionError(err)) &&
		!errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// SessionEnded reports whether err is the server's answer that it ended
// the session (a KILL, pg_terminate_backend, a shutdown): the session's
// transaction is gone.
func (d *Dialect) SessionEnded(err error) bool { return err != nil && d.sessionEnded(err) }

// dialFailed reports whether err is a connection that could not be made:
// nothing was sent on it.
func dialFailed(err error) bool {
	var (
		connectErr *pgconn.ConnectError
		op         *net.OpError
	)
	return errors.As(err, &connectErr) || (errors.As(err, &op) && op.Op == "dial")
}

// connectionError reports whether err says, in terms the drivers and the
// network share, that the connection failed: the driver marked it bad, it
// was closed, the socket broke or was refused, the pool was closed.
func connectionError(err error) bool {
	var netErr net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || errors.As(err, &netErr) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, puddle.ErrClosedPool) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// pgUnavailable: the server cannot serve (SQLSTATE class 08, shutting
// down, out of connections, a read-only standby), or pgx says the
// connection broke or was never made.
func pgUnavailable(err error) bool {
	switch c := pgCode(err); {
	case strings.HasPrefix(c, "08"), c == "57P01", c == "57P02", c == "57P03", c == "53300", c == "53400", c == "25006":
		return true
	case c != "":
		return false
	}
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || errors.Is(err, pgconn.ErrConnClosed) || pgconn.SafeToRetry(err)
}

// pgNotSent is pgx's own word only: lib/pq reports an io.EOF after a
// statement was sent as driver.ErrBadConn, which therefore says nothing
// about whether it ran.
func pgNotSent(err error) bool {
	var connectErr *pgconn.ConnectError
	return errors.As(err, &connectErr) || pgconn.SafeToRetry(err)
}

// pgClosed asks pgx's connection under the stdlib, or lib/pq's through
// driver.Validator.
func pgClosed(dc any) bool {
	if c, ok := dc.(interface{ Conn() *pgx.Conn }); ok {
		return c.Conn().IsClosed()
	}
	return invalidConn(dc)
}

// invalidConn asks a driver connection through driver.Validator; one that
// cannot tell is not taken for closed.
func invalidConn(dc any) bool {
	v, ok := dc.(driver.Validator)
	return ok && !v.IsValid()
}

// MySQL's and MariaDB's server error numbers that say the server cannot
// serve, or that the store may not use its tables (the operator's to put
// right, never the message's), and the client codes proxies report.
var myUnavailableNumbers = map[uint16]bool{
	1040: true, 1203: true, // too many connections, too many of the user's
	1053: true, 1927: true, // server shutdown, MariaDB's KILL of the session
	1158: true, 1159: true, 1160: true, 1161: true, // network read and write errors
	1290: true, 1792: true, 1836: true, // --read-only, a read-only transaction, read-only mode
	2006: true, 2013: true, 4031: true, // server gone, lost, disconnected for inactivity
	1146: true, 1049: true, // no such table, unknown database
	1142: true, 1143: true, 1044: true, 1045: true, 1227: true, // not granted
}

func myUnavailable(err error) bool {
	if n := myNumber(err); n != 0 {
		return myUnavailableNumbers[n]
	}
	return errors.Is(err, mysql.ErrInvalidConn) || errors.Is(err, mysql.ErrPktSync) ||
		errors.Is(err, mysql.ErrPktSyncMul) || errors.Is(err, mysql.ErrMalformPkt)
}

func mySessionEnded(err error) bool {
	switch myNumber(err) {
	case 1927, 1053, 2006, 2013, 4031:
		return true
	}
	return false
}

// sqliteUnavailable: the database cannot be written or opened (a
// read-only file or connection, a permission refused), or a table is
// missing (SQLite says so with the generic SQLITE_ERROR and a text).
func sqliteUnavailable(err error) bool {
	c, ok := sqliteCode(err)
	if !ok {
		return false
	}
	switch c & 0xff {
	case sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH, sqlite3.SQLITE_CANTOPEN:
		return true
	}
	return c&0xff == sqlite3.SQLITE_ERROR && strings.Contains(err.Error(), "no such table")
}

// onConflictUpdate is the upsert of PostgreSQL and SQLite: set is
// assigned, when where holds of the existing row, to a row that conflicts
// on the columns conflict.
func onConflictUpdate(conflict string, set [][2]string, where string) string {
	var b strings.Builder
	b.WriteString(" ON CONFLICT (" + conflict + ") DO UPDATE SET ")
	for i, s := range set {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(s[0] + " = " + s[1])
	}
	if where != "" {
		b.WriteString(" WHERE " + where)
	}
	return b.String()
}

// onDuplicateKeyUpdate is MySQL's: there is no WHERE, so each assignment
// keeps the column when where does not hold. MySQL assigns left to right,
// each assignment seeing the ones before it: a column that where reads
// must come last in set.
func onDuplicateKeyUpdate(_ string, set [][2]string, where string) string {
	var b strings.Builder
	b.WriteString(" ON DUPLICATE KEY UPDATE ")
	for i, s := range set {
		if i > 0 {
			b.WriteString(", ")
		}
		if where == "" {
			b.WriteString(s[0] + " = " + s[1])
		} else {
			b.WriteString(s[0] + " = IF(" + where + ", " + s[1] + ", " + s[0] + ")")
		}
	}
	return b.String()
}
