package forwarder

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/sqlschema"
)

// DefaultLedgerRetention is how long the relay keeps ledger rows when
// RelayConfig.LedgerRetention is zero.
const DefaultLedgerRetention = 7 * 24 * time.Hour

// ErrNoLedger is returned by [Relay.PruneLedger] when RelayConfig.Ledger
// is not set.
var ErrNoLedger = errors.New("forwarder: RelayConfig.Ledger is not set")

const (
	// ledgerPruneInterval is how often a running relay deletes the ledger
	// rows past their retention.
	ledgerPruneInterval = time.Minute
	// ledgerPruneBatch is the most ledger rows one statement deletes, so
	// that no delete holds long locks or writes a large WAL (or binlog)
	// burst.
	ledgerPruneBatch = 1000
)

func (c RelayConfig) validateLedger() error {
	switch {
	case c.LedgerRetention < 0:
		return fmt.Errorf("forwarder: RelayConfig.LedgerRetention must not be negative, got %s", c.LedgerRetention)
	case c.Ledger && c.LedgerRetention < time.Minute:
		return fmt.Errorf("forwarder: RelayConfig.LedgerRetention must be at least 1m, got %s", c.LedgerRetention)
	}
	return nil
}

// ledgerKey is the idempotency key the ledger records for x: the one the
// inbox's default KeyFunc derives, its idempotency_key metadata, else its
// UUID. It is recorded in its delivery.Bound form, so that a key of any
// length fits the ledger's index; the inbox refuses a key that long
// (middleware.MaxKeyBytes), so reconcile finds no record of it either way.
func ledgerKey(x row) string {
	if k, ok := x.metadata[delivery.IdempotencyKey]; ok {
		return k
	}
	return x.uuid
}

// pgRecord records one row in the PostgreSQL ledger (arguments: uuid,
// topic, partition key, idempotency key), at the transaction's now(), as
// the take statement does; empty without a ledger.
func pgRecord(names sqlschema.Names, ledger bool) string {
	if !ledger {
		return ""
	}
	return `INSERT INTO ` + names.Ledger + ` (uuid, topic, partition_key, idempotency_key) VALUES ($1, $2, $3, $4)`
}

// takeDue ends the PostgreSQL take statement, whose CTEs end with "due",
// the ids of the rows to publish: it deletes them and returns them. With
// the ledger, the same statement records them in the ledger table (but
// for a row whose key is longer than delivery.MaxBoundBytes, which the
// batch records bounded, see [ledgerKey]), so
// that the record is in the batch's transaction (it commits with the
// delete, after the publish, or rolls back with it) and costs no round
// trip of its own.
func takeDue(outbox string, names sqlschema.Names, ledger bool) string {
	if !ledger {
		return `
DELETE FROM ` + outbox + ` WHERE id IN (SELECT id FROM due)
RETURNING id, topic, uuid, partition_key, payload, metadata`
	}
	return `,
taken AS (
	DELETE FROM ` + outbox + ` WHERE id IN (SELECT id FROM due)
	RETURNING id, topic, uuid, partition_key, payload, metadata),
recorded AS (
	INSERT INTO ` + names.Ledger + ` (uuid, topic, partition_key, idempotency_key)
	SELECT uuid, topic, partition_key, k FROM (
		SELECT uuid, topic, partition_key, COALESCE(metadata->>'` + delivery.IdempotencyKey + `', uuid) AS k FROM taken) t
	WHERE octet_length(k) <= ` + strconv.Itoa(delivery.MaxBoundBytes) + `)
SELECT id, topic, uuid, partition_key, payload, metadata FROM taken`
}

// PruneLedger deletes the ledger rows older than RelayConfig.LedgerRetention,
// by the database's clock, 1000 rows per statement, each statement its own
// transaction, until none is left or ctx is done; it returns how many it
// deleted. Run calls it at start and every minute; call it from a job of
// your own if the relay runs rarely.
func (r *Relay) PruneLedger(ctx context.Context) (int, error) {
	if !r.cfg.Ledger {
		return 0, ErrNoLedger
	}
	prune := r.pgPruneLedger
	if r.cfg.DB != nil {
		prune = r.mysqlPruneLedger
	}
	total := 0
	for {
		n, err := prune(ctx)
		if err != nil {
			return total, fmt.Errorf("forwarder: prune the ledger %s: %w", r.names.Ledger, err)
		}
		total += n
		if n < ledgerPruneBatch {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// pruneLedger is Run's PruneLedger: errors are logged, and the rows stay
// until the next try.
func (r *Relay) pruneLedger(ctx context.Context) {
	n, err := r.PruneLedger(ctx)
	if err != nil && ctx.Err() == nil {
		r.cfg.Logger.Error("Ledger prune failed, old rows kept", err, watermill.LogFields{"deleted": n})
		return
	}
	if n > 0 {
		r.cfg.Logger.Debug("Ledger pruned", watermill.LogFields{"deleted": n, "retention": r.cfg.LedgerRetention.String()})
	}
}

// pgPruneLedger deletes up to ledgerPruneBatch expired ledger rows on
// PostgreSQL, and returns how many.
func (r *Relay) pgPruneLedger(ctx context.Context) (int, error) {
	q := `DELETE FROM ` + r.names.Ledger + ` WHERE ctid IN (
	SELECT ctid FROM ` + r.names.Ledger + ` WHERE published_at < now() - $1::float8 * interval '1 second' LIMIT $2)`
	tag, err := r.cfg.Pool.Exec(ctx, q, r.cfg.LedgerRetention.Seconds(), ledgerPruneBatch)
	if err != nil {
		return 0, err
	}
	return int(tag.RowsAffected()), nil
}

// mysqlPruneLedger deletes up to ledgerPruneBatch expired ledger rows on
// MySQL, the oldest first through the published_at index, and returns how
// many. published_at is UTC, as UTC_TIMESTAMP(6) is.
func (r *Relay) mysqlPruneLedger(ctx context.Context) (int, error) {
	q := `DELETE FROM ` + r.names.Ledger + ` WHERE published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
ORDER BY published_at LIMIT ?`
	res, err := r.cfg.DB.ExecContext(ctx, q, r.cfg.LedgerRetention.Microseconds(), ledgerPruneBatch)
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	return int(n), err
}
