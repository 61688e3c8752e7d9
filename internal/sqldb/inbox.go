package sqldb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/sqlschema"
)

// Inbox is the transactional inbox store, written once for every dialect
// and both drivers: dedup/postgres (pgx), dedup/sqlstore (database/sql:
// PostgreSQL, MySQL) and dedup/sqlite are constructors over it. What
// differs per database is in the [Dialect] (placeholders, the upsert's
// form, RETURNING or the insert id, whether a write may sit in a WITH,
// which reads see the latest commit, error classes); what differs per
// driver (how a transaction begins and is handed to the handler, whether
// its connection was lost, pipelining) is in the driver.
//
// It implements [dedup.TxStore], [dedup.Expirer], [dedupdriver.Peeker],
// [dedupdriver.RecordFinder] and [dedupdriver.KeyLister]; its transactions
// implement [dedupdriver.Classifier]. It is safe for concurrent use and
// starts no goroutines.
type Inbox struct {
	db      inboxDriver
	d       *Dialect
	q       inboxSQL
	name    string // prefixes every error: the store's package
	missing error  // wrapped when a table is missing: the store's ErrNotMigrated
}

var (
	_ dedup.TxStore            = (*Inbox)(nil)
	_ dedup.Expirer            = (*Inbox)(nil)
	_ dedupdriver.Peeker       = (*Inbox)(nil)
	_ dedupdriver.RecordFinder = (*Inbox)(nil)
	_ dedupdriver.KeyLister    = (*Inbox)(nil)
	_ dedupdriver.BeginClaimer = (*Inbox)(nil)
	_ dedupdriver.Classifier   = (*inboxTx)(nil)
)

// InboxConfig is what a store package gives the inbox.
type InboxConfig struct {
	// Name prefixes the store's errors: its package's name.
	Name string
	// NotMigrated is wrapped, with dedup.ErrUnavailable, by the error of a
	// statement that finds a table missing.
	NotMigrated error
	// Schema names the tables, as the migrations were given it.
	Schema sqlschema.Config
}

func newInbox(db inboxDriver, d *Dialect, cfg InboxConfig) *Inbox {
	return &Inbox{db: db, d: d, q: d.inboxStatements(d.Names(cfg.Schema)), name: cfg.Name, missing: cfg.NotMigrated}
}

// NewSQLInbox returns the inbox on db, a database/sql database of dialect
// d. Its transactions hand the handler a *sql.Tx ([InboxTxOf]).
func NewSQLInbox(db *sql.DB, d *Dialect, cfg InboxConfig) *Inbox {
	return newInbox(sqlInboxDB{sqlExec{db}, db, d}, d, cfg)
}

type inboxTxKey struct{}

// InboxTxOf returns the driver's transaction in which an inbox claimed
// the message's key (a pgx.Tx, a *sql.Tx), or nil; the store packages'
// Tx accessors assert its type.
func InboxTxOf(ctx context.Context) any { return ctx.Value(inboxTxKey{}) }

// params returns the parameters of a call on key: its consumer and key as
// the table holds them (a digest where a column is shorter).
func (in *Inbox) params(key dedup.Key) *params {
	var p params
	p[argConsumer], p[argKey] = in.d.InboxArgs(key.Consumer, key.Key)
	p[argNow] = time.Now().UnixMicro()
	return &p
}

func (in *Inbox) windowed(key dedup.Key, window time.Duration) *params {
	p := in.params(key)
	p[argWindow] = window.Microseconds()
	return p
}

// exec, row and count run s with p on ex.
func exec(ctx context.Context, ex Executor, s stmt, p *params) (int64, error) {
	return ex.Exec(ctx, s.sql, s.bind(p)...)
}

func row(ctx context.Context, ex Executor, s stmt, p *params) Row {
	return ex.QueryRow(ctx, s.sql, s.bind(p)...)
}

// counted runs s, an INSERT or UPDATE that reports a count, and returns
// it: the row RETURNING gives, or the statement's insert id
// (LAST_INSERT_ID(expr)) where there is no RETURNING. 0 says no row.
func (in *Inbox) counted(ctx context.Context, ex inboxExec, s stmt, p *params) (int, error) {
	if !in.d.Returning {
		n, err := ex.execID(ctx, s.sql, s.bind(p)...)
		return int(n), err
	}
	var n int
	err := row(ctx, ex, s, p).Scan(&n)
	if errors.Is(err, ErrNoRows) {
		return 0, nil
	}
	return n, err
}

