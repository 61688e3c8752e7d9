package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/sqlschema"
)

// tables reads the ledger, or a consumer's inbox and dead-letter table, of
// one database. Times leave the database as microseconds since the epoch
// and enter the same way, so that neither a session's time zone nor a
// driver's parsing matters.
type tables struct {
	db    sqldb.DB
	d     *sqldb.Dialect
	names sqlschema.Names
}

// open returns the reader of t's tables; t was validated.
func open(t Tables) tables {
	db, _ := sqldb.FromConfig("", t.Pool, t.DB, t.Dialect)
	return tables{db: db, d: db.Dialect(), names: db.Dialect().Names(t.Schema)}
}

// stmt is q, written with '?' and {key} for the column key, in the
// dialect ([sqldb.Dialect.Named]).
func (t tables) stmt(q string) string { return t.d.Named(q, t.names) }

// ledgerError is err of reading the ledger.
func (t tables) ledgerError(err error) error {
	if t.d.UndefinedTable(err) {
		return fmt.Errorf("%w %s: %w", ErrNoLedger, t.names.Ledger, err)
	}
	return fmt.Errorf("reconcile: read the ledger %s: %w", t.names.Ledger, err)
}

// window returns now-since and now-grace on the ledger's clock, the one
// that wrote published_at.
func (t tables) window(ctx context.Context, since, grace time.Duration) (from, to time.Time, err error) {
	var now int64
	if err := t.db.QueryRow(ctx, `SELECT `+t.d.Micros(t.d.Now())).Scan(&now); err != nil {
		return from, to, fmt.Errorf("reconcile: read the ledger's clock: %w", err)
	}
	return time.UnixMicro(now - since.Microseconds()).UTC(), time.UnixMicro(now - grace.Microseconds()).UTC(), nil
}

// events returns up to n events published in [from, to) after (at, uuid),
// by (published_at, uuid), of topics (all when empty).
func (t tables) events(ctx context.Context, from, to, at time.Time, uuid string, topics []string, n int) ([]Event, error) {
	ts := t.d.FromMicros("?")
	q := `SELECT uuid, topic, idempotency_key, ` + t.d.Micros("published_at") + ` FROM ` + t.names.Ledger + `
WHERE published_at >= ` + ts + ` AND published_at < ` + ts + `
	AND (published_at > ` + ts + ` OR (published_at = ` + ts + ` AND uuid > ?))`
	args := []any{from.UnixMicro(), to.UnixMicro(), at.UnixMicro(), at.UnixMicro(), t.d.Text(uuid)}
	if len(topics) > 0 {
		q += ` AND topic IN ` + sqldb.List(len(topics))
		args = append(args, t.d.Texts(topics)...)
	}
	rows, err := t.db.Query(ctx, t.stmt(q+` ORDER BY published_at, uuid LIMIT ?`), append(args, n)...)
	events, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (Event, error) {
		var e Event
		err := row.Scan(&e.UUID, &e.Topic, &e.Key, sqldb.Time(&e.PublishedAt))
		return e, err
	})
	if err != nil {
		return nil, t.ledgerError(err)
	}
	return events, nil
}

// known returns those of keys some ledger row has.
func (t tables) known(ctx context.Context, keys []string) (map[string]bool, error) {
	rows, err := t.db.Query(ctx, t.stmt(`SELECT DISTINCT idempotency_key FROM `+t.names.Ledger+` WHERE idempotency_key IN `+sqldb.List(len(keys))), t.d.Texts(keys)...)
	known := map[string]bool{}
	_, err = sqldb.Collect(rows, err, func(row sqldb.Rows) (string, error) {
		var k string
		err := row.Scan(&k)
		known[k] = true
		return k, err
	})
	if err != nil {
		return nil, t.ledgerError(err)
	}
	return known, nil
}

// statuses returns the inbox status of each of keys that has a row, and
// the keys and uuids the dead-letter table has entries of.
func (t tables) statuses(ctx context.Context, consumer string, keys, uuids []string) (status map[string]string, deadKeys, deadUUIDs map[string]bool, err error) {
	// The inbox may hold a long consumer or key in a form of its own
	// (InboxKey): look each up in that form, and answer by the ledger's.
	byStored := make(map[string][]string, len(keys))
	stored := make([]string, len(keys))
	inboxConsumer, _ := t.d.InboxKey(consumer, "")
	for i, k := range keys {
		_, stored[i] = t.d.InboxKey(consumer, k)
		byStored[stored[i]] = append(byStored[stored[i]], k)
	}
	status = map[string]string{}
	rows, err := t.db.Query(ctx, t.stmt(`SELECT {key}, status FROM `+t.names.Inbox+` WHERE consumer = ? AND {key} IN `+sqldb.List(len(keys))),
		append([]any{t.d.Text(inboxConsumer)}, t.d.Texts(stored)...)...)
	_, err = sqldb.Collect(rows, err, func(row sqldb.Rows) (string, error) {
		var k, s string
		err := row.Scan(&k, &s)
		for _, key := range byStored[k] {
			status[key] = s
		}
		return k, err
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	deadKeys, deadUUIDs = map[string]bool{}, map[string]bool{}
	rows, err = t.db.Query(ctx, t.stmt(`SELECT {key}, uuid FROM `+t.names.DLQ+` WHERE consumer = ? AND ({key} IN `+sqldb.List(len(keys))+` OR uuid IN `+sqldb.List(len(uuids))+`)`),
		append(append([]any{t.d.Text(consumer)}, t.d.Texts(keys)...), t.d.Texts(uuids)...)...)
	_, err = sqldb.Collect(rows, err, func(row sqldb.Rows) (string, error) {
		var k, u string
		err := row.Scan(&k, &u)
		deadKeys[k], deadUUIDs[u] = true, true
		return k, err
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the dead-letter table %s: %w", t.names.DLQ, err)
	}
	return status, deadKeys, deadUUIDs, nil
}

// done returns up to n keys done in [from, to) after key, by key.
func (t tables) done(ctx context.Context, consumer string, from, to time.Time, after string, n int) ([]Key, error) {
	consumer, _ = t.d.InboxKey(consumer, "")
	ts := t.d.FromMicros("?")
	rows, err := t.db.Query(ctx, t.stmt(`SELECT {key}, `+t.d.Micros("done_at")+` FROM `+t.names.Inbox+`
WHERE consumer = ? AND status = 'done' AND done_at >= `+ts+` AND done_at < `+ts+` AND {key} > ?
ORDER BY {key} LIMIT ?`), t.d.Text(consumer), from.UnixMicro(), to.UnixMicro(), t.d.Text(after), n)
	keys, err := sqldb.Collect(rows, err, func(row sqldb.Rows) (Key, error) {
		var k Key
		err := row.Scan(&k.Key, sqldb.Time(&k.DoneAt))
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	return keys, nil
}
