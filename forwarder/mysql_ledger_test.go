package forwarder_test

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// mysqlLedgerRow is one row of the MySQL ledger table.
type mysqlLedgerRow struct {
	ledgerRow
	publishedAt time.Time
}

// ledger reads the ledger table through db, which must parse times
// (ParseTime, the driver's default loc, UTC), by uuid: one row per
// published event.
func (b myBundle) ledger(t *testing.T, db *sql.DB) map[string]mysqlLedgerRow {
	t.Helper()
	rs, err := db.QueryContext(context.Background(), "SELECT uuid, topic, partition_key, idempotency_key, published_at FROM `"+b.name+"`.outbox_ledger")
	require.NoError(t, err)
	defer rs.Close()
	out := map[string]mysqlLedgerRow{}
	for rs.Next() {
		var r mysqlLedgerRow
		require.NoError(t, rs.Scan(&r.uuid, &r.topic, &r.partitionKey, &r.key, &r.publishedAt))
		_, dup := out[r.uuid]
		require.False(t, dup, "one ledger row per published event: %s twice", r.uuid)
		out[r.uuid] = r
	}
	require.NoError(t, rs.Err())
	return out
}

// parseTimeDB is a pool on b's database whose driver reads DATETIME
// columns as time.Time in UTC, the driver's default loc.
func (b myBundle) parseTimeDB(t *testing.T) *sql.DB {
	t.Helper()
	mc := mysqltest.Config(t, b.name)
	mc.ParseTime = true
	return mysqltest.Open(t, mc, 2)
}

// serverNow is the server's UTC_TIMESTAMP(6), through a parseTime pool.
func serverNow(t *testing.T, db *sql.DB) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, db.QueryRowContext(context.Background(), "SELECT UTC_TIMESTAMP(6)").Scan(&now))
	return now
}

// TestMySQLLedgerCommitsWithTheOutboxDelete: on MariaDB, with
// RelayConfig.Ledger, a batch whose publish fails (before or after the
// broker took the messages) leaves no ledger row and the rows in the
// outbox; the batch that commits leaves one ledger row per published row,
// with its uuid, topic, partition key and the inbox's default key (the
// idempotency_key metadata, else the UUID), published when the relay took
// it, as an instant, whatever the session's time zone and whether the
// relay's driver parses times; a row the relay refuses and dead-letters
// has none.
func TestMySQLLedgerCommitsWithTheOutboxDelete(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		mod  func(*mysql.Config)
	}{
		{"text times", nil},
		{"parsed times, session and driver zones not UTC", func(c *mysql.Config) {
			c.ParseTime = true
			c.Loc = time.FixedZone("UTC+9", 9*3600)
			c.Params = map[string]string{"time_zone": "'+05:00'"}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setupMySQL(t, 4)
			ctx := context.Background()
			reader := b.parseTimeDB(t)
			mc := mysqltest.Config(t, b.name)
			if tc.mod != nil {
				tc.mod(mc)
			}
			s := &sink{}
			r, err := forwarder.NewRelay(forwarder.RelayConfig{DB: mysqltest.Open(t, mc, 4), Dialect: sqlschema.MySQL, Publisher: s,
				Schema: b.schema, Ledger: true})
			require.NoError(t, err)

			keyed := event("k1", 1)
			keyed.Metadata.Set(delivery.IdempotencyKey, "order-1:paid")
			events := []*message.Message{keyed, event("k1", 2), event("k2", 3)}
			tx, err := b.db.BeginTx(ctx, nil)
			require.NoError(t, err)
			b.publish(t, tx, events...)
			// Refused: metadata that is not JSON, behind k1's first event
			// in its lane; an empty topic.
			insert := "INSERT INTO `" + b.name + "`.outbox (topic, uuid, partition_key, payload, metadata, created_at) VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"
			_, err = tx.ExecContext(ctx, insert, "orders", "bad-1", "k1", []byte("x"), "not json")
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, insert, "", "bad-2", "k3", []byte("y"), `{"idempotency_key":"order-3:paid"}`)
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			const rows = 5

			for _, after := range []bool{false, true} {
				s.fail = func(int) (bool, bool) { return true, after }
				require.Error(t, failBatch(t, r))
				require.Empty(t, b.ledger(t, reader), "no ledger row for a row whose publish failed (after the broker took it: %v)", after)
				require.Equal(t, rows, b.count(t, "outbox"), "the rows stay")
				require.Zero(t, b.count(t, "dlq"), "the refused rows' dead letters roll back with the batch")
			}

			s.fail = nil
			before := serverNow(t, reader)
			relayAllMySQL(t, r, len(events))
			after := serverNow(t, reader)
			require.Zero(t, b.count(t, "outbox"))
			require.Equal(t, 2, b.count(t, "dlq"), "the refused rows are dead-lettered")
			got := b.ledger(t, reader)
			require.Len(t, got, len(events), "a ledger row per published row, none for the refused ones")
			for _, e := range events {
				want := ledgerRow{uuid: e.UUID, topic: "orders", partitionKey: e.Metadata.Get(delivery.PartitionKey), key: e.UUID}
				if k, ok := e.Metadata[delivery.IdempotencyKey]; ok {
					want.key = k
				}
				require.Equal(t, want, got[e.UUID].ledgerRow)
				at := got[e.UUID].publishedAt
				require.False(t, at.Before(before) || at.After(after), "published_at %s is within the batch's run, %s to %s (UTC)", at, before, after)
			}
			require.Equal(t, "order-1:paid", got[keyed.UUID].key)
		})
	}
}

