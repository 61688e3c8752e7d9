// Package pgsql is the SQL of the PostgreSQL inbox, shared by
// dedup/postgres (pgx) and dedup/sqlstore's PostgreSQL dialect
// (database/sql), so that both stores run the same statements on the same
// tables.
package pgsql

import (
	"strings"

	"github.com/oncemill/oncemill/sqlschema"
)

// Queries holds the store's SQL, rendered once for the configured table.
// Every statement is parameterised; only the validated table name is
// spliced in.
type Queries struct {
	Start, Unstart, Bury, Reopen, DeadCopy             string
	Grant, Granted                                     string
	Claim, ClaimNew, ClaimNewUnstarted                 string
	Reclaim, Read, Complete, Fail, DeleteExpired       string
	LeaseClaim, LeaseRead, LeaseComplete, LeaseRelease string
	LeaseExtend, LeaseBury, LeaseAbandon               string
	Peek, DoneKeys, HasRecord                          string
	StartBatch, ClaimBatch                             string
}

// claimInsert takes a new key as done, visible at commit, and returns its
// row as the claim statements do; a key that has a record returns none.
const claimInsert = `INSERT INTO {T} (consumer, key, status, attempts, done_at, expires_at)
VALUES ($1, $2, 'done', 1, now(), now() + make_interval(secs => $3))
ON CONFLICT (consumer, key) DO NOTHING
RETURNING 'new'::text, attempts, NULL::bytea, first_failed_at`