// wrap translates an error of the store's own call in one place: a
// missing table names the migration to run, and the infrastructure's
// errors wrap the dedup sentinels ([Dialect.Class]). ctx is the context
// the failed call ran on.
func (in *Inbox) wrap(ctx context.Context, op string, err error) error {
	if in.d.UndefinedTable(err) {
		return fmt.Errorf("%s: %s: %w: %w: %w", in.name, op, dedup.ErrUnavailable, in.missing, err)
	}
	if class := in.d.Class(err, ctx.Err() != nil); class != nil {
		return fmt.Errorf("%s: %s: %w: %w", in.name, op, class, err)
	}
	return fmt.Errorf("%s: %s: %w", in.name, op, err)
}

// failure returns f's text as the dialect's text columns hold it (valid
// UTF-8 without NUL, within the column's size) and its time in
// microseconds, now when it is zero.
func (in *Inbox) failure(p *params, f dedup.Failure) {
	s := strings.ReplaceAll(strings.ToValidUTF8(f.Err, "\uFFFD"), "\x00", "\uFFFD")
	if max := in.d.textBytes; max > 0 && len(s) > max {
		s = s[:max]
		for len(s) > 0 && !utf8.ValidString(s) {
			s = s[:len(s)-1]
		}
	}
	at := f.At
	if at.IsZero() {
		at = time.Now()
	}
	p[argErr], p[argAt] = s, at.UnixMicro()
}

// record is a key's record as a claim, a start or a read answers it:
// status "new" when this call took the key, "" when it returned none.
type record struct {
	status   string
	attempts int
	result   []byte
	first    time.Time
}

func (r *record) dest() []any { return []any{&r.status, &r.attempts, &r.result, Time(&r.first)} }

// InboxStart counts an attempt of key in a statement that commits at
// once, unless the key is done or dead, which it answers instead.
func (in *Inbox) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	c, sent, err := in.start(ctx, in.db, in.windowed(key, window))
	if err != nil {
		if sent && in.d.MaybeSent(err) {
			// The start may have committed.
			return dedup.Claim{State: dedup.StateNew}, in.wrap(ctx, "start", err)
		}
		return dedup.Claim{}, in.wrap(ctx, "start", err)
	}
	return c, nil
}

// start runs the start on ex; sent reports whether the statement that
// counts was sent.
func (in *Inbox) start(ctx context.Context, ex inboxExec, p *params) (c dedup.Claim, sent bool, err error) {
	var r record
	if in.d.writeCTE {
		err = row(ctx, ex, in.q.start, p).Scan(r.dest()...)
		sent = true
	} else {
		// A consistent read, which never waits on a claim in flight; a
		// key that becomes done between the two is counted once more
		// and found done by its claim, and the count is swept with it.
		err = row(ctx, ex, in.q.startRead, p).Scan(r.dest()...)
		if errors.Is(err, ErrNoRows) {
			sent = true
			r.status = "new"
			r.attempts, err = in.counted(ctx, ex, in.q.startCount, p)
		}
	}
	if err != nil {
		return dedup.Claim{}, sent, err
	}
	c, err = startOf(r)
	return c, sent, err
}

// startOf is the answer of a start that read r.
func startOf(r record) (dedup.Claim, error) {
	c, ok := claimOf(r)
	if !ok {
		return dedup.Claim{}, fmt.Errorf("start: unexpected status %q", r.status)
	}
	return c, nil
}

// claimOf is the claim a record of the transactional mode answers; ok is
// false for a status that mode never writes (a lease's).
func claimOf(r record) (c dedup.Claim, ok bool) {
	c = dedup.Claim{Attempts: r.attempts, FirstFailedAt: r.first}
	switch r.status {
	case "new":
		c.State = dedup.StateNew
	case "done":
		c.State, c.Result = dedup.StateDone, r.result
	case "dead":
		c.State = dedup.StateDead
	default:
		return dedup.Claim{}, false
	}
	return c, true
}

// InboxUnstart takes back one started attempt of key.
func (in *Inbox) InboxUnstart(ctx context.Context, key dedup.Key) error {
	if _, err := exec(ctx, in.db, in.q.unstart, in.params(key)); err != nil {
		return in.wrap(ctx, "unstart", err)
	}
	return nil
}

