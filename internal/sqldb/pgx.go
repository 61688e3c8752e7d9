package sqldb

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgxQuerier is what a pgx pool, connection and transaction share.
type pgxQuerier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

type pgxExec struct{ q pgxQuerier }

func (e pgxExec) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := e.q.Exec(ctx, query, args...)
	return tag.RowsAffected(), err
}

func (e pgxExec) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	rows, err := e.q.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return pgxRows{rows}, nil
}

func (e pgxExec) QueryRow(ctx context.Context, query string, args ...any) Row {
	return e.q.QueryRow(ctx, query, args...) // pgx.ErrNoRows wraps sql.ErrNoRows
}

type pgxRows struct{ pgx.Rows }

func (r pgxRows) Close() error {
	r.Rows.Close()
	return r.Rows.Err()
}

// pgxDB is PostgreSQL through a pgx pool.
type pgxDB struct {
	pgxExec
	pool *pgxpool.Pool
}

// Pgx returns the PostgreSQL database of pool. Its transactions are pgx
// transactions: [PgxTx] hands one over for what only pgx does (pipelined
// batches).
func Pgx(pool *pgxpool.Pool) DB { return pgxDB{pgxExec{pool}, pool} }

func (pgxDB) Dialect() *Dialect { return Postgres }

func (d pgxDB) Begin(ctx context.Context, opts TxOptions) (Tx, error) {
	tx, err := d.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgxIsolation(opts.Isolation), AccessMode: pgxAccess(opts.ReadOnly)})
	if err != nil {
		return nil, err
	}
	return PgxTxOf(tx), nil
}

// PgxTxOf returns tx, a transaction the caller began through pgx, as a Tx.
func PgxTxOf(tx pgx.Tx) Tx { return pgxTx{pgxExec{tx}, tx} }

type pgxTx struct {
	pgxExec
	tx pgx.Tx
}

func (t pgxTx) Commit(ctx context.Context) error { return t.tx.Commit(ctx) }

func (t pgxTx) Rollback(ctx context.Context) error {
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

// PgxTx returns the pgx transaction under tx, when tx is one: the fast
// path of the pgx capability (a pipelined batch in one round trip).
func PgxTx(tx Executor) (pgx.Tx, bool) {
	t, ok := tx.(pgxTx)
	return t.tx, ok
}

func pgxIsolation(i Isolation) pgx.TxIsoLevel {
	switch i {
	case ReadUncommitted:
		return pgx.ReadUncommitted
	case ReadCommitted:
		return pgx.ReadCommitted
	case RepeatableRead:
		return pgx.RepeatableRead
	case Serializable:
		return pgx.Serializable
	}
	return ""
}

func pgxAccess(readOnly bool) pgx.TxAccessMode {
	if readOnly {
		return pgx.ReadOnly
	}
	return ""
}

// SameAddress reports whether tx, a pgx transaction, runs on a connection
// to the address and database that db, a pgx pool, connects to: the same
// host, port, database and user, so the same database, known without a
// statement. It answers false whenever it cannot tell (another driver,
// another spelling of the host), and the caller asks the servers
// (Identify): a writer that joins an inbox's transaction learns it
// without taking a second connection from the pool that transaction may
// be starving.
func SameAddress(db DB, tx Executor) bool {
	d, ok := db.(pgxDB)
	if !ok {
		return false
	}
	ptx, ok := PgxTx(tx)
	if !ok || ptx.Conn() == nil {
		return false
	}
	a, b := d.pool.Config().ConnConfig, ptx.Conn().Config()
	return a.Host == b.Host && a.Port == b.Port && a.Database == b.Database && a.User == b.User
}
