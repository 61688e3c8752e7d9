package sqldb

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// PgxInbox is the [Inbox] through pgx, with what only pgx does:
// pipelining (a delivery's first statements in one round trip, on a
// *pgxpool.Pool), the claim of many keys in one statement (group commit),
// lease mode, and transactions that tell whether a statement failed in
// them ([dedupdriver.AbortReporter]).
type PgxInbox struct {
	*inboxBase
	db PgxDB
	lq leaseSQL
}

var (
	_ dedupdriver.StartClaimer  = (*PgxInbox)(nil)
	_ dedupdriver.BeginClaimer  = (*PgxInbox)(nil)
	_ dedupdriver.BatchClaimer  = (*PgxInbox)(nil)
	_ dedup.LeaseStore          = (*PgxInbox)(nil)
	_ dedupdriver.AbortReporter = pgxInboxTx{}
)

// NewPgxInbox returns the inbox on db, PostgreSQL through pgx. Its
// transactions hand the handler a pgx.Tx ([InboxTxOf]).
func NewPgxInbox(db PgxDB, cfg InboxConfig) *PgxInbox {
	in := newInbox(pgxInboxDB{pgxExec{db}, db}, Postgres, cfg)
	return &PgxInbox{inboxBase: in, db: db, lq: newLeaseSQL(Postgres.Names(cfg.Schema))}
}

// inboxBase is Inbox, embedded under a name of the package's own.
type inboxBase = Inbox

// pgxInboxTx is the claim's transaction through pgx.
type pgxInboxTx struct{ *inboxTx }

// InboxAborted reports whether a statement of the transaction failed.
func (t pgxInboxTx) InboxAborted() bool { return t.c.(pgxInboxConn).aborted() }

func (in *PgxInbox) txOn(tx pgx.Tx) pgxInboxTx {
	return pgxInboxTx{in.inboxBase.txOn(newPgxInboxConn(tx))}
}

// InboxBegin starts the transaction that will hold the claim and the
// effect.
func (in *PgxInbox) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	tx, err := in.db.Begin(ctx)
	if err != nil {
		return nil, in.wrap(ctx, "begin", err)
	}
	return in.txOn(tx), nil
}

// acquirer is a DB that hands out connections of its own: a
// *pgxpool.Pool. Only on such a DB can the store drive a connection by
// hand, which the pipelined start and claim needs.
type acquirer interface {
	Acquire(ctx context.Context) (*pgxpool.Conn, error)
}

// endTimeout bounds the ROLLBACK that ends a transaction the caller will
// not get (a done key, a failed claim); past it the connection is closed.
const endTimeout = 5 * time.Second

var stmtBegin = stmt{sql: "begin"}

// InboxStartClaim counts an attempt of key, begins a transaction and
// claims key in it, in one round trip when the store's DB is a
// *pgxpool.Pool: the start statement, a Sync, BEGIN and the claim
// statement, and a second Sync go out together. The first Sync commits
// the start on its own, so that it is durable before the handler runs, as
// with InboxStart; BEGIN and the claim open the handler's transaction.
//
// A done or dead key costs one more round trip, the ROLLBACK of the
// transaction the pipeline opened. The claim's rare paths (a row committed
// while the claim waited, a failed key taken again) run their follow-up
// statements in the transaction, as InboxClaim does.
//
// The transaction's pgx.Tx is not pgx's own (pgx did not send the BEGIN):
// Exec, Query, QueryRow, SendBatch, CopyFrom, Prepare, Conn and nested
// Begin (savepoints) behave as on a pgx transaction, and so do Commit and
// Rollback (pgx.ErrTxCommitRollback for an aborted transaction,
// pgx.ErrTxClosed after the end); LargeObjects is not supported. The
// connection goes back to the pool when the transaction ends, and is closed
// instead when it is not idle then.
//
// On any other DB (a single connection, a transaction) it runs InboxStart,
// InboxBegin and InboxClaim in turn.
func (in *PgxInbox) InboxStartClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, dedup.InboxTx, dedup.Claim, error) {
	pool, ok := in.db.(acquirer)
	if !ok {
		start, err := in.InboxStart(ctx, key, window)
		if err != nil || start.State != dedup.StateNew {
			return start, nil, dedup.Claim{}, err
		}
		tx, claim, err := in.beginThenClaim(ctx, key, window)
		if err != nil {
			return start, nil, dedup.Claim{}, err
		}
		return start, tx, claim, nil
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return dedup.Claim{}, nil, dedup.Claim{}, in.wrap(ctx, "start", err)
	}
	p := in.windowed(key, window)
	start, claim, err := in.pipeline(ctx, c, p)
	if err != nil || start.State != dedup.StateNew {
		// start.Attempts tells the caller whether the start counted.
		return start, nil, dedup.Claim{}, errors.Join(err, endConn(ctx, c))
	}
	tx, got, err := in.claimedOn(ctx, c, key, p, dedupdriver.ClaimHint{New: true}, claim)
	if err != nil {
		return start, nil, dedup.Claim{}, err
	}
	return start, tx, got, nil
}

