package sqlstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-sql-driver/mysql"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlDialect is MySQL 8.0+ and MariaDB 10.6+ through
// go-sql-driver/mysql, on InnoDB. It has no RETURNING (MySQL 8), no
// ON CONFLICT and no data-modifying CTE, so where dedup/postgres answers
// in one statement it takes two, each of which keeps the same guarantee:
//
//   - A claim is INSERT … ON DUPLICATE KEY UPDATE. A new key's row is
//     inserted as done, visible only at commit; a concurrent claimer's
//     duplicate check waits on that uncommitted row (ODKU asks for an
//     exclusive lock), then sees it done, or inserts it itself if the
//     first rolled back. A failed key is taken by the update half under
//     that same row lock, so of many claimers of a failed key one takes
//     it and the others, queued on the lock, find it done. The statement
//     reports what it did through LAST_INSERT_ID(expr), documented to be
//     the statement's insert id: the attempt count when it took the key,
//     0 when it did not (then one locking read returns the record).
//   - A start reads the record (a consistent read: it never waits on a
//     claim in flight) and then counts the attempt with an upsert that
//     also reports the count through LAST_INSERT_ID(expr). A key that
//     becomes done between the two is counted once more and found done
//     by its claim; the count is swept with the record.
//   - Sweeping selects expired rows FOR UPDATE SKIP LOCKED in a READ
//     COMMITTED transaction (no gap locks), then deletes them one by one
//     by their primary key, which looks at no other row.
//
// Every time is UTC_TIMESTAMP(6) or a Go time sent as microseconds since
// the epoch, read back the same way, so neither the session's time zone
// nor the DSN's parseTime and loc matter. Every statement is correct with
// or without interpolateParams and clientFoundRows.
type mysqlDialect struct{}

func (mysqlDialect) schema() sqlschema.Dialect { return sqlschema.MySQL }

// Server error numbers (MySQL's and MariaDB's share them).
const (
	erCheckRead             = 1020 // MariaDB's snapshot isolation: record changed since last read
	erConCount              = 1040 // too many connections
	erDBAccessDenied        = 1044 // the user may not use the database
	erAccessDenied          = 1045 // the user's login was refused
	erBadDB                 = 1049 // unknown database
	erServerShutdown        = 1053
	erTableAccessDenied     = 1142 // a command on a table not granted
	erColumnAccessDenied    = 1143
	erNoSuchTable           = 1146
	erSpecificAccessDenied  = 1227 // a privilege the user lacks
	erNetReadError          = 1158
	erNetReadInterrupted    = 1159
	erNetErrorOnWrite       = 1160
	erNetWriteInterrupted   = 1161
	erTooManyUserConns      = 1203
	erLockWaitTimeout       = 1205
	erLockDeadlock          = 1213
	erOptionPrevents        = 1290 // --read-only
	erReadOnlyTransaction   = 1792
	erReadOnlyMode          = 1836
	erConnectionKilled      = 1927 // MariaDB: KILL of the session
	crServerGone            = 2006 // client codes, as proxies report them
	crServerLost            = 2013
	erClientInteractionTime = 4031 // MySQL 8: disconnected by the server for inactivity
)

func mysqlNumber(err error) (uint16, bool) {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number, true
	}
	return 0, false
}

func (mysqlDialect) answered(err error) bool {
	_, ok := mysqlNumber(err)
	return ok
}

// conflict: InnoDB rolls a deadlock's whole transaction back; a lock wait
// timeout only the statement (unless innodb_rollback_on_timeout), and the
// inbox rolls the rest back before it runs the transaction again.
func (mysqlDialect) conflict(err error) bool {
	n, _ := mysqlNumber(err)
	return n == erLockDeadlock || n == erLockWaitTimeout || n == erCheckRead
}

