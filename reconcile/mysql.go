package reconcile

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/sqlschema"
)

// Times go to and come from a MySQL server as microseconds since the
// epoch, so neither the session's time zone nor the DSN's parseTime and
// loc matter; the columns hold UTC, as everywhere in sqlschema's MySQL
// tables.
const (
	mysqlAt = "TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP'1970-01-01 00:00:00')"
	mysqlUS = "TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', %s)"
)

// mysqlTables reads the tables of a MySQL or MariaDB database.
type mysqlTables struct {
	db    *sql.DB
	names sqlschema.Names
}

func micros(t time.Time) int64 { return t.UnixMicro() }

func fromMicros(us int64) time.Time { return time.UnixMicro(us).UTC() }

// in returns "(?, ?, …)" for values, and values as arguments.
func in(values []string) (string, []any) {
	args := make([]any, len(values))
	for i, v := range values {
		args[i] = v
	}
	return "(" + strings.TrimSuffix(strings.Repeat("?, ", len(values)), ", ") + ")", args
}

func (t mysqlTables) window(ctx context.Context, since, grace time.Duration) (from, to time.Time, err error) {
	var now int64
	if err := t.db.QueryRowContext(ctx, `SELECT `+fmt.Sprintf(mysqlUS, "UTC_TIMESTAMP(6)")).Scan(&now); err != nil {
		return from, to, fmt.Errorf("reconcile: read the ledger's clock: %w", err)
	}
	return fromMicros(now - since.Microseconds()), fromMicros(now - grace.Microseconds()), nil
}

func (t mysqlTables) events(ctx context.Context, from, to, at time.Time, uuid string, topics []string, n int) ([]Event, error) {
	q := `SELECT uuid, topic, idempotency_key, ` + fmt.Sprintf(mysqlUS, "published_at") + ` FROM ` + t.names.Ledger + `
WHERE published_at >= ` + mysqlAt + ` AND published_at < ` + mysqlAt + `
	AND (published_at > ` + mysqlAt + ` OR (published_at = ` + mysqlAt + ` AND uuid > ?))`
	args := []any{micros(from), micros(to), micros(at), micros(at), uuid}
	if len(topics) > 0 {
		list, topicArgs := in(topics)
		q += ` AND topic IN ` + list
		args = append(args, topicArgs...)
	}
	q += ` ORDER BY published_at, uuid LIMIT ?`
	args = append(args, n)
	rows, err := t.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	defer rows.Close()
	var events []Event
	for rows.Next() {
		var e Event
		var us int64
		if err := rows.Scan(&e.UUID, &e.Topic, &e.Key, &us); err != nil {
			return nil, ledgerError(t.names.Ledger, err)
		}
		e.PublishedAt = fromMicros(us)
		events = append(events, e)
	}
	if err := rows.Err(); err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	return events, nil
}

func (t mysqlTables) known(ctx context.Context, keys []string) (map[string]bool, error) {
	list, args := in(keys)
	rows, err := t.db.QueryContext(ctx, `SELECT DISTINCT idempotency_key FROM `+t.names.Ledger+` WHERE idempotency_key IN `+list, args...)
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	known := map[string]bool{}
	err = each(rows, func() error {
		var k string
		if err := rows.Scan(&k); err != nil {
			return err
		}
		known[k] = true
		return nil
	})
	if err != nil {
		return nil, ledgerError(t.names.Ledger, err)
	}
	return known, nil
}

func (t mysqlTables) statuses(ctx context.Context, consumer string, keys, uuids []string) (status map[string]string, deadKeys, deadUUIDs map[string]bool, err error) {
	// The inbox holds a long consumer or key as its digest: look each up
	// in the store's own form, and answer by the ledger's key.
	inboxConsumer := sqlstore.MySQLStoredKey(dedup.Key{Consumer: consumer}).Consumer
	byStored := make(map[string][]string, len(keys))
	storedKeys := make([]string, len(keys))
	for i, k := range keys {
		storedKeys[i] = sqlstore.MySQLStoredKey(dedup.Key{Consumer: consumer, Key: k}).Key
		byStored[storedKeys[i]] = append(byStored[storedKeys[i]], k)
	}
	storedList, storedArgs := in(storedKeys)
	rows, err := t.db.QueryContext(ctx, "SELECT `key`, status FROM "+t.names.Inbox+" WHERE consumer = ? AND `key` IN "+storedList, append([]any{inboxConsumer}, storedArgs...)...)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	status = map[string]string{}
	err = each(rows, func() error {
		var k, s string
		if err := rows.Scan(&k, &s); err != nil {
			return err
		}
		for _, key := range byStored[k] {
			status[key] = s
		}
		return nil
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	list, args := in(keys)
	uuidList, uuidArgs := in(uuids)
	rows, err = t.db.QueryContext(ctx, "SELECT `key`, uuid FROM "+t.names.DLQ+" WHERE consumer = ? AND (`key` IN "+list+" OR uuid IN "+uuidList+")",
		append(append([]any{consumer}, args...), uuidArgs...)...)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the dead-letter table %s: %w", t.names.DLQ, err)
	}
	deadKeys, deadUUIDs = map[string]bool{}, map[string]bool{}
	err = each(rows, func() error {
		var k, u string
		if err := rows.Scan(&k, &u); err != nil {
			return err
		}
		deadKeys[k], deadUUIDs[u] = true, true
		return nil
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("reconcile: read the dead-letter table %s: %w", t.names.DLQ, err)
	}
	return status, deadKeys, deadUUIDs, nil
}

func (t mysqlTables) done(ctx context.Context, consumer string, from, to time.Time, after string, n int) ([]Key, error) {
	rows, err := t.db.QueryContext(ctx, "SELECT `key`, "+fmt.Sprintf(mysqlUS, "done_at")+" FROM "+t.names.Inbox+
		" WHERE consumer = ? AND status = 'done' AND done_at >= "+mysqlAt+" AND done_at < "+mysqlAt+" AND `key` > ?"+
		" ORDER BY `key` LIMIT ?", consumer, micros(from), micros(to), after, n)
	if err != nil {
		return nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	var keys []Key
	err = each(rows, func() error {
		var k Key
		var us int64
		if err := rows.Scan(&k.Key, &us); err != nil {
			return err
		}
		k.DoneAt = fromMicros(us)
		keys = append(keys, k)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: read the inbox %s: %w", t.names.Inbox, err)
	}
	return keys, nil
}

// each calls f for each row of rows, then closes them.
func each(rows *sql.Rows, f func() error) error {
	defer rows.Close()
	for rows.Next() {
		if err := f(); err != nil {
			return err
		}
	}
	return rows.Err()
}