// TestMySQLLedgerRetention: on MariaDB, PruneLedger deletes the ledger
// rows older than LedgerRetention, more than one statement's worth, and
// counts them; it keeps the others. A running relay prunes at start.
// Without Ledger the relay writes no ledger row and has none to prune.
func TestMySQLLedgerRetention(t *testing.T) {
	t.Parallel()
	b := setupMySQL(t, 4)
	ctx := context.Background()
	ledger := "`" + b.name + "`.outbox_ledger"
	age := func(prefix string, n int, ago string) {
		t.Helper()
		values := make([]string, n)
		args := make([]any, 0, 2*n)
		for i := range values {
			values[i] = "(?, 't', 'k', ?, UTC_TIMESTAMP(6) - INTERVAL " + ago + ")"
			id := prefix + "-" + strconv.Itoa(i)
			args = append(args, id, id)
		}
		_, err := b.db.ExecContext(ctx, "INSERT INTO "+ledger+" (uuid, topic, partition_key, idempotency_key, published_at) VALUES "+
			strings.Join(values, ", "), args...)
		require.NoError(t, err)
	}
	count := func(where string) (n int) {
		t.Helper()
		require.NoError(t, b.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+ledger+" WHERE "+where).Scan(&n))
		return n
	}

	off := b.relay(t, &sink{}, nil)
	_, err := off.PruneLedger(ctx)
	require.ErrorIs(t, err, forwarder.ErrNoLedger)
	tx, err := b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	b.publish(t, tx, event("k", 1))
	require.NoError(t, tx.Commit())
	relayAllMySQL(t, off, 1)
	require.Zero(t, b.count(t, "outbox_ledger"), "no ledger without RelayConfig.Ledger")

	const old = 2500 // more than two deletes' batches
	age("old", old, "2 HOUR")
	age("recent", 1, "30 MINUTE")
	r := b.relay(t, &sink{}, func(c *forwarder.RelayConfig) {
		c.Ledger = true
		c.LedgerRetention = time.Hour
	})
	n, err := r.PruneLedger(ctx)
	require.NoError(t, err)
	require.Equal(t, old, n, "every row older than the retention, counted")
	require.Zero(t, count("uuid LIKE 'old-%'"))
	require.Equal(t, 1, count("uuid LIKE 'recent-%'"), "the row within the retention stays")
	n, err = r.PruneLedger(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	age("older", 1001, "1 DAY")
	run(t, r)
	tx, err = b.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	e := event("k", 2)
	b.publish(t, tx, e)
	require.NoError(t, tx.Commit())
	require.Eventually(t, func() bool {
		return count("uuid LIKE 'older-%'") == 0 && b.count(t, "outbox") == 0
	}, 30*time.Second, 20*time.Millisecond, "the running relay prunes and relays")
	require.Equal(t, 1, count("uuid LIKE 'recent-%'"))
	require.Equal(t, 1, count("uuid = '"+e.UUID+"'"), "the relayed event's ledger row committed with its delete")
	require.Equal(t, 2, b.count(t, "outbox_ledger"), "the recent row and the relayed event's")
}