// InboxBegin starts the transaction that will hold the claim and the
// effect, on a connection of its own. Beginning is bounded by ctx; the
// transaction then lives until Commit or Rollback, whatever becomes of
// ctx, so that a handler can finish and commit while its consumer shuts
// down.
func (in *Inbox) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	c, err := in.db.begin(ctx, false)
	if err != nil {
		return nil, in.wrap(ctx, "begin", err)
	}
	return in.txOn(c), nil
}

// InboxBeginClaim begins a transaction and claims key in it, with the
// claim hint picks: a key expected new is claimed by the INSERT alone (a
// key that has a record costs a statement more, to read it), and a
// delivery that started no count deletes none. Without an error, the
// transaction is open; with one, nothing is held. Through pgx on a pool
// the two go out in one round trip ([PgxInbox.InboxBeginClaim]).
func (in *Inbox) InboxBeginClaim(ctx context.Context, key dedup.Key, window time.Duration, hint dedupdriver.ClaimHint) (dedup.InboxTx, dedup.Claim, error) {
	c, err := in.db.begin(ctx, false)
	if err != nil {
		return nil, dedup.Claim{}, in.wrap(ctx, "begin", err)
	}
	tx := in.txOn(c)
	p := in.windowed(key, window)
	r, err := in.claimOn(ctx, c, in.claimStatement(hint), p)
	claim, err := in.claimed(ctx, c, key, p, hint, r, err)
	if err != nil {
		return nil, dedup.Claim{}, errors.Join(err, tx.Rollback(context.WithoutCancel(ctx)))
	}
	return tx, claim, nil
}

// txOn is the inbox transaction on c.
func (in *Inbox) txOn(c inboxConn) *inboxTx { return &inboxTx{in: in, c: c} }

// InboxFail records a failed attempt outside any transaction. A done or
// dead key is left alone. A zero f.At is taken as now.
func (in *Inbox) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	p := in.windowed(key, window)
	in.failure(p, f)
	var err error
	if in.d.writeCTE {
		_, err = exec(ctx, in.db, in.q.fail, p)
	} else {
		// The key's row, then its failure row if the key is failed now
		// (not done or dead), in one transaction: READ COMMITTED, so that
		// a key with no row locks no gap another failure inserts into.
		err = in.inTx(ctx, in.d.SkipLocked, func(tx inboxConn) error {
			if _, err := exec(ctx, tx, in.q.failHot, p); err != nil {
				return err
			}
			var status string
			if err := row(ctx, tx, in.q.failedStatus, p).Scan(&status); err != nil || status != "failed" {
				return err
			}
			_, err := exec(ctx, tx, in.q.failFailure, p)
			return err
		})
	}
	if err != nil {
		return in.wrap(ctx, "record failure", err)
	}
	return nil
}

// InboxGrantReplay writes grant on key's record if the key is dead, so
// that the replay that carries it may reopen the key.
func (in *Inbox) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("%s: grant replay of consumer %q key %q: %w", in.name, key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	p := in.params(key)
	p[argGrant] = grant
	n, err := exec(ctx, in.db, in.q.grant, p)
	if err != nil {
		return false, in.wrap(ctx, "grant replay", err)
	}
	return n == 1, nil
}

// InboxReopen makes a dead key claimable again with its counts reset, and
// forgets its started attempts (a reopened key that kept them would be
// taken for a crash loop at its replay), only for the grant written on
// it.
func (in *Inbox) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	p := in.params(key)
	p[argGrant] = grant
	var n int64
	var err error
	if in.d.writeCTE {
		err = row(ctx, in.db, in.q.reopen, p).Scan(&n)
	} else {
		err = in.inTx(ctx, false, func(tx inboxConn) error {
			if n, err = exec(ctx, tx, in.q.reopenHot, p); err != nil || n != 1 {
				return err
			}
			if _, err := exec(ctx, tx, in.q.reopenFailure, p); err != nil {
				return err
			}
			_, err := exec(ctx, tx, in.q.clearStart, p)
			return err
		})
	}
	if err != nil {
		return false, in.wrap(ctx, "reopen", err)
	}
	return n == 1, nil
}

// inTx runs f in a transaction of its own, committed when f returns nil.
func (in *Inbox) inTx(ctx context.Context, readCommitted bool, f func(inboxConn) error) error {
	tx, err := in.db.begin(ctx, readCommitted)
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		return errors.Join(err, tx.rollback(context.WithoutCancel(ctx)))
	}
	return tx.commit(ctx)
}

