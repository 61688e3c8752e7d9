package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/dedup/internal/pgsql"
	"github.com/oncemill/oncemill/internal/typednil"
	"github.com/oncemill/oncemill/sqlschema"
)

// storable is an error text as PostgreSQL's text columns can hold it:
// invalid UTF-8 and NUL characters, which PostgreSQL refuses, become
// U+FFFD. Without it a handler error that quotes a binary payload would
// make the failure's own record fail, and the message would loop
// uncounted.
func storable(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// ErrNotMigrated is returned, wrapped, when the inbox table does not exist.
var ErrNotMigrated = errors.New("postgres: inbox table missing: run sqlschema.Migrate with the same Schema and Table")

// DB is what the store needs of PostgreSQL: a *pgxpool.Pool satisfies it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Config names the tables: it is [sqlschema.Config], the value
// [sqlschema.Migrate] created them with, so that the migrator, the store,
// the outbox (forwarder) and the dead-letter table (dlq) take one value and
// cannot name different tables. The store reads Schema and InboxTable. The
// zero value is ready to use.
type Config = sqlschema.Config

// Store keeps inbox records in a PostgreSQL table created by
// [sqlschema.Migrate]. It implements [dedup.TxStore], [dedup.LeaseStore] and
// [dedup.Expirer], and is safe for concurrent use. It starts no goroutines.
type Store struct {
	db DB
	q  pgsql.Queries
}

var (
	_ dedupdriver.Classifier    = (*inboxTx)(nil)
	_ dedupdriver.AbortReporter = (*inboxTx)(nil)
)

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.LeaseStore         = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
)

// New returns a store on db. It does not create the table: run
// [sqlschema.Migrate] with the same Config first.
func New(db DB, cfg Config) (*Store, error) {
	if typednil.Is(db) {
		return nil, errors.New("postgres: db is nil")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	names := sqlschema.NamesFor(sqlschema.Postgres, cfg)
	return &Store{db: db, q: pgsql.New(names)}, nil
}

type txKey struct{}

// Tx returns the transaction in which the inbox claimed the message's key;
// a handler writes its effect through it so that the effect and the claim
// commit together. It returns nil when ctx carries none (the handler is not
// running under an inbox with this store).
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey{}).(pgx.Tx)
	return tx
}

// InboxBegin starts the transaction that will hold the claim and the effect.
func (s *Store) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, interpret(ctx, "begin", err)
	}
	return &inboxTx{tx: tx, q: &s.q}, nil
}

// InboxStart counts an attempt of key in one statement that commits at
// once and writes no WAL (the starts table is UNLOGGED), and answers a done
// or dead key from the same statement.
func (s *Store) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	var (
		status      string
		c           dedup.Claim
		firstFailed *time.Time
	)
	err := s.db.QueryRow(ctx, s.q.Start, key.Consumer, key.Key, seconds(window)).
		Scan(&status, &c.Attempts, &c.Result, &firstFailed)
	if err != nil {
		if maybeSent(err) {
			// The start may have committed.
			return dedup.Claim{State: dedup.StateNew}, interpret(ctx, "start", err)
		}
		return dedup.Claim{}, interpret(ctx, "start", err)
	}
	if firstFailed != nil {
		c.FirstFailedAt = *firstFailed
	}
	switch status {
	case "new":
		c.State = dedup.StateNew
	case "done":
		c.State = dedup.StateDone
	case "dead":
		c.State, c.Result = dedup.StateDead, nil
	default:
		return dedup.Claim{}, fmt.Errorf("postgres: start: unexpected status %q", status)
	}
	return c, nil
}

// InboxUnstart takes back one started attempt of key.
func (s *Store) InboxUnstart(ctx context.Context, key dedup.Key) error {
	if _, err := s.db.Exec(ctx, s.q.Unstart, key.Consumer, key.Key); err != nil {
		return interpret(ctx, "unstart", err)
	}
	return nil
}

// InboxGrantReplay writes grant on key's row if the key is dead, so that
// the replay that carries it may reopen the key. dlq.Store does this
// itself on the inbox table beside the dead-letter table.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("postgres: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	tag, err := s.db.Exec(ctx, s.q.Grant, key.Consumer, key.Key, grant)
	if err != nil {
		return false, interpret(ctx, "grant replay", err)
	}
	return tag.RowsAffected() == 1, nil
}

