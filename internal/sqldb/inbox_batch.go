package sqldb

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
)

// batchLockTimeout bounds how long the claim of a batch waits on a key
// that another transaction holds: past it the batch gives way, and its
// deliveries take the single-message path, where each waits for its own
// key only.
const batchLockTimeout = "100ms"

// InboxStartBatch counts an attempt of every key of consumer in one
// statement that commits at once (the starts table is UNLOGGED), and
// answers done and dead keys from the same statement, as
// InboxStart does for one key. keys must be distinct.
func (in *PgxInbox) InboxStartBatch(ctx context.Context, consumer string, keys []string, window time.Duration) ([]dedup.Claim, error) {
	rows, err := in.db.Query(ctx, in.lq.startBatch, consumer, keys, window.Seconds())
	if err != nil {
		return nil, in.batchStartError(ctx, err)
	}
	claims := make([]dedup.Claim, len(keys))
	at := index(keys)
	for rows.Next() {
		var (
			key, status string
			c           dedup.Claim
			firstFailed *time.Time
		)
		if err := rows.Scan(&key, &status, &c.Attempts, &c.Result, &firstFailed); err != nil {
			rows.Close()
			return nil, fmt.Errorf("%s: start batch: %w", in.name, err)
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
			rows.Close()
			return nil, fmt.Errorf("%s: start batch: unexpected status %q", in.name, status)
		}
		i, ok := at[key]
		if !ok {
			rows.Close()
			return nil, fmt.Errorf("%s: start batch: key %q was not asked for", in.name, key)
		}
		claims[i] = c
	}
	if err := rows.Err(); err != nil {
		return nil, in.batchStartError(ctx, err)
	}
	for i, c := range claims {
		if c.State == 0 {
			return nil, fmt.Errorf("%s: start batch: no answer for key %q", in.name, keys[i])
		}
	}
	return claims, nil
}

// batchStartError interprets a failed start of a batch; like
// InboxStart it tells a statement that may have been counted
// (the connection broke after it was sent) by wrapping
// [dedupdriver.ErrMaybeCounted].
func (in *PgxInbox) batchStartError(ctx context.Context, err error) error {
	if Postgres.MaybeSent(err) {
		return fmt.Errorf("%w: %w", dedupdriver.ErrMaybeCounted, in.wrap(ctx, "start batch", err))
	}
	return in.wrap(ctx, "start batch", err)
}

// InboxBeginClaimBatch begins a transaction and claims every key of
// consumer in it, in one round trip when the store's DB is a
// *pgxpool.Pool: BEGIN, a lock timeout for the claim, the claim of all
// the keys and the lock timeout's reset go out together. A key is taken
// when it is new (claims[i].State is StateNew); a key that has a record
// already (done meanwhile, failed before, dead) is left alone, its claim
// the zero Claim, for the caller to run on the single-message path. A
// key that another transaction holds makes the whole claim fail with an
// error wrapping [dedup.ErrConflict] within 100 ms, so that one held key
// never stalls a batch. keys must be distinct.
//
// The transaction's [Tx] is the one InboxStartClaim returns.
func (in *PgxInbox) InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (dedup.InboxTx, []dedup.Claim, error) {
	pool, ok := in.db.(acquirer)
	if !ok {
		return nil, nil, fmt.Errorf("%s: claim batch: %w", in.name, errNotPool)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return nil, nil, in.wrap(ctx, "claim batch", err)
	}
	b := &pgx.Batch{}
	b.Queue("begin")
	b.Queue("set local lock_timeout = '" + batchLockTimeout + "'")
	claimed := b.Queue(in.lq.claimBatch, consumer, keys, window.Seconds())
	b.Queue("set local lock_timeout to default")
	claims := make([]dedup.Claim, len(keys))
	at := index(keys)
	claimed.Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var (
				key         string
				c           dedup.Claim
				firstFailed *time.Time
			)
			if err := rows.Scan(&key, &c.Attempts, &firstFailed); err != nil {
				return err
			}
			if firstFailed != nil {
				c.FirstFailedAt = *firstFailed
			}
			i, ok := at[key]
			if !ok {
				return fmt.Errorf("key %q was not asked for", key)
			}
			c.State = dedup.StateNew
			claims[i] = c
		}
		return rows.Err()
	})
	err = c.Conn().SendBatch(ctx, b).Close()
	if err == nil && c.Conn().PgConn().TxStatus() != 'T' {
		err = fmt.Errorf("connection not in a transaction after BEGIN (status %q)", c.Conn().PgConn().TxStatus())
	}
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
			err = fmt.Errorf("%w: a key of the batch is held by another transaction: %w", dedup.ErrConflict, err)
		} else {
			err = in.wrap(ctx, "claim batch", err)
		}
		return nil, nil, errors.Join(err, endConn(ctx, c))
	}
	return in.txOn(&connTx{c: c}), claims, nil
}

// index maps each key to its place.
func index(keys []string) map[string]int {
	at := make(map[string]int, len(keys))
	for i, k := range keys {
		at[k] = i
	}
	return at
}