// InboxReplayGranted reports whether key's record holds grant.
func (in *Inbox) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	p := in.params(key)
	p[argGrant] = grant
	var n int
	if err := row(ctx, in.db, in.q.granted, p).Scan(&n); err != nil {
		return false, in.wrap(ctx, "read replay grant", err)
	}
	return n > 0, nil
}

// InboxDeadCopy counts a copy of a dead key on its record.
func (in *Inbox) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if _, err := exec(ctx, in.db, in.q.deadCopy, in.params(key)); err != nil {
		return in.wrap(ctx, "count dead copy", err)
	}
	return nil
}

// InboxPeek reads key's committed, unexpired record, claiming nothing:
// StateDone with the stored result, StateDead, StateInFlight while a live
// lease holds it, else StateNew.
func (in *Inbox) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	var (
		r      record
		leased time.Time
	)
	err := row(ctx, in.db, in.q.peek, in.params(key)).Scan(append(r.dest(), Time(&leased))...)
	if errors.Is(err, ErrNoRows) {
		return dedup.Claim{State: dedup.StateNew}, nil
	}
	if err != nil {
		return dedup.Claim{}, in.wrap(ctx, "peek", err)
	}
	c := dedup.Claim{Attempts: r.attempts, FirstFailedAt: r.first}
	switch {
	case r.status == "done":
		c.State, c.Result = dedup.StateDone, r.result
	case r.status == "dead":
		c.State = dedup.StateDead
	case !leased.IsZero():
		c.State, c.Until = dedup.StateInFlight, leased
	default:
		c.State = dedup.StateNew
	}
	return c, nil
}

// InboxHasRecord reports whether key has a record, in any state, expired
// or not.
func (in *Inbox) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	var n int
	if err := row(ctx, in.db, in.q.hasRecord, in.params(key)).Scan(&n); err != nil {
		return false, in.wrap(ctx, "read record", err)
	}
	return n > 0, nil
}

// InboxDoneKeys streams the keys consumer completed at or after since,
// one row at a time from the server. Where a column is shorter than a key,
// the key is listed as the digest it is stored as ([Dialect.InboxKey]).
func (in *Inbox) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	p := in.params(dedup.Key{Consumer: consumer})
	p[argSince] = max(0, since.UnixMicro()) // the epoch at the earliest, which every column type holds
	rows, err := in.db.Query(ctx, in.q.doneKeys.sql, in.q.doneKeys.bind(p)...)
	if err != nil {
		return in.wrap(ctx, "done keys", err)
	}
	defer rows.Close()
	var key string
	for rows.Next() {
		if err := rows.Scan(&key); err != nil {
			return in.wrap(ctx, "done keys", err)
		}
		if err := fn(key); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return in.wrap(ctx, "done keys", err)
	}
	return nil
}

// InboxDeleteExpired deletes at most limit expired records, and at most
// limit expired start counts, never waiting for a row another transaction
// holds.
func (in *Inbox) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("%s: delete expired: limit must be positive, got %d", in.name, limit)
	}
	p := in.params(dedup.Key{})
	p[argLimit] = limit
	var (
		n   int64
		err error
	)
	if in.d.writeCTE {
		n, err = exec(ctx, in.db, in.q.sweep, p)
	} else {
		err = in.inTx(ctx, in.d.SkipLocked, func(tx inboxConn) error {
			if _, err := in.sweep(ctx, tx, in.q.expiredStarts, p, in.q.delStart); err != nil {
				return err
			}
			n, err = in.sweep(ctx, tx, in.q.expired, p, in.q.delFailure, in.q.delRec)
			return err
		})
	}
	if err != nil {
		return 0, in.wrap(ctx, "delete expired", err)
	}
	return int(n), nil
}

// sweep locks the keys list selects, skipping those another transaction
// holds, and deletes them one by one with dels, in order; it returns how
// many the last deleted.
func (in *Inbox) sweep(ctx context.Context, tx inboxConn, list stmt, p *params, dels ...stmt) (int64, error) {
	rows, err := tx.Query(ctx, list.sql, list.bind(p)...)
	keys, err := Collect(rows, err, func(r Rows) ([2]string, error) {
		var k [2]string
		return k, r.Scan(&k[0], &k[1])
	})
	var deleted int64
	for _, k := range keys {
		kp := *p
		kp[argConsumer], kp[argKey] = in.d.Text(k[0]), in.d.Text(k[1])
		var n int64
		for _, del := range dels {
			if n, err = exec(ctx, tx, del, &kp); err != nil {
				return deleted, err
			}
		}
		deleted += n
	}
	return deleted, err
}