// claimedOn makes c, left in its transaction by a pipeline whose claim
// answered r, the handler's transaction, and finishes the claim's rare
// paths in it. On an error the transaction is rolled back and c goes back
// to the pool.
func (in *PgxInbox) claimedOn(ctx context.Context, c *pgxpool.Conn, key dedup.Key, p *params, hint dedupdriver.ClaimHint, r record) (dedup.InboxTx, dedup.Claim, error) {
	tx := in.txOn(&connTx{c: c})
	got, err := in.claimed(ctx, tx.c, key, p, hint, r, nil)
	if err != nil {
		end, cancel := context.WithTimeout(context.WithoutCancel(ctx), endTimeout)
		defer cancel()
		return nil, dedup.Claim{}, errors.Join(err, tx.Rollback(end))
	}
	return tx, got, nil
}

// beginThenClaim is InboxBeginClaim without a pipeline: InboxBegin, then
// InboxClaim, the transaction rolled back if the claim fails.
func (in *PgxInbox) beginThenClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.InboxTx, dedup.Claim, error) {
	tx, err := in.InboxBegin(ctx)
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
// start did not run, and the claim's record (status "" when it returned
// none). It leaves c in the transaction after a new key's start; the
// caller ends it on every other path.
func (in *PgxInbox) pipeline(ctx context.Context, c *pgxpool.Conn, p *params) (dedup.Claim, record, error) {
	conn := c.Conn()
	// The claim matters only when the start finds the key new: it is
	// claimNew.
	stmts, err := prepare(ctx, conn, in.q.start, stmtBegin, in.q.claimNew)
	if err != nil {
		return dedup.Claim{}, record{}, in.wrap(ctx, "start", err)
	}
	trace := traceStart(ctx, conn, p, in.q.start, stmtBegin, in.q.claimNew)
	pl := conn.PgConn().StartPipeline(ctx)
	stmts.send(pl, 0, p)
	pl.SendPipelineSync()
	stmts.send(pl, 1, p)
	stmts.send(pl, 2, p)
	err = pl.Sync()
	var first, second []result
	if err == nil {
		first, err = readSegment(pl, 1)
	}
	var brokenAfterStart error
	if err == nil {
		if second, err = readSegment(pl, 2); err != nil {
			brokenAfterStart, err = err, nil
		}
	}
	err = errors.Join(err, pl.Close())
	trace.end(errors.Join(err, brokenAfterStart), first, second)
	if err != nil {
		// The pipeline broke before the start's answer came back: the
		// start may have committed. StateNew with no count says so; the
		// caller takes a count back once the store answers.
		return dedup.Claim{State: dedup.StateNew}, record{}, in.wrap(ctx, "start", err)
	}
	startRes := first[0]
	if startRes.err != nil {
		return dedup.Claim{}, record{}, in.wrap(ctx, "start", startRes.err)
	}
	if len(startRes.rows) != 1 {
		return dedup.Claim{}, record{}, fmt.Errorf("%s: start: %d rows, want 1", in.name, len(startRes.rows))
	}
	var r record
	if err := startRes.scan(conn.TypeMap(), 0, r.dest()...); err != nil {
		return dedup.Claim{}, record{}, fmt.Errorf("%s: start: %w", in.name, err)
	}
	start, err := startOf(r)
	if err != nil || start.State != dedup.StateNew {
		return start, record{}, err
	}
	// From here the start is counted: errors return it.
	if brokenAfterStart != nil {
		return start, record{}, in.wrap(ctx, "claim", brokenAfterStart)
	}
	claim, err := in.claimFrom(ctx, conn, second)
	return start, claim, err
}

// claimFrom reads the answers of BEGIN and the claim statement, the
// claim's record with status "" when it returned none, and checks that the
// connection is in the transaction.
func (in *PgxInbox) claimFrom(ctx context.Context, conn *pgx.Conn, answers []result) (record, error) {
	if begin := answers[0]; begin.err != nil {
		return record{}, in.wrap(ctx, "begin", begin.err)
	}
	claimRes := answers[1]
	if claimRes.err != nil {
		return record{}, in.wrap(ctx, "claim", claimRes.err)
	}
	if st := conn.PgConn().TxStatus(); st != 'T' {
		return record{}, fmt.Errorf("%s: begin: connection not in a transaction after BEGIN (status %q)", in.name, st)
	}
	var r record
	switch len(claimRes.rows) {
	case 0:
	case 1:
		if err := claimRes.scan(conn.TypeMap(), 0, r.dest()...); err != nil {
			return record{}, fmt.Errorf("%s: claim: %w", in.name, err)
		}
		if r.status == "" {
			return record{}, fmt.Errorf("%s: claim: empty status", in.name)
		}
	default:
		return record{}, fmt.Errorf("%s: claim: %d rows, want at most 1", in.name, len(claimRes.rows))
	}
	return r, nil
}

// InboxBeginClaim begins a transaction and claims key in it, in one round
// trip when the store's DB is a *pgxpool.Pool: BEGIN, the claim statement
// and a Sync go out together. The transaction is the one InboxStartClaim
// returns; on any other DB it runs InboxBegin and InboxClaim in turn.
//
// With hint.New the claim is the INSERT alone: a key that has a record
// costs a round trip more, to read it. With hint.Unstarted the claim
// deletes no start count.
func (in *PgxInbox) InboxBeginClaim(ctx context.Context, key dedup.Key, window time.Duration, hint dedupdriver.ClaimHint) (dedup.InboxTx, dedup.Claim, error) {
	pool, ok := in.db.(acquirer)
	if !ok {
		return in.beginThenClaim(ctx, key, window)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, dedup.Claim{}, in.wrap(ctx, "begin", err)
	}
	p := in.windowed(key, window)
	r, err := in.beginClaim(ctx, c, p, in.claimStatement(hint))
	if err != nil {
		return nil, dedup.Claim{}, errors.Join(err, endConn(ctx, c))
	}
	return in.claimedOn(ctx, c, key, p, hint, r)
}

// beginClaim sends BEGIN [claim] Sync on c and reads the answers. It
// leaves c in the transaction when it succeeds; the caller ends it on
// every path.
func (in *PgxInbox) beginClaim(ctx context.Context, c *pgxpool.Conn, p *params, claim stmt) (record, error) {
	conn := c.Conn()
	stmts, err := prepare(ctx, conn, stmtBegin, claim)
	if err != nil {
		return record{}, in.wrap(ctx, "begin", err)
	}
	trace := traceStart(ctx, conn, p, stmtBegin, claim)
	pl := conn.PgConn().StartPipeline(ctx)
	stmts.send(pl, 0, p)
	stmts.send(pl, 1, p)
	err = pl.Sync()
	var answers []result
	if err == nil {
		answers, err = readSegment(pl, 2)
	}
	err = errors.Join(err, pl.Close())
	trace.end(err, answers)
	if err != nil {
		return record{}, in.wrap(ctx, "begin", err)
	}
	return in.claimFrom(ctx, conn, answers)
}