func (d mysqlDialect) unavailable(err error) bool {
	if n, ok := mysqlNumber(err); ok {
		switch n {
		case erConCount, erTooManyUserConns, erServerShutdown, erConnectionKilled,
			erNetReadError, erNetReadInterrupted, erNetErrorOnWrite, erNetWriteInterrupted,
			erOptionPrevents, erReadOnlyTransaction, erReadOnlyMode,
			crServerGone, crServerLost, erClientInteractionTime,
			// Tables the store cannot use, missing or not granted to its
			// user: the operator's to put right, never the message's.
			erNoSuchTable, erBadDB, erTableAccessDenied, erColumnAccessDenied,
			erDBAccessDenied, erAccessDenied, erSpecificAccessDenied:
			return true
		}
		return false
	}
	return errors.Is(err, mysql.ErrInvalidConn) || errors.Is(err, mysql.ErrPktSync) ||
		errors.Is(err, mysql.ErrPktSyncMul) || errors.Is(err, mysql.ErrMalformPkt)
}

func (mysqlDialect) sessionEnded(err error) bool {
	n, _ := mysqlNumber(err)
	return n == erConnectionKilled || n == erServerShutdown || n == crServerGone || n == crServerLost ||
		n == erClientInteractionTime
}

// notSent: go-sql-driver/mysql returns driver.ErrBadConn only when nothing
// of the command was written.
func (mysqlDialect) notSent(err error) bool { return errors.Is(err, driver.ErrBadConn) }

func (mysqlDialect) undefinedTable(err error) bool {
	n, _ := mysqlNumber(err)
	return n == erNoSuchTable || n == erBadDB
}

func (mysqlDialect) closed(dc any) bool {
	valid, ok := validated(dc)
	return ok && !valid
}

// The columns' sizes (sqlschema/mysql/001_inbox.up.sql).
const (
	mysqlMaxConsumer = 255
	mysqlMaxKey      = 1024
	mysqlMaxText     = 65535 // TEXT, in bytes
)

