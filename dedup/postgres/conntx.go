package postgres

import (
	"context"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// connTx is a pgx.Tx over a pooled connection on which BEGIN was sent by
// hand (in the pipeline of [Store.InboxStartClaim]). It behaves as pgx's
// own transaction: nested Begin makes a savepoint; Commit of an aborted
// transaction returns pgx.ErrTxCommitRollback; every method returns
// pgx.ErrTxClosed after Commit or Rollback. Commit and Rollback give the
// connection back to the pool, which closes it if it is not idle.
//
// LargeObjects is not supported: it returns the zero pgx.LargeObjects,
// whose methods must not be called (pgx offers no way to build one on
// another Tx). Call the server's lo_* functions through Exec and QueryRow.
//
// It is used by one goroutine.
type connTx struct {
	c            *pgxpool.Conn
	savepointNum int64
	closed       bool
}

var (
	_ pgx.Tx = (*connTx)(nil)
	_ pgx.Tx = (*savepointTx)(nil)
)

func (tx *connTx) conn() *pgx.Conn { return tx.c.Conn() }

// release gives the connection back to the pool, once.
func (tx *connTx) release() {
	tx.closed = true
	tx.c.Release()
}

func (tx *connTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	tx.savepointNum++
	if _, err := tx.conn().Exec(ctx, "savepoint sp_"+strconv.FormatInt(tx.savepointNum, 10)); err != nil {
		return nil, err
	}
	return &savepointTx{tx: tx, savepointNum: tx.savepointNum}, nil
}

func (tx *connTx) Commit(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	defer tx.release()
	tag, err := tx.conn().Exec(ctx, "commit")
	if err != nil {
		// The pool closes the connection if the COMMIT left it in a
		// transaction or broken.
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

func (tx *connTx) Rollback(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	defer tx.release()
	if _, err := tx.conn().Exec(ctx, "rollback"); err != nil {
		// Its state is unknown: close it rather than give it back.
		closeConn(tx.conn())
		return err
	}
	return nil
}

func (tx *connTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if tx.closed {
		return 0, pgx.ErrTxClosed
	}
	return tx.conn().CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (tx *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if tx.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return tx.conn().SendBatch(ctx, b)
}

// LargeObjects is not supported; see [connTx].
func (tx *connTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

func (tx *connTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	return tx.conn().Prepare(ctx, name, sql)
}

func (tx *connTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if tx.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return tx.conn().Exec(ctx, sql, arguments...)
}

func (tx *connTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.closed {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return tx.conn().Query(ctx, sql, args...)
}

func (tx *connTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return tx.conn().QueryRow(ctx, sql, args...)
}

// Conn returns the connection, also after the end (as pgx's does); it
// must not be used then, as it is back in the pool.
func (tx *connTx) Conn() *pgx.Conn { return tx.conn() }

// savepointTx is a transaction nested in a connTx, a savepoint.
type savepointTx struct {
	tx           *connTx
	savepointNum int64
	closed       bool
}

func (sp *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Begin(ctx)
}

func (sp *savepointTx) Commit(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "release savepoint sp_"+strconv.FormatInt(sp.savepointNum, 10))
	sp.closed = true
	return err
}

func (sp *savepointTx) Rollback(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "rollback to savepoint sp_"+strconv.FormatInt(sp.savepointNum, 10))
	sp.closed = true
	return err
}

func (sp *savepointTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if sp.closed {
		return 0, pgx.ErrTxClosed
	}
	return sp.tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (sp *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if sp.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return sp.tx.SendBatch(ctx, b)
}

// LargeObjects is not supported; see [connTx].
func (sp *savepointTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

func (sp *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.tx.Prepare(ctx, name, sql)
}

func (sp *savepointTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if sp.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return sp.tx.Exec(ctx, sql, arguments...)
}

func (sp *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if sp.closed {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return sp.tx.Query(ctx, sql, args...)
}

func (sp *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if sp.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return sp.tx.QueryRow(ctx, sql, args...)
}

func (sp *savepointTx) Conn() *pgx.Conn { return sp.tx.Conn() }

// errRows is the closed pgx.Rows of a query that was not sent.
type errRows struct{ err error }

func (r errRows) Close()                                       {}
func (r errRows) Err() error                                   { return r.err }
func (r errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                            { return r.err }
func (r errRows) Values() ([]any, error)                       { return nil, r.err }
func (r errRows) RawValues() [][]byte                          { return nil }
func (r errRows) Conn() *pgx.Conn                              { return nil }
func (r errRows) TypeMap() *pgtype.Map                         { return nil }

// errRow is the pgx.Row of a query that was not sent.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
