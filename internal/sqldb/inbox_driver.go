package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncemill/oncemill/dedup"
)

// inboxExec runs the inbox's statements: on the pool, or in the claim's
// transaction.
type inboxExec interface {
	Executor
	// execID runs a statement and returns its insert id, which
	// LAST_INSERT_ID(expr) sets: how a count comes back where there is no
	// RETURNING.
	execID(ctx context.Context, query string, args ...any) (int64, error)
}

// inboxDriver is how the inbox reaches its database through one driver.
type inboxDriver interface {
	inboxExec
	// begin begins a transaction on a connection of its own, which lives
	// until it is committed or rolled back whatever becomes of ctx.
	begin(ctx context.Context, readCommitted bool) (inboxConn, error)
}

// inboxConn is an open transaction of the inbox.
type inboxConn interface {
	inboxExec
	// handle is the driver's transaction, which the handler reads with
	// its store's Tx: a pgx.Tx or a *sql.Tx.
	handle() any
	commit(ctx context.Context) error
	// rollback rolls back; after the end it does nothing.
	rollback(ctx context.Context) error
	// lost asks the connection, through the driver, whether it is closed
	// or broken.
	lost() bool
}

func (e sqlExec) execID(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := e.q.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

// sqlInboxDB is the inbox's database through database/sql.
type sqlInboxDB struct {
	sqlExec
	db *sql.DB
	d  *Dialect
}

// begin takes a connection and begins on it, both bounded by ctx; the
// transaction then lives on a context of its own, since database/sql
// rolls a transaction back when the context it began with ends, and the
// inbox lets a handler finish and commit while its consumer shuts down.
func (s sqlInboxDB) begin(ctx context.Context, readCommitted bool) (inboxConn, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	txCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	var opts *sql.TxOptions
	if readCommitted {
		opts = &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	}
	tx, err := conn.BeginTx(txCtx, opts)
	if !stop() {
		// ctx ended while BEGIN ran: database/sql rolls the transaction
		// back, if it began.
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		cancel()
		if tx != nil {
			_ = tx.Rollback() // the outcome is err's
		}
		return nil, errors.Join(err, conn.Close())
	}
	return &sqlInboxConn{sqlExec: sqlExec{tx}, conn: conn, tx: tx, cancel: cancel, d: s.d}, nil
}

// sqlInboxConn is a transaction on a connection of its own, which goes
// back to the pool when the transaction ends.
type sqlInboxConn struct {
	sqlExec
	conn   *sql.Conn
	tx     *sql.Tx
	cancel context.CancelFunc
	d      *Dialect
	ended  bool
}

func (c *sqlInboxConn) handle() any { return c.tx }

// commit commits. database/sql's Commit takes no context: the driver's
// own timeouts bound it (readTimeout for go-sql-driver/mysql).
func (c *sqlInboxConn) commit(context.Context) error {
	if c.ended {
		return sql.ErrTxDone
	}
	err := c.tx.Commit()
	if endErr := c.end(); err == nil {
		// Committed: giving the connection back cannot undo that.
		return endErr
	}
	return err
}

func (c *sqlInboxConn) rollback(context.Context) error {
	if c.ended {
		return nil
	}
	if c.lost() {
		// The transaction ended with its session.
		_ = c.tx.Rollback() // frees database/sql's side; the driver can only fail
		return c.end()
	}
	err := c.tx.Rollback()
	if errors.Is(err, sql.ErrTxDone) {
		err = nil
	}
	return errors.Join(err, c.end())
}

// end gives the connection back once the transaction has ended.
func (c *sqlInboxConn) end() error {
	c.ended = true
	c.cancel()
	if err := c.conn.Close(); err != nil && !errors.Is(err, sql.ErrConnDone) {
		return err
	}
	return nil
}

func (c *sqlInboxConn) lost() bool {
	closed := false
	err := c.conn.Raw(func(dc any) error {
		closed = c.d.closed(dc)
		return nil
	})
	return err != nil || closed
}

// PgxDB is what the inbox needs of PostgreSQL through pgx: a
// *pgxpool.Pool satisfies it, and so do a connection and a transaction.
type PgxDB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func (pgxExec) execID(context.Context, string, ...any) (int64, error) {
	return 0, errors.New("sqldb: no insert ids through pgx: PostgreSQL has RETURNING")
}

// pgxInboxDB is the inbox's database through pgx.
type pgxInboxDB struct {
	pgxExec
	db PgxDB
}

// begin begins a pgx transaction. pgx does not end it when ctx ends.
func (p pgxInboxDB) begin(ctx context.Context, readCommitted bool) (inboxConn, error) {
	var (
		tx  pgx.Tx
		err error
	)
	if b, ok := p.db.(interface {
		BeginTx(context.Context, pgx.TxOptions) (pgx.Tx, error)
	}); ok && readCommitted {
		tx, err = b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	} else {
		tx, err = p.db.Begin(ctx)
	}
	if err != nil {
		return nil, err
	}
	return newPgxInboxConn(tx), nil
}

func newPgxInboxConn(tx pgx.Tx) pgxInboxConn {
	return pgxInboxConn{pgxExec{tx}, tx}
}

// pgxInboxConn is a pgx transaction: pgx's own, or one a pipeline began
// by hand (connTx).
type pgxInboxConn struct {
	pgxExec
	tx pgx.Tx
}

// handle is the transaction the handler writes through: the inbox's, whose
// Commit and Rollback are the inbox's to call (handlerTx).
func (c pgxInboxConn) handle() any { return handlerTx{Tx: c.tx} }

// handlerTx is the pgx.Tx a handler writes through: its Commit and
// Rollback do nothing and say why (dedup.ErrTxOwned). Ending the inbox's
// transaction would commit, or lose, the done marks of a batch's messages
// whose handlers have not run yet; the inbox ends it when the handler
// returns. A savepoint (Begin) is the handler's own, to end as it likes.
type handlerTx struct{ pgx.Tx }

func (handlerTx) Commit(context.Context) error {
	return fmt.Errorf("commit: %w", dedup.ErrTxOwned)
}

func (handlerTx) Rollback(context.Context) error {
	return fmt.Errorf("rollback: %w", dedup.ErrTxOwned)
}

func (c pgxInboxConn) commit(ctx context.Context) error { return c.tx.Commit(ctx) }

func (c pgxInboxConn) rollback(ctx context.Context) error {
	if err := c.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

func (c pgxInboxConn) lost() bool {
	if c.released() {
		return false // ended, not lost
	}
	conn := c.tx.Conn()
	return conn == nil || conn.IsClosed()
}

// released reports whether the transaction is a connTx that gave its
// connection back to the pool: the connection is another's then.
func (c pgxInboxConn) released() bool {
	t, ok := c.tx.(*connTx)
	return ok && t.closed
}

// aborted reports whether a statement of the transaction failed: the
// connection's transaction status is 'E' (failed), known locally from
// the server's last ReadyForQuery.
func (c pgxInboxConn) aborted() bool {
	if c.released() {
		return false
	}
	conn := c.tx.Conn()
	return conn != nil && !conn.IsClosed() && conn.PgConn().TxStatus() == 'E'
}

// errNotPool is the error of a call that drives a pooled connection by
// hand on a PgxDB that is not a pool.
var errNotPool = fmt.Errorf("the store's DB is not a pool")