// New renders the statements for the tables of names.
func New(names sqlschema.Names) Queries {
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts,
		"{SEQ}", names.Schema+`."`+names.InboxName+`_token_seq"`)
	return Queries{
		// Counts the attempt in the unlogged starts table, unless the key
		// is done or dead, which it reads in the same statement: a
		// duplicate is answered here, without a transaction. It commits on
		// its own, before the handler's transaction begins.
		Start: r.Replace(`WITH rec AS (
	SELECT status, attempts, result, first_failed_at FROM {T}
	WHERE consumer = $1 AND key = $2 AND status IN ('done', 'dead')
), st AS (
	INSERT INTO {S} AS s (consumer, key, started, expires_at)
	SELECT $1, $2, 1, now() + make_interval(secs => $3)
	WHERE NOT EXISTS (SELECT 1 FROM rec)
	ON CONFLICT (consumer, key) DO UPDATE SET started = s.started + 1, expires_at = EXCLUDED.expires_at
	RETURNING started
)
SELECT status, attempts, result, first_failed_at FROM rec
UNION ALL
SELECT 'new'::text, started, NULL::bytea, NULL::timestamptz FROM st`),

		// start for many keys of one consumer ($2, distinct), in one
		// statement: each key's row says new (counted), done or dead.
		//
		// Each key is looked up on its own (LATERAL … LIMIT 1 keeps the
		// planner from folding the lookups into a join): a generic plan
		// made while the table's statistics are stale would otherwise
		// scan every row of the consumer, and grow with the table.
		StartBatch: r.Replace(`WITH rec AS (
	SELECT r.* FROM unnest($2::text[]) AS k(key)
	CROSS JOIN LATERAL (
		SELECT t.key, t.status, t.attempts, t.result, t.first_failed_at FROM {T} t
		WHERE t.consumer = $1 AND t.key = k.key AND t.status IN ('done', 'dead') LIMIT 1) r
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

		// claim for many keys of one consumer ($2, distinct), in the
		// batch's transaction: the new keys are taken as done (visible
		// at commit), and their start counts go with the commit; a key
		// with a record already is not taken and returns no row. The start
		// rows are found one key at a time, as in startBatch, and deleted
		// by their row ids; a start row that a concurrent copy of a key
		// bumps meanwhile is left, on a key that is done.
		ClaimBatch: r.Replace(`WITH ins AS (
	INSERT INTO {T} (consumer, key, status, attempts, done_at, expires_at)
	SELECT $1, k, 'done', 1, now(), now() + make_interval(secs => $3) FROM unnest($2::text[]) AS k
	ON CONFLICT (consumer, key) DO NOTHING
	RETURNING key, attempts, first_failed_at
), del AS (
	DELETE FROM {S} WHERE ctid = ANY (ARRAY(
		SELECT s.ctid FROM ins CROSS JOIN LATERAL (
			SELECT ctid FROM {S} WHERE consumer = $1 AND key = ins.key LIMIT 1) s))
)
SELECT key, attempts, first_failed_at FROM ins`),

		Unstart: r.Replace(`UPDATE {S} SET started = started - 1
WHERE consumer = $1 AND key = $2 AND started > 0`),

		// Runs in the transaction that claimed the key.
		// The claim that took the key for burying counted itself as an
		// attempt; the bury takes that back.
		// It clears the key's replay grant: a grant reopens a key once.
		Bury: r.Replace(`UPDATE {T} SET status = 'dead', dead_at = now(), result = NULL, done_at = NULL,
	attempts = GREATEST(attempts - 1, 0), replay_grant = NULL,
	first_error = COALESCE(first_error, $3), first_failed_at = COALESCE(first_failed_at, $4),
	last_error = $3, last_failed_at = $4, updated_at = now()
WHERE consumer = $1 AND key = $2`),

		// Only for the grant written on the dead key; the attempts that
		// started are forgotten only when it reopens.
		Reopen: r.Replace(`WITH up AS (
	UPDATE {T} SET status = 'failed', attempts = 0, dead_at = NULL, lease_until = NULL, updated_at = now()
	WHERE consumer = $1 AND key = $2 AND status = 'dead' AND replay_grant = $3
	RETURNING 1
), del AS (
	DELETE FROM {S} WHERE consumer = $1 AND key = $2 AND EXISTS (SELECT 1 FROM up)
)
SELECT count(*) FROM up`),

		Grant: r.Replace(`UPDATE {T} SET replay_grant = $3, updated_at = now()
WHERE consumer = $1 AND key = $2 AND status = 'dead'`),

		Granted: r.Replace(`SELECT EXISTS (SELECT 1 FROM {T} WHERE consumer = $1 AND key = $2 AND replay_grant = $3)`),

		DeadCopy: r.Replace(`UPDATE {T} SET dead_copies = dead_copies + 1
WHERE consumer = $1 AND key = $2 AND status = 'dead'`),

		// The claim writes the row as 'done' at once: it only becomes
		// visible when the transaction commits, together with the effect.
		// A concurrent claimer waits on the uncommitted row until then.
		// ON CONFLICT DO NOTHING takes no lock on an existing row, so
		// duplicates of a done key, the common case, never queue behind
		// each other; the outer SELECT answers them in the same round
		// trip. It runs on the statement's snapshot, so a row committed
		// while the INSERT waited is read again by the caller, and a
		// failed row is taken with reclaim.
		//
		// The key's start count goes in the same statement: the delete
		// commits with the effect, and a rollback (or a crash) keeps it.
		Claim: r.Replace(`WITH del AS (
	DELETE FROM {S} WHERE consumer = $1 AND key = $2
), ins AS (
	INSERT INTO {T} (consumer, key, status, attempts, done_at, expires_at)
	VALUES ($1, $2, 'done', 1, now(), now() + make_interval(secs => $3))
	ON CONFLICT (consumer, key) DO NOTHING
	RETURNING attempts, first_failed_at
)
SELECT 'new'::text, attempts, NULL::bytea, first_failed_at FROM ins
UNION ALL
SELECT status, attempts, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM ins)`),

		// Claim for a key the caller expects to be new: the INSERT alone,
		// and the key's start count deleted with it. A key that has a
		// record returns no row, and the caller reads it in a statement of
		// its own (one round trip more): the UNION that answers it in
		// Claim costs a new key about a tenth of the server's work per
		// message (a new key's claim, effect and commit; measured with
		// pgbench on two cores).
		ClaimNew: r.Replace(`WITH del AS (
	DELETE FROM {S} WHERE consumer = $1 AND key = $2
)
` + claimInsert),

		// ClaimNew for a delivery that started no count (a broker's first
		// delivery, SkipAttemptRecord): no start row to delete. One that
		// an earlier copy of the key left stays until it expires; a
		// start on a key that is done answers done first.
		ClaimNewUnstarted: r.Replace(claimInsert),

		// Takes a key whose earlier attempts failed. A concurrent claimer
		// of the same failed key waits on the row lock and, if the first
		// commits, finds it no longer failed.
		Reclaim: r.Replace(`WITH del AS (DELETE FROM {S} WHERE consumer = $1 AND key = $2)
UPDATE {T} SET status = 'done', attempts = attempts + 1, lease_until = NULL,
	updated_at = now(), done_at = now(), expires_at = now() + make_interval(secs => $3)
WHERE consumer = $1 AND key = $2 AND status = 'failed'
RETURNING attempts, first_failed_at`),

		Read: r.Replace(`SELECT status, attempts, result, first_failed_at FROM {T} WHERE consumer = $1 AND key = $2`),

		Complete: r.Replace(`UPDATE {T} SET result = $3 WHERE consumer = $1 AND key = $2`),

		Fail: r.Replace(`INSERT INTO {T} AS i (consumer, key, status, attempts,
	first_error, last_error, first_failed_at, last_failed_at, expires_at)
VALUES ($1, $2, 'failed', 1, $3, $3, $4, $4, now() + make_interval(secs => $5))
ON CONFLICT (consumer, key) DO UPDATE
SET status = 'failed', attempts = i.attempts + 1, lease_until = NULL,
    first_error = COALESCE(i.first_error, EXCLUDED.first_error),
    first_failed_at = COALESCE(i.first_failed_at, EXCLUDED.first_failed_at),
    last_error = EXCLUDED.last_error, last_failed_at = EXCLUDED.last_failed_at,
    updated_at = now(), expires_at = EXCLUDED.expires_at
WHERE i.status NOT IN ('done', 'dead')`),

		// Reads the committed row only; a claim in progress is invisible.
		Peek: r.Replace(`SELECT status, attempts, lease_until, result, first_failed_at,
	status = 'processing' AND lease_until > clock_timestamp()
FROM {T} WHERE consumer = $1 AND key = $2 AND expires_at > now()`),

		DoneKeys: r.Replace(`SELECT key FROM {T}
WHERE consumer = $1 AND status = 'done' AND done_at >= $2 AND expires_at > now()`),

		// Any row, expired or not: a claim reads the row until cleanup
		// deletes it.
		HasRecord: r.Replace(`SELECT EXISTS (SELECT 1 FROM {T} WHERE consumer = $1 AND key = $2)`),

		// SKIP LOCKED: a row being claimed right now is not waited for.
		// Start counts left behind by a duplicate that lost a race go
		// with them, in the same statement.
		DeleteExpired: r.Replace(`WITH starts AS (
	DELETE FROM {S} WHERE (consumer, key) IN (
		SELECT consumer, key FROM {S} WHERE expires_at < now()
		LIMIT $1 FOR UPDATE SKIP LOCKED)
)
DELETE FROM {T} WHERE (consumer, key) IN (
	SELECT consumer, key FROM {T} WHERE expires_at < now()
	LIMIT $1 FOR UPDATE SKIP LOCKED)`),

		LeaseClaim: r.Replace(`WITH claim AS (
	INSERT INTO {T} AS i (consumer, key, status, attempts, token, lease_until, expires_at)
	VALUES ($1, $2, 'processing', 1, nextval('{SEQ}'), clock_timestamp() + make_interval(secs => $3),
	        now() + make_interval(secs => $4))
	ON CONFLICT (consumer, key) DO UPDATE
	SET status = 'processing', attempts = i.attempts + 1, token = EXCLUDED.token,
	    lease_until = EXCLUDED.lease_until, updated_at = now(), expires_at = EXCLUDED.expires_at
	WHERE i.status = 'failed' OR (i.status = 'processing' AND i.lease_until <= clock_timestamp())
	RETURNING attempts, token, lease_until, first_failed_at
)
SELECT 'new'::text, attempts, token, lease_until, NULL::bytea, first_failed_at FROM claim
UNION ALL
SELECT status, attempts, token, lease_until, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claim)`),

		LeaseRead: r.Replace(`SELECT status, attempts, token, lease_until, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2`),

		LeaseComplete: r.Replace(`UPDATE {T} SET status = 'done', result = $4, lease_until = NULL,
	done_at = now(), updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),

		LeaseExtend: r.Replace(`UPDATE {T} SET lease_until = clock_timestamp() + make_interval(secs => $4),
	expires_at = GREATEST(expires_at, clock_timestamp() + make_interval(secs => $4)), updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'
RETURNING lease_until`),

		LeaseBury: r.Replace(`UPDATE {T} SET status = 'dead', dead_at = now(), lease_until = NULL, replay_grant = NULL,
	first_error = COALESCE(first_error, $4), first_failed_at = COALESCE(first_failed_at, $5),
	last_error = $4, last_failed_at = $5, updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),

		// An abandoned attempt (shutdown) is not counted.
		LeaseAbandon: r.Replace(`UPDATE {T} SET status = 'failed', lease_until = NULL,
	attempts = GREATEST(attempts - 1, 0), updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),

		LeaseRelease: r.Replace(`UPDATE {T} SET status = 'failed', lease_until = NULL,
	first_error = COALESCE(first_error, $4), first_failed_at = COALESCE(first_failed_at, $5),
	last_error = $4, last_failed_at = $5, updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),
	}
}