// InboxReopen makes a dead key claimable again with its counts reset, only
// for the grant written on it.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	var n int
	if err := s.db.QueryRow(ctx, s.q.Reopen, key.Consumer, key.Key, grant).Scan(&n); err != nil {
		return false, interpret(ctx, "reopen", err)
	}
	return n == 1, nil
}

// InboxReplayGranted reports whether key's row holds grant.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	var ok bool
	if err := s.db.QueryRow(ctx, s.q.Granted, key.Consumer, key.Key, grant).Scan(&ok); err != nil {
		return false, interpret(ctx, "read replay grant", err)
	}
	return ok, nil
}

// InboxDeadCopy counts a copy of a dead key on its record.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if _, err := s.db.Exec(ctx, s.q.DeadCopy, key.Consumer, key.Key); err != nil {
		return interpret(ctx, "count dead copy", err)
	}
	return nil
}

// InboxFail records a failed attempt outside any transaction. A done or
// dead key is left alone.
func (s *Store) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	_, err := s.db.Exec(ctx, s.q.Fail, key.Consumer, key.Key, storable(f.Err), f.At, seconds(window))
	if err != nil {
		return interpret(ctx, "record failure", err)
	}
	return nil
}

// InboxDeleteExpired deletes at most limit expired records in one statement.
func (s *Store) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("postgres: delete expired: limit must be positive, got %d", limit)
	}
	tag, err := s.db.Exec(ctx, s.q.DeleteExpired, limit)
	if err != nil {
		return 0, interpret(ctx, "delete expired", err)
	}
	return int(tag.RowsAffected()), nil
}

// LeaseClaim takes key for lease unless it is done or held by a live lease.
func (s *Store) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	var r leaseRow
	err := s.db.QueryRow(ctx, s.q.LeaseClaim, key.Consumer, key.Key, seconds(lease), seconds(window)).
		Scan(&r.status, &r.attempts, &r.token, &r.until, &r.result, &r.firstFailed)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && r.status == "failed") {
		// The outer SELECT runs on the snapshot taken before the INSERT
		// waited for a concurrent claimer, so it may miss or misreport the
		// row; read it again. A failed row here was released after this
		// claim looked: the caller retries soon as if it were in flight.
		r = leaseRow{}
		err = s.db.QueryRow(ctx, s.q.LeaseRead, key.Consumer, key.Key).
			Scan(&r.status, &r.attempts, &r.token, &r.until, &r.result, &r.firstFailed)
	}
	if err != nil {
		return dedup.Claim{}, interpret(ctx, "lease claim", err)
	}
	c := dedup.Claim{Attempts: r.attempts}
	if r.firstFailed != nil {
		c.FirstFailedAt = *r.firstFailed
	}
	if r.until != nil {
		c.Until = *r.until
	}
	switch r.status {
	case "new":
		c.State, c.Token = dedup.StateNew, r.token
	case "done":
		c.State, c.Result, c.Until = dedup.StateDone, r.result, time.Time{}
	case "dead":
		c.State, c.Until = dedup.StateDead, time.Time{}
	case "processing", "failed":
		c.State = dedup.StateInFlight
	default:
		return dedup.Claim{}, fmt.Errorf("postgres: lease claim: unexpected status %q", r.status)
	}
	return c, nil
}

type leaseRow struct {
	status   string
	attempts int
	token    int64
	until    *time.Time
	result   []byte

	firstFailed *time.Time
}

// LeaseComplete marks key done with result if token is still current.
func (s *Store) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	tag, err := s.db.Exec(ctx, s.q.LeaseComplete, key.Consumer, key.Key, token, result)
	if err != nil {
		return interpret(ctx, "lease complete", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

// LeaseExtend renews the lease of token to end lease from now.
func (s *Store) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	var until time.Time
	err := s.db.QueryRow(ctx, s.q.LeaseExtend, key.Consumer, key.Key, token, seconds(lease)).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, dedup.ErrLeaseLost
	}
	if err != nil {
		return time.Time{}, interpret(ctx, "lease extend", err)
	}
	return until, nil
}

