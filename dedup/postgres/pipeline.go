package postgres

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

var (
	_ dedupdriver.StartClaimer = (*Store)(nil)
	_ dedupdriver.BeginClaimer = (*Store)(nil)
)

// acquirer is a DB that hands out connections of its own: a
// *pgxpool.Pool. Only on such a DB can the store drive a connection by
// hand, which the pipelined start and claim needs.
type acquirer interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// endTimeout bounds the ROLLBACK that ends a transaction the caller will
// not get (a done key, a failed claim); past it the connection is closed.
const endTimeout = 5 * time.Second

// InboxStartClaim counts an attempt of key, begins a transaction and claims
// key in it, in one round trip when the store's DB is a *pgxpool.Pool: the
// start statement, a Sync, BEGIN and the claim statement, and a second
// Sync go out together. The first Sync commits the start on its own, so
// that it is durable before the handler runs, as with
// [Store.InboxStart]; BEGIN and the claim open the handler's transaction.
//
// A done or dead key costs one more round trip, the ROLLBACK of the
// transaction the pipeline opened. The claim's rare paths (a row committed
// while the claim waited, a failed key taken again) run their follow-up
// statements in the transaction, as [dedup.InboxTx.InboxClaim] does.
//
// The transaction's [Tx] is not pgx's own (pgx did not send the BEGIN):
// Exec, Query, QueryRow, SendBatch, CopyFrom, Prepare, Conn and nested
// Begin (savepoints) behave as on a pgx transaction, and so do Commit and
// Rollback (pgx.ErrTxCommitRollback for an aborted transaction,
// pgx.ErrTxClosed after the end); LargeObjects is not supported. The
// connection goes back to the pool when the transaction ends, and is closed
// instead when it is not idle then.
//
// On any other DB (a single connection, a transaction) it runs InboxStart,
// InboxBegin and InboxClaim in turn.
func (s *Store) InboxStartClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, dedup.InboxTx, dedup.Claim, error) {
	pool, ok := s.db.(acquirer)
	if !ok {
		return s.startThenClaim(ctx, key, window)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return dedup.Claim{}, nil, dedup.Claim{}, interpret(ctx, "start", err)
	}
	start, claim, err := s.pipeline(ctx, c, key, window)
	if err != nil || start.State != dedup.StateNew {
		// start.Attempts tells the caller whether the start counted.
		return start, nil, dedup.Claim{}, errors.Join(err, endConn(ctx, c))
	}
	tx, got, err := s.claimedOn(ctx, c, key, window, claim)
	if err != nil {
		return start, nil, dedup.Claim{}, err
	}
	return start, tx, got, nil
}

// claimedOn makes c, left in its transaction by a pipeline whose claim
// answered r, the handler's transaction, and finishes the claim's rare
// paths in it, as [dedup.InboxTx.InboxClaim] does. On an error the
// transaction is rolled back and c goes back to the pool.
func (s *Store) claimedOn(ctx context.Context, c *pgxpool.Conn, key dedup.Key, window time.Duration, r claimRow) (dedup.InboxTx, dedup.Claim, error) {
	tx := &inboxTx{tx: &connTx{c: c}, q: &s.q}
	var none error
	if r.status == "" {
		none = pgx.ErrNoRows
	}
	got, err := tx.claimed(ctx, key, window, r, none)
	if err != nil {
		end, cancel := context.WithTimeout(context.WithoutCancel(ctx), endTimeout)
		defer cancel()
		return nil, dedup.Claim{}, errors.Join(err, tx.Rollback(end))
	}
	return tx, got, nil
}

// startThenClaim is InboxStartClaim without a pipeline.
func (s *Store) startThenClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, dedup.InboxTx, dedup.Claim, error) {
	start, err := s.InboxStart(ctx, key, window)
	if err != nil || start.State != dedup.StateNew {
		return start, nil, dedup.Claim{}, err
	}
	tx, claim, err := s.beginThenClaim(ctx, key, window)
	if err != nil {
		return start, nil, dedup.Claim{}, err
	}
	return start, tx, claim, nil
}

// beginThenClaim is InboxBeginClaim without a pipeline: InboxBegin, then
// InboxClaim, the transaction rolled back if the claim fails.
func (s *Store) beginThenClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.InboxTx, dedup.Claim, error) {
	tx, err := s.InboxBegin(ctx)
	if err != nil {
		return nil, dedup.Claim{}, err
	}
	claim, err := tx.InboxClaim(ctx, key, window)
	if err != nil {
		end, cancel := context.WithTimeout(context.WithoutCancel(ctx), endTimeout)
		defer cancel()
		return nil, dedup.Claim{}, errors.Join(err, tx.Rollback(end))
	}
	return tx, claim, nil
}

