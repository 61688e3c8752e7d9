package sqldb

import "github.com/jackc/pgx/v5"

// IgnoreDuplicate ends an INSERT whose row a unique index may hold
// already; target is the index's columns and, for a partial index, its
// WHERE: "(a, b) WHERE c IS NULL". Such a row is skipped, 0 rows affected,
// and the transaction goes on. On MySQL, where a duplicate key fails only
// its own statement, it is empty: the INSERT fails, the transaction goes
// on, and [Dialect.UniqueViolation] tells the error.
func (d *Dialect) IgnoreDuplicate(target string) string {
	if d == MySQL {
		return ""
	}
	return " ON CONFLICT " + target + " DO NOTHING"
}

// DeleteLimit is a DELETE of at most a number of rows of table, its last
// placeholder, that match where, the first by orderBy: a bounded delete,
// so that none holds long locks or writes a large burst. PostgreSQL and
// SQLite, which take no LIMIT on a DELETE, select the rows by their
// physical id (ctid, rowid).
func (d *Dialect) DeleteLimit(table, where, orderBy string) string {
	switch d {
	case MySQL:
		return "DELETE FROM " + table + " WHERE " + where + " ORDER BY " + orderBy + " LIMIT ?"
	case SQLite:
		return "DELETE FROM " + table + " WHERE rowid IN (SELECT rowid FROM " + table + " WHERE " + where + " ORDER BY " + orderBy + " LIMIT ?)"
	}
	return "DELETE FROM " + table + " WHERE ctid IN (SELECT ctid FROM " + table + " WHERE " + where + " ORDER BY " + orderBy + " LIMIT ?)"
}

// SessionID is the current session's id, as the server's views of its
// sessions name it (MySQL's CONNECTION_ID(), what KILL takes;
// PostgreSQL's pg_backend_pid()); 0 on SQLite, which has no sessions to
// tell apart.
func (d *Dialect) SessionID() string {
	switch d {
	case MySQL:
		return "CONNECTION_ID()"
	case SQLite:
		return "0"
	}
	return "pg_backend_pid()"
}

// WriterHashes reports whether the migrations leave a hash column (the
// outbox's lane, crc32.ChecksumIEEE of the partition key & 63) for the
// writer to fill instead of generating it: SQLite has no hash function
// to generate it with.
func (d *Dialect) WriterHashes() bool { return d == SQLite }

// PgxRows is the [Rows] of rows a pgx query or batch returned, for
// [Collect]: what a [PgxTx] pipeline reads.
func PgxRows(rows pgx.Rows) Rows { return pgxRows{rows} }

// Value scans a row of one column, for [Collect].
func Value[T any](rows Rows) (T, error) {
	var v T
	err := rows.Scan(&v)
	return v, err
}
