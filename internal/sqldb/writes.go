package sqldb

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

// InsertOnce is the clause that ends an INSERT whose row a unique index
// may refuse, so that the refused row is silently not written: ON
// CONFLICT target DO NOTHING, or on MySQL, whose unique indexes are not
// partial and which has no DO NOTHING, an ON DUPLICATE KEY UPDATE that
// sets column to itself. target is the conflict target (a column list and
// an optional WHERE of a partial index); column any column of the table.
// Of two writers of one row at once, the later waits for the earlier's
// commit and then writes nothing.
func (d *Dialect) InsertOnce(target, column string) string { return d.insertOnce(target, column) }

// LockRow is the clause that ends a SELECT whose rows the transaction
// locks (FOR UPDATE, with skip for SKIP LOCKED), or "" where the
// database has no row locks: SQLite's one writer locks the whole
// database, and its readers hold nothing.
func (d *Dialect) LockRow(skip bool) string {
	switch {
	case !d.SkipLocked:
		return ""
	case skip:
		return " FOR UPDATE SKIP LOCKED"
	}
	return " FOR UPDATE"
}

// JSONInts is a subquery of the integers of ph, a JSON array of integers:
// a list of any length in one parameter.
func (d *Dialect) JSONInts(ph string) string { return d.jsonInts(ph) }

// ByIDs returns a statement on the rows of table whose id is in the JSON
// array of integers that is its first parameter: a DELETE when set is
// empty, else an UPDATE … SET set. cond, when not empty, further selects
// the rows (on their columns, unqualified). Each row is reached through
// the primary key, also on MySQL, whose optimizer may scan a small table
// rather than use the key for an IN list, and a DELETE that scans waits
// on every row another transaction holds.
func (d *Dialect) ByIDs(table, set, cond string) string {
	var q string
	if d.joinIDs {
		from := idsJoin(table)
		q = "DELETE t FROM " + from
		if set != "" {
			q = "UPDATE " + from + " SET " + set
		}
		if cond != "" {
			q += " WHERE " + cond
		}
		return q
	}
	q = "DELETE FROM " + table
	if set != "" {
		q = "UPDATE " + table + " SET " + set
	}
	q += " WHERE id IN (" + d.JSONInts("?") + ")"
	if cond != "" {
		q += " AND " + cond
	}
	return q
}

// FromIDs is the FROM clause (with its WHERE, if any) of a SELECT of the
// rows of table, as t, whose id is in the JSON array of integers that is
// its parameter, each reached through the primary key as in [Dialect.ByIDs]. A
// statement may go on with ORDER BY.
func (d *Dialect) FromIDs(table string) string {
	if d.joinIDs {
		return " FROM " + idsJoin(table)
	}
	return " FROM " + table + " AS t WHERE t.id IN (" + d.JSONInts("?") + ")"
}

// idsJoin is the join of a JSON array of ids, the parameter, to the rows
// of table, as t, through the primary key, where a dialect reaches rows so
// (MySQL): STRAIGHT_JOIN keeps the optimizer from scanning a small table
// instead.
func idsJoin(table string) string {
	return "JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) AS j STRAIGHT_JOIN " + table + " AS t ON t.id = j.id"
}

// UpdateFrom returns an UPDATE of table AS a that reads table AS b: each
// of set is "column = expression", the column a's (unqualified), the
// expression on a.* and b.*; where selects the pair.
func (d *Dialect) UpdateFrom(table string, set []string, where string) string {
	if d.updateJoin {
		qualified := make([]string, len(set))
		for i, s := range set {
			qualified[i] = "a." + s
		}
		return "UPDATE " + table + " AS a, " + table + " AS b SET " + strings.Join(qualified, ", ") + " WHERE " + where
	}
	return "UPDATE " + table + " AS a SET " + strings.Join(set, ", ") + " FROM " + table + " AS b WHERE " + where
}

// UndefinedColumn reports whether err is the server's answer that a
// column does not exist: a table of an older migration.
func (d *Dialect) UndefinedColumn(err error) bool { return err != nil && d.undefCol(err) }