// pipeline sends [start] Sync [BEGIN] [claim] Sync on c and reads the
// answers. It returns the start's answer, with Attempts zero when the
// start did not run, and the claim's row (status "" when it returned
// none). It leaves c in the transaction after a new key's start; the
// caller ends it on every other path.
func (s *Store) pipeline(ctx context.Context, c *pgxpool.Conn, key dedup.Key, window time.Duration) (dedup.Claim, claimRow, error) {
	conn := c.Conn()
	params := claimParams(key, window)
	// The claim matters only when the start finds the key new: it is
	// ClaimNew.
	stmts, err := prepare(ctx, conn, s.q.Start, s.q.ClaimNew)
	if err != nil {
		return dedup.Claim{}, claimRow{}, interpret(ctx, "start", err)
	}

	trace := traceStart(ctx, conn, params, s.q.Start, "begin", s.q.ClaimNew)
	p := conn.PgConn().StartPipeline(ctx)
	stmts.send(p, 0, params)
	p.SendPipelineSync()
	p.SendQueryParams("begin", nil, nil, nil, nil)
	stmts.send(p, 1, params)
	err = p.Sync()
	var first, second []result
	if err == nil {
		first, err = readSegment(p, 1)
	}
	var brokenAfterStart error
	if err == nil {
		if second, err = readSegment(p, 2); err != nil {
			brokenAfterStart, err = err, nil
		}
	}
	err = errors.Join(err, p.Close())
	trace.end(errors.Join(err, brokenAfterStart), first, second)
	if err != nil {
		// The pipeline broke before the start's answer came back: the
		// start may have committed. StateNew with no count says so; the
		// caller takes a count back once the store answers.
		return dedup.Claim{State: dedup.StateNew}, claimRow{}, interpret(ctx, "start", err)
	}

	tm := conn.TypeMap()
	startRes := first[0]
	if startRes.err != nil {
		return dedup.Claim{}, claimRow{}, interpret(ctx, "start", startRes.err)
	}
	var (
		status      string
		start       dedup.Claim
		firstFailed *time.Time
	)
	if len(startRes.rows) != 1 {
		return dedup.Claim{}, claimRow{}, fmt.Errorf("postgres: start: %d rows, want 1", len(startRes.rows))
	}
	if err := startRes.scan(tm, 0, &status, &start.Attempts, &start.Result, &firstFailed); err != nil {
		return dedup.Claim{}, claimRow{}, fmt.Errorf("postgres: start: %w", err)
	}
	if firstFailed != nil {
		start.FirstFailedAt = *firstFailed
	}
	switch status {
	case "new":
		start.State = dedup.StateNew
	case "done":
		return dedup.Claim{State: dedup.StateDone, Attempts: start.Attempts, Result: start.Result, FirstFailedAt: start.FirstFailedAt}, claimRow{}, nil
	case "dead":
		return dedup.Claim{State: dedup.StateDead, Attempts: start.Attempts, FirstFailedAt: start.FirstFailedAt}, claimRow{}, nil
	default:
		return dedup.Claim{}, claimRow{}, fmt.Errorf("postgres: start: unexpected status %q", status)
	}
	// From here the start is counted: errors return it.
	if brokenAfterStart != nil {
		return start, claimRow{}, interpret(ctx, "claim", brokenAfterStart)
	}
	r, err := claimFrom(ctx, conn, second)
	return start, r, err
}

// claimFrom reads the answers of BEGIN and the claim statement, the
// claim's row with status "" when it returned none, and checks that the
// connection is in the transaction.
func claimFrom(ctx context.Context, conn *pgx.Conn, answers []result) (claimRow, error) {
	if begin := answers[0]; begin.err != nil {
		return claimRow{}, interpret(ctx, "begin", begin.err)
	}
	claimRes := answers[1]
	if claimRes.err != nil {
		return claimRow{}, interpret(ctx, "claim", claimRes.err)
	}
	if st := conn.PgConn().TxStatus(); st != 'T' {
		return claimRow{}, fmt.Errorf("postgres: begin: connection not in a transaction after BEGIN (status %q)", st)
	}
	var r claimRow
	switch len(claimRes.rows) {
	case 0:
	case 1:
		if err := claimRes.scan(conn.TypeMap(), 0, &r.status, &r.attempts, &r.result, &r.firstFailed); err != nil {
			return claimRow{}, fmt.Errorf("postgres: claim: %w", err)
		}
		if r.status == "" {
			return claimRow{}, errors.New("postgres: claim: empty status")
		}
	default:
		return claimRow{}, fmt.Errorf("postgres: claim: %d rows, want at most 1", len(claimRes.rows))
	}
	return r, nil
}

