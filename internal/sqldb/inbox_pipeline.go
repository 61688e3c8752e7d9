package sqldb

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// statements are statements to send in a pipeline: prepared on the
// connection when it caches statements, else sent with their text.
type statements struct {
	names    []string
	args     [][]arg
	prepared bool
}

// prepare prepares stmts on conn once per connection (pgx keeps them by
// SQL) when conn caches statements, so that they are parsed and planned
// once, as pgx's own statement cache would do. BEGIN is sent with its
// text.
func prepare(ctx context.Context, conn *pgx.Conn, stmts ...stmt) (statements, error) {
	st := statements{names: make([]string, len(stmts)), args: make([][]arg, len(stmts))}
	st.prepared = conn.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement
	for i, s := range stmts {
		st.names[i], st.args[i] = s.sql, s.args
		if !st.prepared || s.sql == "begin" {
			continue
		}
		sd, err := conn.Prepare(ctx, s.sql, s.sql)
		if err != nil {
			return statements{}, err
		}
		st.names[i] = sd.Name
	}
	return st, nil
}

// send queues statement i with the parameters p on pl, in the text
// format.
func (st statements) send(pl *pgconn.Pipeline, i int, p *params) {
	args := make([][]byte, len(st.args[i]))
	for j, a := range st.args[i] {
		args[j] = textArg(p[a])
	}
	switch {
	case st.names[i] == "begin":
		pl.SendQueryParams("begin", nil, nil, nil, nil)
	case st.prepared:
		pl.SendQueryPrepared(st.names[i], args, nil, nil)
	default:
		pl.SendQueryParams(st.names[i], args, nil, nil, nil)
	}
}

// textArg is v in PostgreSQL's text format.
func textArg(v any) []byte {
	switch v := v.(type) {
	case string:
		return []byte(v)
	case []byte:
		return v
	case int64:
		return strconv.AppendInt(nil, v, 10)
	case int:
		return strconv.AppendInt(nil, int64(v), 10)
	}
	panic(fmt.Sprintf("sqldb: no text form for %T", v))
}

// result is what one pipelined statement answered: its rows, copied, in
// the text format, or its error. A statement that did not run (an earlier
// one in its segment failed) has errSkipped.
type result struct {
	fields []pgconn.FieldDescription
	rows   [][][]byte
	tag    pgconn.CommandTag
	err    error
}

var errSkipped = errors.New("not run: an earlier statement of the pipeline failed")

func (r result) scan(tm interface {
	Scan(oid uint32, formatCode int16, src []byte, dst any) error
}, row int, dst ...any) error {
	if len(r.fields) != len(dst) {
		return fmt.Errorf("%d columns, want %d", len(r.fields), len(dst))
	}
	for i, d := range dst {
		if err := tm.Scan(r.fields[i].DataTypeOID, r.fields[i].Format, r.rows[row][i], d); err != nil {
			return fmt.Errorf("column %s: %w", r.fields[i].Name, err)
		}
	}
	return nil
}

// readSegment reads the answers of the n statements of one segment and
// of the Sync that ends it. The server skips the statements after a failed
// one up to the Sync. An error that is not the server's answer to a
// statement (the connection broke) is returned; the server's are in the
// results.
func readSegment(p *pgconn.Pipeline, n int) ([]result, error) {
	out := make([]result, n)
	for i := range out {
		out[i].err = errSkipped
	}
	for i := 0; ; {
		res, err := p.GetResults()
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && i < n:
			out[i].err = err
			i = n // the rest of the segment is skipped
			continue
		case err != nil:
			return nil, err
		}
		switch res := res.(type) {
		case *pgconn.PipelineSync:
			return out, nil
		case *pgconn.ResultReader:
			if i >= n {
				return nil, errors.New("pipeline: more results than statements")
			}
			r := result{fields: append([]pgconn.FieldDescription(nil), res.FieldDescriptions()...)}
			for res.NextRow() {
				vals := res.Values()
				row := make([][]byte, len(vals))
				for j, v := range vals {
					if v != nil {
						row[j] = append([]byte{}, v...)
					}
				}
				r.rows = append(r.rows, row)
			}
			r.tag, r.err = res.Close()
			out[i] = r
			i++
		case nil:
			return nil, errors.New("pipeline: results ended before the Sync")
		default:
			return nil, fmt.Errorf("pipeline: unexpected result %T", res)
		}
	}
}

// endConn ends whatever transaction the pipeline left open on c and gives
// c back to the pool, which closes it if it is not idle (a ROLLBACK that
// failed, a broken connection).
func endConn(ctx context.Context, c *pgxpool.Conn) error {
	defer c.Release()
	conn := c.Conn()
	if conn.IsClosed() || conn.PgConn().TxStatus() == 'I' {
		return nil
	}
	end, cancel := context.WithTimeout(context.WithoutCancel(ctx), endTimeout)
	defer cancel()
	if _, err := conn.Exec(end, "rollback"); err != nil {
		closeConn(conn)
		return fmt.Errorf("rollback: %w", err)
	}
	return nil
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// pipelineTrace reports a pipeline to the connection's tracer, when it
// traces batches (pgx.BatchTracer), as a batch of its statements: one round
// trip, as a pgx batch is. BEGIN is traced without arguments.
type pipelineTrace struct {
	ctx    context.Context
	conn   *pgx.Conn
	tracer pgx.BatchTracer
	sql    []string
	args   [][]any
}

func traceStart(ctx context.Context, conn *pgx.Conn, p *params, stmts ...stmt) pipelineTrace {
	bt, ok := conn.Config().Tracer.(pgx.BatchTracer)
	if !ok {
		return pipelineTrace{}
	}
	t := pipelineTrace{conn: conn, tracer: bt}
	b := &pgx.Batch{}
	for _, s := range stmts {
		args := s.bind(p)
		b.Queue(s.sql, args...)
		t.sql, t.args = append(t.sql, s.sql), append(t.args, args)
	}
	t.ctx = bt.TraceBatchStart(ctx, conn, pgx.TraceBatchStartData{Batch: b})
	return t
}

// end reports the answers of the statements, in order, segment by segment.
func (t pipelineTrace) end(err error, segments ...[]result) {
	if t.tracer == nil {
		return
	}
	var all []result
	for _, seg := range segments {
		all = append(all, seg...)
	}
	for i, r := range all {
		if i >= len(t.sql) {
			break
		}
		t.tracer.TraceBatchQuery(t.ctx, t.conn, pgx.TraceBatchQueryData{SQL: t.sql[i], Args: t.args[i], CommandTag: r.tag, Err: r.err})
	}
	t.tracer.TraceBatchEnd(t.ctx, t.conn, pgx.TraceBatchEndData{Err: err})
}

// connTx is a pgx.Tx over a pooled connection on which BEGIN was sent by
// hand (in the pipeline of [PgxInbox.InboxStartClaim]). It behaves as pgx's
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
