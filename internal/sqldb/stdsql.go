package sqldb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
)

// sqlQuerier is what database/sql's DB, Conn and Tx share.
type sqlQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

type sqlExec struct{ q sqlQuerier }

func (e sqlExec) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := e.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, nil // the driver cannot tell; the statement ran
	}
	return n, nil
}

func (e sqlExec) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	rows, err := e.q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return rows, nil
}

func (e sqlExec) QueryRow(ctx context.Context, query string, args ...any) Row {
	return e.q.QueryRowContext(ctx, query, args...)
}

// sqlDB is a database through database/sql.
type sqlDB struct {
	sqlExec
	db *sql.DB
	d  *Dialect
}

// SQL returns db, a database of dialect d through database/sql: pgx's
// stdlib or lib/pq for [Postgres], go-sql-driver/mysql for [MySQL] (MySQL
// 8.0+ or MariaDB 10.6+), modernc.org/sqlite for [SQLite].
func SQL(db *sql.DB, d *Dialect) DB { return sqlDB{sqlExec{db}, db, d} }

func (d sqlDB) Dialect() *Dialect { return d.d }

// Begin begins the transaction with the dialect's own statements on a
// dedicated connection, not with sql.DB.BeginTx: database/sql rolls a Tx
// back when the context it began with ends, and go-sql-driver/mysql's
// Commit honours no context at all. Each statement here runs on the
// context it is given, which the drivers honour by closing the connection;
// the server then rolls the transaction back.
func (d sqlDB) Begin(ctx context.Context, opts TxOptions) (Tx, error) {
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	for _, stmt := range d.d.begin(opts) {
		if _, err := conn.ExecContext(ctx, stmt); err != nil {
			discard(conn)
			return nil, fmt.Errorf("begin: %w", err)
		}
	}
	return &sqlTx{sqlExec: sqlExec{conn}, conn: conn}, nil
}

// SQLTxOf returns tx, a transaction the caller began through database/sql,
// as an Executor (a Tx's end is its owner's).
func SQLTxOf(tx *sql.Tx) Executor { return sqlExec{tx} }

type sqlTx struct {
	sqlExec
	conn *sql.Conn
	done bool
}

func (t *sqlTx) Commit(ctx context.Context) error {
	if t.done {
		return errors.New("sqldb: transaction already ended")
	}
	t.done = true
	if _, err := t.conn.ExecContext(ctx, "COMMIT"); err != nil {
		// The outcome is unknown, and the connection may still hold the
		// transaction: it must not go back to the pool.
		discard(t.conn)
		return err
	}
	return t.conn.Close()
}

func (t *sqlTx) Rollback(ctx context.Context) error {
	if t.done {
		return nil
	}
	t.done = true
	if _, err := t.conn.ExecContext(ctx, "ROLLBACK"); err != nil {
		discard(t.conn)
		return err
	}
	return t.conn.Close()
}

// discard closes conn rather than give it back to the pool: Raw closes
// the connection when its function reports driver.ErrBadConn.
func discard(conn *sql.Conn) {
	_ = conn.Raw(func(any) error { return driver.ErrBadConn })
	_ = conn.Close()
}
