package postgres

import "strings"

// queries holds the store's SQL, rendered once for the configured table.
// Every statement is parameterised; only the validated table name is
// spliced in.
type queries struct {
	claim, reclaim, read, complete, fail, deleteExpired string
	leaseClaim, leaseRead, leaseComplete, leaseRelease  string
	peek, doneKeys                                      string
}

func newQueries(table string) queries {
	r := strings.NewReplacer("{T}", table)
	return queries{
		// The claim writes the row as 'done' at once: it only becomes
		// visible when the transaction commits, together with the effect.
		// A concurrent claimer waits on the uncommitted row until then.
		// ON CONFLICT DO NOTHING takes no lock on an existing row, so
		// duplicates of a done key, the common case, never queue behind
		// each other; the outer SELECT answers them in the same round
		// trip. It runs on the statement's snapshot, so a row committed
		// while the INSERT waited is read again by the caller, and a
		// failed row is taken with reclaim.
		claim: r.Replace(`WITH ins AS (
	INSERT INTO {T} (consumer, key, status, attempts, done_at, expires_at)
	VALUES ($1, $2, 'done', 1, now(), now() + make_interval(secs => $3))
	ON CONFLICT (consumer, key) DO NOTHING
	RETURNING attempts, first_failed_at
)
SELECT 'new'::text, attempts, NULL::bytea, first_failed_at FROM ins
UNION ALL
SELECT status, attempts, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM ins)`),

		// Takes a key whose earlier attempts failed. A concurrent claimer
		// of the same failed key waits on the row lock and, if the first
		// commits, finds it no longer failed.
		reclaim: r.Replace(`UPDATE {T} SET status = 'done', attempts = attempts + 1, lease_until = NULL,
	updated_at = now(), done_at = now(), expires_at = now() + make_interval(secs => $3)
WHERE consumer = $1 AND key = $2 AND status = 'failed'
RETURNING attempts, first_failed_at`),

		read: r.Replace(`SELECT status, attempts, result, first_failed_at FROM {T} WHERE consumer = $1 AND key = $2`),

		complete: r.Replace(`UPDATE {T} SET result = $3 WHERE consumer = $1 AND key = $2`),

		fail: r.Replace(`INSERT INTO {T} AS i (consumer, key, status, attempts,
	first_error, last_error, first_failed_at, last_failed_at, expires_at)
VALUES ($1, $2, 'failed', 1, $3, $3, $4, $4, now() + make_interval(secs => $5))
ON CONFLICT (consumer, key) DO UPDATE
SET status = 'failed', attempts = i.attempts + 1, lease_until = NULL,
    first_error = COALESCE(i.first_error, EXCLUDED.first_error),
    first_failed_at = COALESCE(i.first_failed_at, EXCLUDED.first_failed_at),
    last_error = EXCLUDED.last_error, last_failed_at = EXCLUDED.last_failed_at,
    updated_at = now(), expires_at = EXCLUDED.expires_at
WHERE i.status <> 'done'`),

		// Reads the committed row only; a claim in progress is invisible.
		peek: r.Replace(`SELECT status, attempts, lease_until, result, first_failed_at,
	status = 'processing' AND lease_until > clock_timestamp()
FROM {T} WHERE consumer = $1 AND key = $2 AND expires_at > now()`),

		doneKeys: r.Replace(`SELECT key FROM {T}
WHERE consumer = $1 AND status = 'done' AND done_at >= $2 AND expires_at > now()`),

		// SKIP LOCKED: a row being claimed right now is not waited for.
		deleteExpired: r.Replace(`DELETE FROM {T} WHERE (consumer, key) IN (
	SELECT consumer, key FROM {T} WHERE expires_at < now()
	LIMIT $1 FOR UPDATE SKIP LOCKED)`),

		leaseClaim: r.Replace(`WITH claim AS (
	INSERT INTO {T} AS i (consumer, key, status, attempts, token, lease_until, expires_at)
	VALUES ($1, $2, 'processing', 1, 1, clock_timestamp() + make_interval(secs => $3),
	        now() + make_interval(secs => $4))
	ON CONFLICT (consumer, key) DO UPDATE
	SET status = 'processing', attempts = i.attempts + 1, token = i.token + 1,
	    lease_until = EXCLUDED.lease_until, updated_at = now(), expires_at = EXCLUDED.expires_at
	WHERE i.status = 'failed' OR (i.status = 'processing' AND i.lease_until <= clock_timestamp())
	RETURNING attempts, token, lease_until, first_failed_at
)
SELECT 'new'::text, attempts, token, lease_until, NULL::bytea, first_failed_at FROM claim
UNION ALL
SELECT status, attempts, token, lease_until, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM claim)`),

		leaseRead: r.Replace(`SELECT status, attempts, token, lease_until, result, first_failed_at FROM {T}
WHERE consumer = $1 AND key = $2`),

		leaseComplete: r.Replace(`UPDATE {T} SET status = 'done', result = $4, lease_until = NULL,
	done_at = now(), updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),

		leaseRelease: r.Replace(`UPDATE {T} SET status = 'failed', lease_until = NULL,
	first_error = COALESCE(first_error, $4), first_failed_at = COALESCE(first_failed_at, $5),
	last_error = $4, last_failed_at = $5, updated_at = now()
WHERE consumer = $1 AND key = $2 AND token = $3 AND status = 'processing'`),
	}
}