// LeaseBury marks key dead if token is still current.
func (s *Store) LeaseBury(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	tag, err := s.db.Exec(ctx, s.q.LeaseBury, key.Consumer, key.Key, token, storable(f.Err), f.At)
	if err != nil {
		return interpret(ctx, "lease bury", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

// LeaseRelease marks key failed, claimable at once, if token is still
// current; an abandoned attempt takes its count back and records no error.
func (s *Store) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	var (
		tag pgconn.CommandTag
		err error
	)
	if f.Abandoned {
		tag, err = s.db.Exec(ctx, s.q.LeaseAbandon, key.Consumer, key.Key, token)
	} else {
		tag, err = s.db.Exec(ctx, s.q.LeaseRelease, key.Consumer, key.Key, token, storable(f.Err), f.At)
	}
	if err != nil {
		return interpret(ctx, "lease release", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

type inboxTx struct {
	tx pgx.Tx
	q  *pgsql.Queries
}

func (t *inboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	var r claimRow
	err := t.tx.QueryRow(ctx, t.q.Claim, key.Consumer, key.Key, seconds(window)).Scan(&r.status, &r.attempts, &r.result, &r.firstFailed)
	return t.claimed(ctx, key, window, r, err)
}

// claimRow is a row of the claim statement (and of read).
type claimRow struct {
	status      string
	attempts    int
	result      []byte
	firstFailed *time.Time
}

// claimed finishes a claim whose statement answered r, or err
// (pgx.ErrNoRows when it returned no row), with the follow-up statements
// of its rare paths, in the transaction.
func (t *inboxTx) claimed(ctx context.Context, key dedup.Key, window time.Duration, r claimRow, err error) (dedup.Claim, error) {
	status, attempts, result, firstFailed := r.status, r.attempts, r.result, r.firstFailed
	if errors.Is(err, pgx.ErrNoRows) {
		// A concurrent claimer committed while this statement waited on
		// its row: the INSERT saw the row, the statement's snapshot did
		// not. A new statement sees it.
		err = t.tx.QueryRow(ctx, t.q.Read, key.Consumer, key.Key).Scan(&status, &attempts, &result, &firstFailed)
	}
	if err == nil && status == "failed" {
		result = nil
		err = t.tx.QueryRow(ctx, t.q.Reclaim, key.Consumer, key.Key, seconds(window)).Scan(&attempts, &firstFailed)
		if err == nil {
			status = "new"
		} else if errors.Is(err, pgx.ErrNoRows) {
			// Another claimer took it first and committed: read what it
			// left.
			err = t.tx.QueryRow(ctx, t.q.Read, key.Consumer, key.Key).Scan(&status, &attempts, &result, &firstFailed)
			if err == nil && status == "failed" {
				err = fmt.Errorf("key %q of consumer %q is still failed after a concurrent claim", key.Key, key.Consumer)
			}
		}
	}
	if err != nil {
		return dedup.Claim{}, interpret(ctx, "claim", err)
	}
	var first time.Time
	if firstFailed != nil {
		first = *firstFailed
	}
	switch status {
	case "new":
		return dedup.Claim{State: dedup.StateNew, Attempts: attempts, FirstFailedAt: first}, nil
	case "done":
		return dedup.Claim{State: dedup.StateDone, Attempts: attempts, Result: result, FirstFailedAt: first}, nil
	case "dead":
		return dedup.Claim{State: dedup.StateDead, Attempts: attempts, FirstFailedAt: first}, nil
	default:
		return dedup.Claim{}, fmt.Errorf("postgres: claim: key %q of consumer %q is %q: it is claimed in lease mode; use one mode per consumer", key.Key, key.Consumer, status)
	}
}

func (t *inboxTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	if _, err := t.tx.Exec(ctx, t.q.Bury, key.Consumer, key.Key, storable(f.Err), f.At); err != nil {
		return interpret(ctx, "bury", err)
	}
	return nil
}

func (t *inboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if result == nil {
		return nil
	}
	if _, err := t.tx.Exec(ctx, t.q.Complete, key.Consumer, key.Key, result); err != nil {
		return interpret(ctx, "complete", err)
	}
	return nil
}

func (t *inboxTx) WithTx(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

// Commit commits. An error that is not the server's answer (the
// connection broke while COMMIT was in flight) is ambiguous: the
// transaction may have committed.
func (t *inboxTx) Commit(ctx context.Context) error {
	err := t.tx.Commit(ctx)
	if err == nil {
		return nil
	}
	if maybeSent(err) {
		return fmt.Errorf("postgres: commit: %w: %w", dedup.ErrAmbiguous, err)
	}
	return interpret(ctx, "commit", err)
}

func (t *inboxTx) Rollback(ctx context.Context) error {
	err := t.tx.Rollback(ctx)
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return fmt.Errorf("postgres: rollback: %w", err)
	}
	return nil
}

// interpret translates driver errors in one place: a missing table gets a
// hint for the fix, and the infrastructure's errors wrap the dedup
// sentinels (see [classify]). ctx is the context the failed call ran on.
func interpret(ctx context.Context, op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgsql.UndefinedTable(pgErr.Code) {
		return fmt.Errorf("postgres: %s: %w: %w: %w", op, dedup.ErrUnavailable, ErrNotMigrated, err)
	}
	if class := classify(err, ctx.Err() != nil); class != nil {
		return fmt.Errorf("postgres: %s: %w: %w", op, class, err)
	}
	return fmt.Errorf("postgres: %s: %w", op, err)
}

// classify returns the dedup sentinel for an infrastructure error, or nil
// for an error of the statement, the message or the caller. callerDone
// reports whether the context of the call that failed is done; it is true
// when that context is not known (an error the handler returned).
//
//   - A connect that failed (*pgconn.ConnectError), for whatever reason,
//     its own connect timeout included, is unavailability: nothing of the
//     message reached the server.
//   - A deadline or cancellation is the caller's own when callerDone:
//     Watermill's Timeout middleware on the message, a handler's
//     context.WithTimeout, a shutdown. It is the message's, not the
//     store's. One that the caller's context did not cause (a timeout
//     inside the driver or the pool) is unavailability, as in dedup/redis.
//   - The server's answer is classed by its SQLSTATE in pgsql.Class,
//     shared with dedup/sqlstore: a serialization failure or deadlock is a
//     conflict to retry; a server shutting down, out of connections, read
//     only or with a broken connection, and tables the store cannot use
//     (missing, or not granted to its user), are unavailability.
//   - A connection that failed ([connectionError]) is unavailability.
func classify(err error, callerDone bool) error {
	if err == nil {
		return nil
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return dedup.ErrUnavailable
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) {
		if callerDone {
			return nil
		}
		return dedup.ErrUnavailable
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgsql.Class(pgErr.Code)
	}
	if connectionError(err) {
		return dedup.ErrUnavailable
	}
	return nil
}

// maybeSent reports whether err says that a statement was sent and the
// connection broke before its answer came back, so that the statement
// may have run: not the server's own answer, not a connect that failed,
// not an error pgconn knows was raised before anything was sent.
func maybeSent(err error) bool {
	var (
		pgErr      *pgconn.PgError
		connectErr *pgconn.ConnectError
	)
	return !errors.As(err, &pgErr) && !errors.As(err, &connectErr) && connectionError(err) && !pgconn.SafeToRetry(err)
}

// connectionError reports whether err says the connection to the server
// failed, as opposed to an error of the statement, the message or the
// caller: nothing was sent (pgconn.SafeToRetry), the connect failed, the
// socket broke or was closed, the pool was closed.
func connectionError(err error) bool {
	var (
		connectErr *pgconn.ConnectError
		netErr     net.Error
	)
	return pgconn.SafeToRetry(err) || errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, puddle.ErrClosedPool) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// InboxClassify marks, among the errors the handler returned after writing
// through this transaction, those of the transaction itself: its
// connection was lost (closed by a network error, a server that shut down
// or crashed, a FATAL error) — unavailability — or the server aborted it
// for a serialization failure or a deadlock — a conflict to run again. It
// asks the connection and reads only the server's own answer
// (*pgconn.PgError), never what else the error wraps: an io.EOF or a
// net.Error from the handler's own decoding or HTTP calls is the
// message's.
func (t *inboxTx) InboxClassify(err error) error {
	if err == nil {
		return nil
	}
	if conn := t.tx.Conn(); conn == nil || conn.IsClosed() {
		if errors.Is(err, dedup.ErrUnavailable) {
			return err
		}
		return fmt.Errorf("%w: the transaction's connection was lost: %w", dedup.ErrUnavailable, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01") && !errors.Is(err, dedup.ErrConflict) {
		return fmt.Errorf("%w: %w", dedup.ErrConflict, err)
	}
	return err
}

// InboxAborted reports whether a statement of the transaction failed: the
// connection's transaction status is 'E' (failed), known locally from the
// server's last ReadyForQuery.
func (t *inboxTx) InboxAborted() bool {
	conn := t.tx.Conn()
	return conn != nil && !conn.IsClosed() && conn.PgConn().TxStatus() == 'E'
}

func seconds(d time.Duration) float64 { return d.Seconds() }