// claimStatement is the claim for hint: each answers a new key with its
// row, and a key with a record with its row (claim, where it can) or
// none, which claimed then reads.
func (in *Inbox) claimStatement(hint dedupdriver.ClaimHint) stmt {
	switch {
	case !hint.New:
		return in.q.claim
	case hint.Unstarted:
		return in.q.claimNewUnstarted
	}
	return in.q.claimNew
}

// claimOn runs the claim statement s on ex: the record it returned, with
// status "new" when it took the key, or the zero record.
func (in *Inbox) claimOn(ctx context.Context, ex inboxExec, s stmt, p *params) (record, error) {
	if !in.d.Returning {
		id, err := ex.execID(ctx, s.sql, s.bind(p)...)
		if err != nil || id == 0 {
			return record{}, err
		}
		return record{status: "new", attempts: int(id)}, nil
	}
	var r record
	err := row(ctx, ex, s, p).Scan(r.dest()...)
	if errors.Is(err, ErrNoRows) {
		return record{}, nil
	}
	return r, err
}

// claimed finishes, on ex (the claim's transaction), a claim whose
// statement answered r, with the statements of its rare paths: a key the
// statement did not answer is read (a row committed while the claim
// waited on it is seen by a new statement), a failed key is taken again
// (reclaim waits on its row lock: of concurrent claimers of a failed key
// one takes it and the others find it done), and the key's start count is
// deleted with the claim where the claim did not do it.
func (in *Inbox) claimed(ctx context.Context, ex inboxExec, key dedup.Key, p *params, hint dedupdriver.ClaimHint, r record, err error) (dedup.Claim, error) {
	if err == nil && r.status == "" {
		r, err = in.read(ctx, ex, p)
	}
	if err == nil && r.status == "failed" {
		if r, err = in.reclaim(ctx, ex, p, r); err == nil && r.status == "" {
			// Another claimer took it first and committed: read what it
			// left.
			if r, err = in.read(ctx, ex, p); err == nil && r.status == "failed" {
				err = fmt.Errorf("key %q of consumer %q is still failed after a concurrent claim", key.Key, key.Consumer)
			}
		}
	}
	if err == nil && r.status == "new" && !in.d.writeCTE && !hint.Unstarted {
		_, err = exec(ctx, ex, in.q.clearStart, p)
	}
	if err != nil {
		return dedup.Claim{}, in.wrap(ctx, "claim", err)
	}
	c, ok := claimOf(r)
	if !ok {
		return dedup.Claim{}, fmt.Errorf("%s: claim: key %q of consumer %q is %q: it is claimed in lease mode; use one mode per consumer", in.name, key.Key, key.Consumer, r.status)
	}
	return c, nil
}

func (in *Inbox) read(ctx context.Context, ex inboxExec, p *params) (record, error) {
	var r record
	err := row(ctx, ex, in.q.read, p).Scan(r.dest()...)
	return r, err
}

// reclaim takes the failed key whose record was read as r, and counts the
// attempt on its failure row; the zero record says another claimer took
// it.
func (in *Inbox) reclaim(ctx context.Context, ex inboxExec, p *params, r record) (record, error) {
	if in.d.writeCTE {
		taken := record{status: "new"}
		err := row(ctx, ex, in.q.reclaim, p).Scan(&taken.attempts, Time(&taken.first))
		if errors.Is(err, ErrNoRows) {
			return record{}, nil
		}
		return taken, err
	}
	if n, err := exec(ctx, ex, in.q.reclaimHot, p); err != nil || n == 0 {
		return record{}, err
	}
	if !in.d.Returning {
		// The read locked the row (or the database has one writer): r
		// is its latest version.
		_, err := exec(ctx, ex, in.q.reclaimFailure, p)
		return record{status: "new", attempts: r.attempts + 1, first: r.first}, err
	}
	taken := record{status: "new"}
	err := row(ctx, ex, in.q.reclaimFailure, p).Scan(&taken.attempts, Time(&taken.first))
	return taken, err
}

// inboxTx is the claim's transaction.
type inboxTx struct {
	in *Inbox
	c  inboxConn
}

func (t *inboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	p := t.in.windowed(key, window)
	r, err := t.in.claimOn(ctx, t.c, t.in.q.claim, p)
	return t.in.claimed(ctx, t.c, key, p, dedupdriver.ClaimHint{}, r, err)
}

