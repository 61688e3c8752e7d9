package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/sqlschema"
)

// pgTables reads the tables of a PostgreSQL database.
type pgTables struct {
	pool  *pgxpool.Pool
	names sqlschema.Names
}

func (t pgTables) window(ctx context.Context, since, grace time.Duration) (from, to time.Time, err error) {
	// The window is read from the ledger's server clock, the one that
	// wrote published_at.
	err = t.pool.QueryRow(ctx, `SELECT now() - $1::float8 * interval '1 second', now() - $2::float8 * interval '1 second'`,
		since.Seconds(), grace.Seconds()).Scan(&from, &to)
	if err != nil {
		return from, to, fmt.Errorf("reconcile: read the ledger's clock: %w", err)
	}
	return from, to, nil
}

func (t pgTables) events(ctx context.Context, from, to, at time.Time, uuid string, topics []string, n int) ([]Event, error) {
	q := `SELECT uuid, topic, idempotency_key, published_at FROM ` + t.names.Ledger + `
WHERE published_at >= $1 AND published_at < $2 AND (published_at, uuid) > ($3, $4)
	AND (cardinality($5::text[]) = 0 OR topic = ANY($5))
ORDER BY published_at, uuid LIMIT $6`
	if topics == nil {
		topics = []string{}
	}
	rows, err := t.pool.Query(ctx, q, from, to, at, uuid, topics, n)
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Event, error) {
		var e Event
		err := row.Scan(&e.UUID, &e.Topic, &e.Key, &e.PublishedAt)
		return e, err
	})
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	return events, nil
}

func (t pgTables) known(ctx context.Context, keys []string) (map[string]bool, error) {
	rows, err := t.pool.Query(ctx, `SELECT DISTINCT idempotency_key FROM `+t.names.Ledger+` WHERE idempotency_key = ANY($1)`, keys)
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	known := map[string]bool{}
	var k string
	if _, err := pgx.ForEachRow(rows, []any{&k}, func() error { known[k] = true; return nil }); err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	return known, nil
}

func (t pgTables) statuses(ctx context.Context, consumer string, keys, uuids []string) (status map[string]string, deadKeys, deadUUIDs map[string]bool, err error) {
	status = map[string]string{}
	rows, err := t.pool.Query(ctx, `SELECT key, status FROM `+t.names.Inbox+` WHERE consumer = $1 AND key = ANY($2)`, consumer, keys)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	var k, s string
	if _, err := pgx.ForEachRow(rows, []any{&k, &s}, func() error { status[k] = s; return nil }); err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	deadKeys, deadUUIDs = map[string]bool{}, map[string]bool{}
	rows, err = t.pool.Query(ctx, `SELECT key, uuid FROM `+t.names.DLQ+` WHERE consumer = $1 AND (key = ANY($2) OR uuid = ANY($3))`, consumer, keys, uuids)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the dead-letter table %s: %w", t.names.DLQ, err)
	}
	var u string
	if _, err := pgx.ForEachRow(rows, []any{&k, &u}, func() error { deadKeys[k], deadUUIDs[u] = true, true; return nil }); err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the dead-letter table %s: %w", t.names.DLQ, err)
	}
	return status, deadKeys, deadUUIDs, nil
}

func (t pgTables) done(ctx context.Context, consumer string, from, to time.Time, after string, n int) ([]Key, error) {
	rows, err := t.pool.Query(ctx, `SELECT key, done_at FROM `+t.names.Inbox+`
WHERE consumer = $1 AND status = 'done' AND done_at >= $2 AND done_at < $3 AND key > $4
ORDER BY key LIMIT $5`, consumer, from, to, after, n)
	if err != nil {
		return nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	keys, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Key, error) {
		var k Key
		err := row.Scan(&k.Key, &k.DoneAt)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	return keys, nil
}