// stored is the form of a consumer or key in a column of max bytes: the
// value itself, or when it is longer its SHA-256 digest, so that a long
// key is neither refused (its message could never be dead-lettered) nor
// truncated (two keys would become one).
func stored(s string, max int) string {
	if len(s) <= max {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func storedKey(key dedup.Key) (string, string) {
	return stored(key.Consumer, mysqlMaxConsumer), stored(key.Key, mysqlMaxKey)
}

// MySQLStoredKey returns key as the MySQL inbox table holds it: a consumer
// over 255 bytes or a key over 1024 bytes (their columns' sizes) as its
// SHA-256 digest, "sha256:" and 64 hex digits, anything else as it is.
// Whatever reads that table by key (reconcile, say) looks the key up in
// this form.
func MySQLStoredKey(key dedup.Key) dedup.Key {
	c, k := storedKey(key)
	return dedup.Key{Consumer: c, Key: k}
}

// text cuts an error text to what a TEXT column holds, on a rune boundary.
func text(s string) string {
	if len(s) <= mysqlMaxText {
		return s
	}
	s = s[:mysqlMaxText]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// epoch is the zero of the microsecond counts the statements exchange.
var epoch = time.Unix(0, 0).UTC()

func micros(t time.Time) int64 {
	if t.Before(epoch) {
		return 0
	}
	return t.UnixMicro()
}

func fromMicros(n sql.NullInt64) time.Time {
	if !n.Valid {
		return time.Time{}
	}
	return time.UnixMicro(n.Int64)
}

// mysqlSQL is the dialect's statements, rendered for one set of tables.
type mysqlSQL struct {
	startRead, start, unstart, claim, claimRead, claimFirstFailed, clearStart string
	bury, complete, fail, grant, granted, reopen, deadCopy                    string
	peek, hasRecord, doneKeys                                                 string
	expiredStarts, expired, deleteStart, deleteRecord                         string
}

func (mysqlDialect) ops(names sqlschema.Names) ops {
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts,
		"{NOW}", "UTC_TIMESTAMP(6)",
		"{AT}", "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')",
		"{US}", "TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', ")
	return &mysqlOps{sql: mysqlSQL{
		// A consistent read: it does not wait for a claim in flight.
		// Arguments: consumer, key.
		startRead: r.Replace("SELECT status, attempts, result, {US}first_failed_at) FROM {T}\n" +
			"WHERE consumer = ? AND `key` = ? AND status IN ('done', 'dead')"),

		// The insert id is the count. Arguments: consumer, key, window
		// (µs) twice.
		start: r.Replace("INSERT INTO {S} (consumer, `key`, started, expires_at)\n" +
			"VALUES (?, ?, LAST_INSERT_ID(1), {NOW} + INTERVAL ? MICROSECOND)\n" +
			"ON DUPLICATE KEY UPDATE started = LAST_INSERT_ID(started + 1), expires_at = {NOW} + INTERVAL ? MICROSECOND"),

		// Arguments: consumer, key.
		unstart: r.Replace("UPDATE {S} SET started = started - 1 WHERE consumer = ? AND `key` = ? AND started > 0"),

		// The row is written as done at once, visible at commit. A
		// failed row is taken by the update half; a done, dead or leased
		// one is left as it is. MySQL assigns left to right, each
		// assignment seeing the ones before it, so status goes last and
		// every test reads the old one. The insert id is the attempt
		// count when the key was taken, 0 (LAST_INSERT_ID(0)) when not.
		// Arguments: consumer, key, window (µs) twice.
		claim: r.Replace("INSERT INTO {T} (consumer, `key`, status, attempts, created_at, updated_at, done_at, expires_at)\n" +
			"VALUES (?, ?, 'done', LAST_INSERT_ID(1), {NOW}, {NOW}, {NOW}, {NOW} + INTERVAL ? MICROSECOND)\n" +
			"ON DUPLICATE KEY UPDATE\n" +
			"    lease_until = IF(status = 'failed', NULL, lease_until),\n" +
			"    updated_at = IF(status = 'failed', {NOW}, updated_at),\n" +
			"    done_at = IF(status = 'failed', {NOW}, done_at),\n" +
			"    expires_at = IF(status = 'failed', {NOW} + INTERVAL ? MICROSECOND, expires_at),\n" +
			"    attempts = IF(status = 'failed', LAST_INSERT_ID(attempts + 1), attempts + LAST_INSERT_ID(0)),\n" +
			"    status = IF(status = 'failed', 'done', status)"),

		// The record the claim did not take, which it holds locked: a
		// locking read returns its latest version whatever the
		// transaction's snapshot. Arguments: consumer, key.
		claimRead: r.Replace("SELECT status, attempts, result, {US}first_failed_at) FROM {T}\n" +
			"WHERE consumer = ? AND `key` = ? FOR UPDATE"),

		// Arguments: consumer, key.
		claimFirstFailed: r.Replace("SELECT {US}first_failed_at) FROM {T} WHERE consumer = ? AND `key` = ?"),

		// The start count goes with the claim's commit; a rollback or a
		// crash keeps it. Arguments: consumer, key.
		clearStart: r.Replace("DELETE FROM {S} WHERE consumer = ? AND `key` = ?"),

		// The claim that took the key for burying counted itself as an
		// attempt; the bury takes that back, and clears the grant.
		// Arguments: error, failed at (µs), error, failed at (µs),
		// consumer, key.
		bury: r.Replace("UPDATE {T} SET status = 'dead', dead_at = {NOW}, result = NULL, done_at = NULL,\n" +
			"    attempts = GREATEST(attempts - 1, 0), replay_grant = NULL,\n" +
			"    first_error = COALESCE(first_error, ?), first_failed_at = COALESCE(first_failed_at, {AT}),\n" +
			"    last_error = ?, last_failed_at = {AT}, updated_at = {NOW}\n" +
			"WHERE consumer = ? AND `key` = ?"),

		// Arguments: result, consumer, key.
		complete: r.Replace("UPDATE {T} SET result = ? WHERE consumer = ? AND `key` = ?"),

		// A done or dead row is left as it is (status assigned last, as
		// in claim). Arguments: consumer, key, error, error, failed at
		// (µs) twice, window (µs), error, failed at (µs), error, failed
		// at (µs), window (µs).
		fail: r.Replace("INSERT INTO {T} (consumer, `key`, status, attempts, first_error, last_error,\n" +
			"    first_failed_at, last_failed_at, created_at, updated_at, expires_at)\n" +
			"VALUES (?, ?, 'failed', 1, ?, ?, {AT}, {AT}, {NOW}, {NOW}, {NOW} + INTERVAL ? MICROSECOND)\n" +
			"ON DUPLICATE KEY UPDATE\n" +
			"    attempts = IF(status IN ('done', 'dead'), attempts, attempts + 1),\n" +
			"    lease_until = IF(status IN ('done', 'dead'), lease_until, NULL),\n" +
			"    first_error = IF(status IN ('done', 'dead'), first_error, COALESCE(first_error, ?)),\n" +
			"    first_failed_at = IF(status IN ('done', 'dead'), first_failed_at, COALESCE(first_failed_at, {AT})),\n" +
			"    last_error = IF(status IN ('done', 'dead'), last_error, ?),\n" +
			"    last_failed_at = IF(status IN ('done', 'dead'), last_failed_at, {AT}),\n" +
			"    updated_at = IF(status IN ('done', 'dead'), updated_at, {NOW}),\n" +
			"    expires_at = IF(status IN ('done', 'dead'), expires_at, {NOW} + INTERVAL ? MICROSECOND),\n" +
			"    status = IF(status IN ('done', 'dead'), status, 'failed')"),

		// Arguments: grant, consumer, key.
		grant: r.Replace("UPDATE {T} SET replay_grant = ?, updated_at = {NOW}\n" +
			"WHERE consumer = ? AND `key` = ? AND status = 'dead'"),

		// Arguments: consumer, key, grant.
		granted: r.Replace("SELECT COUNT(*) FROM {T} WHERE consumer = ? AND `key` = ? AND replay_grant = ?"),

		// Run with deleteStart in one transaction. Arguments: consumer,
		// key, grant.
		reopen: r.Replace("UPDATE {T} SET status = 'failed', attempts = 0, dead_at = NULL, lease_until = NULL, updated_at = {NOW}\n" +
			"WHERE consumer = ? AND `key` = ? AND status = 'dead' AND replay_grant = ?"),

		// Arguments: consumer, key.
		deadCopy: r.Replace("UPDATE {T} SET dead_copies = dead_copies + 1 WHERE consumer = ? AND `key` = ? AND status = 'dead'"),

		// The committed row only (a consistent read). Arguments:
		// consumer, key.
		peek: r.Replace("SELECT status, attempts, result, {US}first_failed_at),\n" +
			"    CASE WHEN status = 'processing' AND lease_until > {NOW} THEN {US}lease_until) END\n" +
			"FROM {T} WHERE consumer = ? AND `key` = ? AND expires_at > {NOW}"),

		// Any row, expired or not: a claim reads the row until cleanup
		// deletes it. Arguments: consumer, key.
		hasRecord: r.Replace("SELECT COUNT(*) FROM {T} WHERE consumer = ? AND `key` = ?"),

		// Arguments: consumer, since (µs).
		doneKeys: r.Replace("SELECT `key` FROM {T}\n" +
			"WHERE consumer = ? AND status = 'done' AND done_at >= {AT} AND expires_at > {NOW}"),

		// In a READ COMMITTED transaction: rows another transaction holds
		// are skipped, and no gap is locked. Argument: limit.
		expiredStarts: r.Replace("SELECT consumer, `key` FROM {S} WHERE expires_at < {NOW}\n" +
			"ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"),
		expired: r.Replace("SELECT consumer, `key` FROM {T} WHERE expires_at < {NOW}\n" +
			"ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"),

		// Deletes one row by its key: an exact lookup of the primary
		// key, which looks at no other row. A statement naming many rows
		// may be planned as a scan (on a small table), and a scan waits
		// on the rows another transaction holds, the ones SKIP LOCKED
		// left out. Arguments: consumer, key.
		deleteStart:  r.Replace("DELETE FROM {S} WHERE consumer = ? AND `key` = ?"),
		deleteRecord: r.Replace("DELETE FROM {T} WHERE consumer = ? AND `key` = ?"),
	}}
}

// mysqlOps runs the dialect's statements.
type mysqlOps struct{ sql mysqlSQL }

func (q *mysqlOps) start(ctx context.Context, db *sql.DB, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	consumer, k := storedKey(key)
	var (
		status string
		c      dedup.Claim
		first  sql.NullInt64
	)
	err := db.QueryRowContext(ctx, q.sql.startRead, consumer, k).Scan(&status, &c.Attempts, &c.Result, &first)
	switch {
	case err == nil:
		c.FirstFailedAt = fromMicros(first)
		c.State = dedup.StateDone
		if status == "dead" {
			c.State, c.Result = dedup.StateDead, nil
		}
		return c, nil
	case !errors.Is(err, sql.ErrNoRows):
		return dedup.Claim{}, err
	}
	w := window.Microseconds()
	res, err := db.ExecContext(ctx, q.sql.start, consumer, k, w, w)
	if err != nil {
		if maybeSent(mysqlDialect{}, err) {
			return dedup.Claim{State: dedup.StateNew}, err
		}
		return dedup.Claim{}, err
	}
	n, err := res.LastInsertId()
	if err != nil {
		return dedup.Claim{State: dedup.StateNew}, err
	}
	return dedup.Claim{State: dedup.StateNew, Attempts: int(n)}, nil
}

func (q *mysqlOps) unstart(ctx context.Context, db *sql.DB, key dedup.Key) error {
	consumer, k := storedKey(key)
	_, err := db.ExecContext(ctx, q.sql.unstart, consumer, k)
	return err
}

func (q *mysqlOps) claim(ctx context.Context, tx *sql.Tx, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	consumer, k := storedKey(key)
	w := window.Microseconds()
	res, err := tx.ExecContext(ctx, q.sql.claim, consumer, k, w, w)
	if err != nil {
		return dedup.Claim{}, err
	}
	attempts, err := res.LastInsertId()
	if err != nil {
		return dedup.Claim{}, err
	}
	if attempts == 0 {
		// Not taken: done, dead or leased. The row is locked by this
		// transaction since the claim.
		var (
			status string
			n      int
			result []byte
			first  sql.NullInt64
		)
		if err := tx.QueryRowContext(ctx, q.sql.claimRead, consumer, k).Scan(&status, &n, &result, &first); err != nil {
			return dedup.Claim{}, err
		}
		if status == "failed" {
			return dedup.Claim{}, errStillFailed(key)
		}
		return claimOf(key, status, n, result, fromMicros(first))
	}
	c := dedup.Claim{State: dedup.StateNew, Attempts: int(attempts)}
	// An insert affects one row, an update that took a failed key two,
	// whatever clientFoundRows says (the update always changes the row).
	changed, err := res.RowsAffected()
	if err != nil {
		return dedup.Claim{}, err
	}
	if changed == 2 {
		var first sql.NullInt64
		if err := tx.QueryRowContext(ctx, q.sql.claimFirstFailed, consumer, k).Scan(&first); err != nil {
			return dedup.Claim{}, err
		}
		c.FirstFailedAt = fromMicros(first)
	}
	if _, err := tx.ExecContext(ctx, q.sql.clearStart, consumer, k); err != nil {
		return dedup.Claim{}, err
	}
	return c, nil
}

func (q *mysqlOps) bury(ctx context.Context, tx *sql.Tx, key dedup.Key, f dedup.Failure) error {
	consumer, k := storedKey(key)
	e, at := text(f.Err), micros(f.At)
	_, err := tx.ExecContext(ctx, q.sql.bury, e, at, e, at, consumer, k)
	return err
}

func (q *mysqlOps) complete(ctx context.Context, tx *sql.Tx, key dedup.Key, result []byte) error {
	consumer, k := storedKey(key)
	_, err := tx.ExecContext(ctx, q.sql.complete, result, consumer, k)
	return err
}

func (q *mysqlOps) fail(ctx context.Context, db *sql.DB, key dedup.Key, f dedup.Failure, window time.Duration) error {
	consumer, k := storedKey(key)
	e, at, w := text(f.Err), micros(f.At), window.Microseconds()
	_, err := db.ExecContext(ctx, q.sql.fail, consumer, k, e, e, at, at, w, e, at, e, at, w)
	return err
}

func (q *mysqlOps) grant(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error) {
	consumer, k := storedKey(key)
	n, err := affected(db.ExecContext(ctx, q.sql.grant, grant, consumer, k))
	return n == 1, err
}

// reopen updates the record and forgets the started attempts in one
// transaction: a reopened key that kept its old starts would be taken for
// a crash loop at its replay.
func (q *mysqlOps) reopen(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (reopened bool, err error) {
	consumer, k := storedKey(key)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	defer func() {
		if !reopened {
			if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
				err = errors.Join(err, rbErr)
			}
		}
	}()
	n, err := affected(tx.ExecContext(ctx, q.sql.reopen, consumer, k, grant))
	if err != nil || n != 1 {
		return false, err
	}
	if _, err := tx.ExecContext(ctx, q.sql.clearStart, consumer, k); err != nil {
		return false, err
	}
	if err := tx.Commit(); err != nil {
		return false, err
	}
	return true, nil
}

func (q *mysqlOps) granted(ctx context.Context, db *sql.DB, key dedup.Key, grant string) (bool, error) {
	consumer, k := storedKey(key)
	var n int
	err := db.QueryRowContext(ctx, q.sql.granted, consumer, k, grant).Scan(&n)
	return n > 0, err
}

func (q *mysqlOps) deadCopy(ctx context.Context, db *sql.DB, key dedup.Key) error {
	consumer, k := storedKey(key)
	_, err := db.ExecContext(ctx, q.sql.deadCopy, consumer, k)
	return err
}

func (q *mysqlOps) peek(ctx context.Context, db *sql.DB, key dedup.Key) (dedup.Claim, error) {
	consumer, k := storedKey(key)
	var (
		status   string
		attempts int
		result   []byte
		first    sql.NullInt64
		leased   sql.NullInt64
	)
	err := db.QueryRowContext(ctx, q.sql.peek, consumer, k).Scan(&status, &attempts, &result, &first, &leased)
	if errors.Is(err, sql.ErrNoRows) {
		return dedup.Claim{State: dedup.StateNew}, nil
	}
	if err != nil {
		return dedup.Claim{}, err
	}
	return peekOf(status, attempts, result, fromMicros(first), fromMicros(leased)), nil
}

func (q *mysqlOps) hasRecord(ctx context.Context, db *sql.DB, key dedup.Key) (bool, error) {
	consumer, k := storedKey(key)
	var n int
	err := db.QueryRowContext(ctx, q.sql.hasRecord, consumer, k).Scan(&n)
	return n > 0, err
}

func (q *mysqlOps) doneKeys(ctx context.Context, db *sql.DB, consumer string, since time.Time) (*sql.Rows, error) {
	return db.QueryContext(ctx, q.sql.doneKeys, stored(consumer, mysqlMaxConsumer), micros(since))
}

func (q *mysqlOps) deleteExpired(ctx context.Context, db *sql.DB, limit int) (deleted int, err error) {
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, err
	}
	defer func() {
		if err != nil {
			if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
				err = errors.Join(err, rbErr)
			}
		}
	}()
	if _, err := deleteLocked(ctx, tx, q.sql.expiredStarts, q.sql.deleteStart, limit); err != nil {
		return 0, err
	}
	n, err := deleteLocked(ctx, tx, q.sql.expired, q.sql.deleteRecord, limit)
	if err != nil {
		return 0, err
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	return n, nil
}

// deleteLocked locks at most limit rows with the query selectExpired
// (consumer and key), skipping those another transaction holds, and
// deletes them one by one with del, prepared once, in tx.
func deleteLocked(ctx context.Context, tx *sql.Tx, selectExpired, del string, limit int) (int, error) {
	rows, err := tx.QueryContext(ctx, selectExpired, limit)
	if err != nil {
		return 0, err
	}
	var keys [][2][]byte
	for rows.Next() {
		var k [2][]byte
		if err := rows.Scan(&k[0], &k[1]); err != nil {
			rows.Close()
			return 0, err
		}
		keys = append(keys, k)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil || len(keys) == 0 {
		return 0, err
	}
	stmt, err := tx.PrepareContext(ctx, del)
	if err != nil {
		return 0, err
	}
	deleted := 0
	for _, k := range keys {
		n, err := affected(stmt.ExecContext(ctx, k[0], k[1]))
		if err != nil {
			return deleted, errors.Join(err, stmt.Close())
		}
		deleted += int(n)
	}
	return deleted, stmt.Close()
}