// Identity is what a session's server says of the database the session
// is on, whatever host name it connected to.
type Identity struct {
	// Database names the database a transaction can write in: a
	// PostgreSQL server's start time and database, a MySQL server (whose
	// transactions span its databases), a SQLite file.
	Database string
	// System is PostgreSQL's system identifier, "" where the role may
	// not read it.
	System string
}

// Same reports whether a and b are one database, where one transaction
// writes both sides' tables. Without a system identifier on either side,
// Database decides.
func (a Identity) Same(b Identity) bool {
	return a.Database == b.Database && (a.System == "" || b.System == "" || a.System == b.System)
}

// Identify asks the server of ex's session which database it is on, of
// whichever family it is. No statement it runs fails for lack of a
// privilege or in a way that ends a transaction, so that a transaction
// it runs in stays usable: it first asks version(), which PostgreSQL and
// MySQL answer and SQLite refuses without ending a transaction, then
// what the family says of itself.
func Identify(ctx context.Context, ex Executor) (Identity, error) {
	var version string
	if err := ex.QueryRow(ctx, `SELECT version()`).Scan(&version); err != nil {
		var file string
		if ferr := ex.QueryRow(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file); ferr != nil {
			return Identity{}, fmt.Errorf("identify the server: %w", errors.Join(err, ferr))
		}
		return Identity{Database: "sqlite:" + file}, nil
	}
	if !strings.HasPrefix(version, "PostgreSQL") {
		variable := "@@server_uuid"
		if strings.Contains(strings.ToLower(version), "mariadb") {
			variable = "@@server_uid"
		}
		var id string
		if err := ex.QueryRow(ctx, `SELECT `+variable).Scan(&id); err != nil {
			return Identity{}, fmt.Errorf("identify the server: %w", err)
		}
		return Identity{Database: "mysql:" + id}, nil
	}
	var (
		control  bool
		started  int64
		database string
		id       Identity
	)
	err := ex.QueryRow(ctx, `SELECT has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE'),
	`+Postgres.Micros("pg_postmaster_start_time()")+`, current_database()`).Scan(&control, &started, &database)
	if err != nil {
		return Identity{}, fmt.Errorf("identify the server: %w", err)
	}
	id.Database = "postgres:" + strconv.FormatInt(started, 10) + ":" + database
	if control {
		if err := ex.QueryRow(ctx, `SELECT system_identifier::text FROM pg_catalog.pg_control_system()`).Scan(&id.System); err != nil {
			return Identity{}, fmt.Errorf("identify the server: %w", err)
		}
	}
	return id, nil
}

// DeleteLimit is a DELETE of at most a number of rows of table, its last
// placeholder, that match where, the first by orderBy: a bounded delete,
// so that none holds long locks or writes a large burst. PostgreSQL and
// SQLite, which take no LIMIT on a DELETE, select the rows by their
// physical id (ctid, rowid).
func (d *Dialect) DeleteLimit(table, where, orderBy string) string {
	if d.rowID == "" {
		return "DELETE FROM " + table + " WHERE " + where + " ORDER BY " + orderBy + " LIMIT ?"
	}
	return "DELETE FROM " + table + " WHERE " + d.rowID + " IN (SELECT " + d.rowID + " FROM " + table + " WHERE " + where + " ORDER BY " + orderBy + " LIMIT ?)"
}

// SessionID is the current session's id, as the server's views of its
// sessions name it (MySQL's CONNECTION_ID(), what KILL takes;
// PostgreSQL's pg_backend_pid()); 0 on SQLite, which has no sessions to
// tell apart.
func (d *Dialect) SessionID() string { return d.sessionID }

// WriterHashes reports whether the migrations leave a hash column (the
// outbox's lane, crc32.ChecksumIEEE of the partition key & 63) for the
// writer to fill instead of generating it: SQLite has no hash function
// to generate it with.
func (d *Dialect) WriterHashes() bool { return d.hashes }

// PgxRows is the [Rows] of rows a pgx query or batch returned, for
// [Collect]: what a [PgxTx] pipeline reads.
func PgxRows(rows pgx.Rows) Rows { return pgxRows{rows} }

// Value scans a row of one column, for [Collect].
func Value[T any](rows Rows) (T, error) {
	var v T
	err := rows.Scan(&v)
	return v, err
}
