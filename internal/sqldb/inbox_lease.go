package sqldb

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/sqlschema"
)

// Lease mode, through pgx: a fenced lease on the key's record for an
// effect outside the database. Tokens come from a sequence, so that a
// token is never issued twice for a key, even after its record expired.

// leaseSQL is lease mode's and group commit's statements, PostgreSQL's (pgx speaks nothing
// else), rendered once for the tables.
type leaseSQL struct {
	leaseClaim, leaseRead, leaseComplete, leaseExtend, leaseBury, leaseAbandon, leaseRelease string
	startBatch, claimBatch                                                                   string
}

func newLeaseSQL(names sqlschema.Names) leaseSQL {
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts, "{F}", names.InboxFailures, "{SEQ}", names.Schema+`."`+names.InboxName+`_token_seq"`)
	joined := ` FROM {T} i LEFT JOIN {F} f ON f.consumer = i.consumer AND f.key = i.key
WHERE i.consumer = $1 AND i.key = $2`
	attempts := "COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END)"
	lease := "i.status, " + attempts + ", COALESCE(i.token, 0), i.lease_until, i.result, f.first_failed_at"
	// The ends of a lease that change the failure row: one statement each,
	// answering how many of the key's rows it ended (1 for the current
	// token, else 0).
	end := func(set, failure string) string {
		return r.Replace(`WITH up AS (
	UPDATE {T} SET ` + set + `
	WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'
	RETURNING 1
), f AS (
	UPDATE {F} SET ` + failure + `, updated_at = now()
	WHERE consumer = $1 AND key = $2 AND EXISTS (SELECT 1 FROM up)
)
SELECT count(*) FROM up`)
	}
	failed := "first_error = COALESCE(first_error, $4), first_failed_at = COALESCE(first_failed_at, $5), last_error = $4, last_failed_at = $5"
	return leaseSQL{
		startBatch: r.Replace(`WITH rec AS (
	SELECT r.* FROM unnest($2::text[]) AS k(key)
	CROSS JOIN LATERAL (
		SELECT i.key, i.status, ` + attempts + ` AS attempts, i.result, f.first_failed_at
		FROM {T} i LEFT JOIN {F} f ON f.consumer = i.consumer AND f.key = i.key
		WHERE i.consumer = $1 AND i.key = k.key AND i.status IN ('done', 'dead') LIMIT 1) r
), st AS (
	INSERT INTO {S} AS s (consumer, key, started, expires_at)
	SELECT $1, k, 1, now() + make_interval(secs => $3) FROM unnest($2::text[]) AS k
	WHERE k <> ALL (ARRAY(SELECT key FROM rec))
	ON CONFLICT (consumer, key) DO UPDATE SET started = s.started + 1, expires_at = EXCLUDED.expires_at
	RETURNING key, started
)
SELECT key, status, attempts, result, first_failed_at FROM rec
UNION ALL
SELECT key, 'new'::text, started, NULL::bytea, NULL::timestamptz FROM st`),

		claimBatch: r.Replace(`WITH ins AS (
	INSERT INTO {T} (consumer, key, status, done_at, expires_at)
	SELECT $1, k, 'done', now(), now() + make_interval(secs => $3) FROM unnest($2::text[]) AS k
	ON CONFLICT (consumer, key) DO NOTHING
	RETURNING key
), del AS (
	DELETE FROM {S} WHERE ctid = ANY (ARRAY(
		SELECT s.ctid FROM ins CROSS JOIN LATERAL (
			SELECT ctid FROM {S} WHERE consumer = $1 AND key = ins.key LIMIT 1) s))
)
SELECT key, 1, NULL::timestamptz FROM ins`),

		// A lease's take counts its attempt on the key's failure row: the
		// lease is the attempt's record, so a holder that dies is counted
		// when its lease is taken over.
		leaseClaim: r.Replace(`WITH claim AS (
	INSERT INTO {T} AS i (consumer, key, status, token, lease_until, expires_at)
	VALUES ($1, $2, 'processing', nextval('{SEQ}'), clock_timestamp() + make_interval(secs => $3),
	        now() + make_interval(secs => $4))
	ON CONFLICT (consumer, key) DO UPDATE
	SET status = 'processing', token = EXCLUDED.token, lease_until = EXCLUDED.lease_until, expires_at = EXCLUDED.expires_at
	WHERE i.status = 'failed' OR (i.status = 'processing' AND i.lease_until <= clock_timestamp())
	RETURNING token, lease_until
), att AS (
	INSERT INTO {F} AS f (consumer, key, attempts) SELECT $1, $2, 1 FROM claim
	ON CONFLICT (consumer, key) DO UPDATE SET attempts = f.attempts + 1, updated_at = now()
	RETURNING attempts, first_failed_at
)
SELECT 'new'::text, att.attempts, claim.token, claim.lease_until, NULL::bytea, att.first_failed_at FROM claim, att
UNION ALL
SELECT ` + lease + joined + ` AND NOT EXISTS (SELECT 1 FROM claim)`),

		leaseRead: r.Replace(`SELECT ` + lease + joined),

		leaseComplete: r.Replace(`UPDATE {T} SET status = 'done', result = $4, lease_until = NULL, done_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),

		leaseExtend: r.Replace(`UPDATE {T} SET lease_until = clock_timestamp() + make_interval(secs => $4),
	expires_at = GREATEST(expires_at, clock_timestamp() + make_interval(secs => $4))
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'
RETURNING lease_until`),

		leaseBury: end("status = 'dead', lease_until = NULL, result = NULL, done_at = NULL",
			"dead_at = now(), replay_grant = NULL, "+failed),
		// An abandoned attempt (shutdown) is not counted.
		leaseAbandon: end("status = 'failed', lease_until = NULL", "attempts = GREATEST(attempts - 1, 0)"),
		leaseRelease: end("status = 'failed', lease_until = NULL", failed),
	}
}

// leaseFailure is f's text and time as the statements take them.
func (in *PgxInbox) leaseFailure(f dedup.Failure) (string, time.Time) {
	var p params
	in.failure(&p, f)
	return p[argErr].(string), time.UnixMicro(p[argAt].(int64))
}

// LeaseClaim takes key for lease unless it is done or held by a live lease.
func (in *PgxInbox) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	var r leaseRow
	err := in.db.QueryRow(ctx, in.lq.leaseClaim, key.Consumer, key.Key, lease.Seconds(), window.Seconds()).
		Scan(&r.status, &r.attempts, &r.token, &r.until, &r.result, &r.firstFailed)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && r.status == "failed") {
		// The outer SELECT runs on the snapshot taken before the INSERT
		// waited for a concurrent claimer, so it may miss or misreport the
		// row; read it again. A failed row here was released after this
		// claim looked: the caller retries soon as if it were in flight.
		r = leaseRow{}
		err = in.db.QueryRow(ctx, in.lq.leaseRead, key.Consumer, key.Key).
			Scan(&r.status, &r.attempts, &r.token, &r.until, &r.result, &r.firstFailed)
	}
	if err != nil {
		return dedup.Claim{}, in.wrap(ctx, "lease claim", err)
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
		return dedup.Claim{}, fmt.Errorf("%s: lease claim: unexpected status %q", in.name, r.status)
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
func (in *PgxInbox) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	tag, err := in.db.Exec(ctx, in.lq.leaseComplete, key.Consumer, key.Key, token, result)
	if err != nil {
		return in.wrap(ctx, "lease complete", err)
	}
	if tag.RowsAffected() == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}

// LeaseExtend renews the lease of token to end lease from now.
func (in *PgxInbox) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	var until time.Time
	err := in.db.QueryRow(ctx, in.lq.leaseExtend, key.Consumer, key.Key, token, lease.Seconds()).Scan(&until)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, dedup.ErrLeaseLost
	}
	if err != nil {
		return time.Time{}, in.wrap(ctx, "lease extend", err)
	}
	return until, nil
}

// LeaseBury marks key dead if token is still current.
func (in *PgxInbox) LeaseBury(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	e, at := in.leaseFailure(f)
	return in.leaseEnd(ctx, "lease bury", in.lq.leaseBury, key.Consumer, key.Key, token, e, at)
}

// LeaseRelease marks key failed, claimable at once, if token is still
// current; an abandoned attempt takes its count back and records no error.
func (in *PgxInbox) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if f.Abandoned {
		return in.leaseEnd(ctx, "lease release", in.lq.leaseAbandon, key.Consumer, key.Key, token)
	}
	e, at := in.leaseFailure(f)
	return in.leaseEnd(ctx, "lease release", in.lq.leaseRelease, key.Consumer, key.Key, token, e, at)
}

// leaseEnd runs one of the lease's ends, which answer how many rows they
// ended: none is a lost lease.
func (in *PgxInbox) leaseEnd(ctx context.Context, op, sql string, args ...any) error {
	var n int
	if err := in.db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		return in.wrap(ctx, op, err)
	}
	if n == 0 {
		return dedup.ErrLeaseLost
	}
	return nil
}