// InboxBury marks the claimed key dead, recording f.
func (t *inboxTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	p := t.in.params(key)
	t.in.failure(p, f)
	var err error
	if t.in.d.writeCTE {
		_, err = exec(ctx, t.c, t.in.q.bury, p)
	} else if _, err = exec(ctx, t.c, t.in.q.buryHot, p); err == nil {
		_, err = exec(ctx, t.c, t.in.q.buryFailure, p)
	}
	if err != nil {
		return t.in.wrap(ctx, "bury", err)
	}
	return nil
}

// InboxComplete stores result with the claimed key; a nil result is not
// written.
func (t *inboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if result == nil {
		return nil
	}
	p := t.in.params(key)
	p[argResult] = result
	if _, err := exec(ctx, t.c, t.in.q.complete, p); err != nil {
		return t.in.wrap(ctx, "complete", err)
	}
	return nil
}

func (t *inboxTx) WithTx(ctx context.Context) context.Context {
	return context.WithValue(ctx, inboxTxKey{}, t.c.handle())
}

// Commit commits. A commit whose connection was lost before it is
// unavailability (it did not commit); one whose connection failed after
// COMMIT may have been sent is ambiguous: the transaction may have
// committed.
func (t *inboxTx) Commit(ctx context.Context) error {
	lost := t.c.lost()
	err := t.c.commit(ctx)
	switch {
	case err == nil:
		return nil
	case lost:
		return fmt.Errorf("%s: commit: %w: the transaction's connection was lost before the commit: %w", t.in.name, dedup.ErrUnavailable, err)
	case t.in.d.MaybeSent(err):
		return fmt.Errorf("%s: commit: %w: %w", t.in.name, dedup.ErrAmbiguous, err)
	}
	return t.in.wrap(ctx, "commit", err)
}

// Rollback rolls back; after Commit or Rollback it does nothing.
func (t *inboxTx) Rollback(ctx context.Context) error {
	if err := t.c.rollback(ctx); err != nil {
		return fmt.Errorf("%s: rollback: %w", t.in.name, err)
	}
	return nil
}

// InboxClassify marks, among the errors the handler returned after
// writing through this transaction, those of the transaction itself. It
// asks the connection, not the error, whether it was lost (closed by a
// network error, a KILL, a server shutdown): unavailability. It reads only
// the server's own answer for a session the server ended, or for a
// conflict (a serialization failure, a deadlock, a lock wait timeout, a
// busy database: a transaction to run again). An io.EOF or a net.Error
// from the handler's own decoding or HTTP calls is the message's.
func (t *inboxTx) InboxClassify(err error) error {
	switch {
	case err == nil:
		return nil
	case t.c.lost() || t.in.d.SessionEnded(err):
		if errors.Is(err, dedup.ErrUnavailable) {
			return err
		}
		return fmt.Errorf("%w: the transaction's connection was lost: %w", dedup.ErrUnavailable, err)
	case t.in.d.Conflict(err) && !errors.Is(err, dedup.ErrConflict):
		return fmt.Errorf("%w: %w", dedup.ErrConflict, err)
	}
	return err
}

var _ delivery.HandOutMarks = (*Inbox)(nil)

// markParams are the parameters of a mark's statements: the group and
// the topic as the table holds them (a digest where a column is shorter).
func (in *Inbox) markParams(group, topic string, partition int32) *params {
	p := in.params(dedup.Key{})
	p[argGroup], p[argTopic] = in.d.InboxArgs(group, topic)
	p[argPartition] = int64(partition)
	return p
}

// InboxHandOutMark returns the highest offset group's subscriber may have
// handed out of topic's partition, -1 when it marked none.
func (in *Inbox) InboxHandOutMark(ctx context.Context, group, topic string, partition int32) (int64, error) {
	var mark int64
	err := row(ctx, in.db, in.q.markRead, in.markParams(group, topic, partition)).Scan(&mark)
	switch {
	case errors.Is(err, ErrNoRows):
		return -1, nil
	case err != nil:
		return 0, in.wrap(ctx, "read hand-out mark", err)
	}
	return mark, nil
}

// InboxMarkHandOut raises the mark of group's partition of topic to
// offset, in a statement that commits at once; a higher mark stays.
func (in *Inbox) InboxMarkHandOut(ctx context.Context, group, topic string, partition int32, offset int64) error {
	p := in.markParams(group, topic, partition)
	p[argOffset] = offset
	if _, err := exec(ctx, in.db, in.q.markWrite, p); err != nil {
		return in.wrap(ctx, "mark hand-out", err)
	}
	return nil
}