// InboxBeginClaim begins a transaction and claims key in it, in one round
// trip when the store's DB is a *pgxpool.Pool: BEGIN, the claim statement
// and a Sync go out together. The transaction is the one
// [Store.InboxStartClaim] returns, with its rare paths and its [Tx]; on any
// other DB it runs InboxBegin and InboxClaim in turn.
//
// With hint.New the claim is the INSERT alone: a key that has a record
// costs a round trip more, to read it. With hint.Unstarted the claim
// deletes no start count.
func (s *Store) InboxBeginClaim(ctx context.Context, key dedup.Key, window time.Duration, hint dedupdriver.ClaimHint) (dedup.InboxTx, dedup.Claim, error) {
	pool, ok := s.db.(acquirer)
	if !ok {
		return s.beginThenClaim(ctx, key, window)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, dedup.Claim{}, interpret(ctx, "begin", err)
	}
	r, err := s.beginClaim(ctx, c, key, window, s.claimFor(hint))
	if err != nil {
		return nil, dedup.Claim{}, errors.Join(err, endConn(ctx, c))
	}
	return s.claimedOn(ctx, c, key, window, r)
}

// beginClaim sends BEGIN [claim] Sync on c and reads the answers. It
// leaves c in the transaction when it succeeds; the caller ends it on
// every path.
func (s *Store) beginClaim(ctx context.Context, c *pgxpool.Conn, key dedup.Key, window time.Duration, claim string) (claimRow, error) {
	conn := c.Conn()
	params := claimParams(key, window)
	stmts, err := prepare(ctx, conn, claim)
	if err != nil {
		return claimRow{}, interpret(ctx, "begin", err)
	}
	trace := traceStart(ctx, conn, params, "begin", claim)
	p := conn.PgConn().StartPipeline(ctx)
	p.SendQueryParams("begin", nil, nil, nil, nil)
	stmts.send(p, 0, params)
	err = p.Sync()
	var answers []result
	if err == nil {
		answers, err = readSegment(p, 2)
	}
	err = errors.Join(err, p.Close())
	trace.end(err, answers)
	if err != nil {
		return claimRow{}, interpret(ctx, "begin", err)
	}
	return claimFrom(ctx, conn, answers)
}

// claimFor is the claim statement for hint: each answers a new key with
// its row, and a key with a record with its row (Claim) or none (the
// others), which claimedOn then reads.
func (s *Store) claimFor(hint dedupdriver.ClaimHint) string {
	switch {
	case !hint.New:
		return s.q.Claim
	case hint.Unstarted:
		return s.q.ClaimNewUnstarted
	}
	return s.q.ClaimNew
}

// claimParams are the parameters of the start and claim statements, in
// the text format.
func claimParams(key dedup.Key, window time.Duration) [][]byte {
	return [][]byte{[]byte(key.Consumer), []byte(key.Key), []byte(strconv.FormatFloat(seconds(window), 'g', -1, 64))}
}

// statements are statements to send in a pipeline: prepared on the
// connection when it caches statements, else sent with their text.
type statements struct {
	names    []string
	prepared bool
}

// prepare prepares sqls on conn once per connection (pgx keeps them by
// SQL) when conn caches statements, so that they are parsed and planned
// once, as pgx's own statement cache would do.
func prepare(ctx context.Context, conn *pgx.Conn, sqls ...string) (statements, error) {
	st := statements{names: sqls}
	if conn.Config().DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return st, nil
	}
	st.prepared = true
	st.names = make([]string, len(sqls))
	for i, sql := range sqls {
		sd, err := conn.Prepare(ctx, sql, sql)
		if err != nil {
			return statements{}, err
		}
		st.names[i] = sd.Name
	}
	return st, nil
}

// send queues statement i with params on p.
func (st statements) send(p *pgconn.Pipeline, i int, params [][]byte) {
	if st.prepared {
		p.SendQueryPrepared(st.names[i], params, nil, nil)
	} else {
		p.SendQueryParams(st.names[i], params, nil, nil, nil)
	}
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
		return fmt.Errorf("postgres: rollback: %w", err)
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
	args   []any
}

func traceStart(ctx context.Context, conn *pgx.Conn, params [][]byte, sqls ...string) pipelineTrace {
	bt, ok := conn.Config().Tracer.(pgx.BatchTracer)
	if !ok {
		return pipelineTrace{}
	}
	args := []any{string(params[0]), string(params[1]), string(params[2])}
	b := &pgx.Batch{}
	for _, sql := range sqls {
		if sql == "begin" {
			b.Queue(sql)
		} else {
			b.Queue(sql, args...)
		}
	}
	return pipelineTrace{
		ctx:    bt.TraceBatchStart(ctx, conn, pgx.TraceBatchStartData{Batch: b}),
		conn:   conn,
		tracer: bt,
		sql:    sqls,
		args:   args,
	}
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
		var args []any
		if t.sql[i] != "begin" {
			args = t.args
		}
		t.tracer.TraceBatchQuery(t.ctx, t.conn, pgx.TraceBatchQueryData{SQL: t.sql[i], Args: args, CommandTag: r.tag, Err: r.err})
	}
	t.tracer.TraceBatchEnd(t.ctx, t.conn, pgx.TraceBatchEndData{Err: err})
}
