package forwarder

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/delivery"
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

// PruneLedger deletes the ledger rows older than RelayConfig.LedgerRetention,
// by the database's clock, 1000 rows per statement, each statement its own
// transaction, until none is left or ctx is done; it returns how many it
// deleted. Run calls it at start and every minute; call it from a job of
// your own if the relay runs rarely.
func (r *Relay) PruneLedger(ctx context.Context) (int, error) {
	if !r.cfg.Ledger {
		return 0, ErrNoLedger
	}
	d := r.db.d
	// published_at older than the retention by the database's clock, the
	// oldest first.
	q := d.Rebind(d.DeleteLimit(r.names.Ledger, `published_at < `+d.FromMicros(`(`+d.Micros(d.Now())+` - ?)`), "published_at"))
	total := 0
	for {
		n, err := r.db.db.Exec(ctx, q, r.cfg.LedgerRetention.Microseconds(), ledgerPruneBatch)
		if err != nil {
			return total, fmt.Errorf("forwarder: prune the ledger %s: %w", r.names.Ledger, err)
		}
		total += int(n)
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
