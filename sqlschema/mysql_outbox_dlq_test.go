package sqlschema_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMySQLOutboxDLQAndLedgerMigrations: 002 creates the outbox with its
// 64 lanes, 003 the dead-letter table whose once_key keeps one entry per
// consumer, topic and UUID until its replay is requested, 004 the relay's
// ledger with its published_at and idempotency_key indexes, 005 the
// outbox's scheduled table with its (due_at, id) index, 006 the table of
// parked messages, one row per consumer, topic and UUID, 007 the replay
// subscribers' announcements, 008 the key in both tables' identity;
// applied twice
// they change nothing, and their down steps undo them.
func TestMySQLOutboxDLQAndLedgerMigrations(t *testing.T) {
	t.Parallel()
	name := mysqltest.Database(t)
	mc := mysqltest.Config(t, name)
	mc.MultiStatements = true // each step as one script, as a migration tool runs it
	db := mysqltest.Open(t, mc, 2)
	ctx := context.Background()
	cfg := sqlschema.Config{Schema: name, OutboxTable: "events"}
	ms, err := sqlschema.Migrations(sqlschema.MySQL, cfg)
	require.NoError(t, err)
	require.Len(t, ms, 10)
	require.Equal(t, "outbox", ms[1].Name)
	require.Equal(t, "dlq", ms[2].Name)
	require.Equal(t, "ledger", ms[3].Name)
	require.Equal(t, "outbox_scheduled", ms[4].Name)
	require.Equal(t, "retries", ms[5].Name)
	require.Equal(t, "dlq_replayers", ms[6].Name)
	require.Equal(t, "message_identity", ms[7].Name)
	require.Equal(t, "inbox_narrow", ms[8].Name)
	require.Equal(t, "inbox_marks", ms[9].Name)
	for range 2 {
		for _, m := range ms {
			_, err := db.ExecContext(ctx, m.Up)
			require.NoError(t, err, "%03d_%s", m.Version, m.Name)
		}
	}
	count := func(q string) (n int) {
		t.Helper()
		require.NoError(t, db.QueryRowContext(ctx, q).Scan(&n))
		return n
	}
	require.Equal(t, 64, count("SELECT COUNT(*) FROM `"+name+"`.`events_lanes`"), "one row per lane, once")
	require.Equal(t, 63, count("SELECT MAX(lane) FROM `"+name+"`.`events_lanes`"))

	_, err = db.ExecContext(ctx, "INSERT INTO `"+name+"`.`events` (topic, uuid, partition_key, metadata, created_at) VALUES ('t', 'u', 'order-7', '{}', UTC_TIMESTAMP(6))")
	require.NoError(t, err)
	require.Equal(t, 1, count("SELECT COUNT(*) FROM `"+name+"`.`events` WHERE lane = CRC32('order-7') & 63"), "the lane is the key's hash")

	dead := "INSERT INTO `" + name + "`.dlq (uuid, topic, dlq_topic, consumer, `key`, `error`, payload, metadata, dead_at)\n" +
		"VALUES ('u-1', 'orders', 'dlq', 'charge', 'k', 'e', '', '{}', UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE id = id"
	for range 2 {
		_, err = db.ExecContext(ctx, dead)
		require.NoError(t, err)
	}
	require.Equal(t, 1, count("SELECT COUNT(*) FROM `"+name+"`.dlq"), "one entry per consumer, topic and uuid")
	parked := "INSERT INTO `" + name + "`.retries (consumer, topic, uuid, `key`, `error`, due_at, parked_at, payload, metadata)\n" +
		"VALUES ('charge', 'orders', 'u-1', 'k', 'e', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), '', '{}') ON DUPLICATE KEY UPDATE id = id"
	for range 2 {
		_, err = db.ExecContext(ctx, parked)
		require.NoError(t, err)
	}
	require.Equal(t, 1, count("SELECT COUNT(*) FROM `"+name+"`.retries"), "one parked row per consumer, topic and uuid")
	_, err = db.ExecContext(ctx, "UPDATE `"+name+"`.dlq SET replay_requested_at = UTC_TIMESTAMP(6)")
	require.NoError(t, err)
	_, err = db.ExecContext(ctx, dead)
	require.NoError(t, err)
	require.Equal(t, 2, count("SELECT COUNT(*) FROM `"+name+"`.dlq"), "an entry on its way back is outside the rule")
	// Consumer "ab" of topic "c" and consumer "a" of topic "bc": one
	// string joined, two triples.
	for _, ct := range [][2]string{{"ab", "c"}, {"a", "bc"}} {
		_, err = db.ExecContext(ctx, "INSERT INTO `"+name+"`.dlq (uuid, topic, dlq_topic, consumer, `key`, `error`, payload, metadata, dead_at)\n"+
			"VALUES ('u-2', ?, 'dlq', ?, 'k', 'e', '', '{}', UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE id = id", ct[1], ct[0])
		require.NoError(t, err)
	}
	require.Equal(t, 4, count("SELECT COUNT(*) FROM `"+name+"`.dlq"), "the digest tells the parts apart")

	ledger := "`" + name + "`.outbox_ledger"
	_, err = db.ExecContext(ctx, "INSERT INTO "+ledger+" (uuid, topic, partition_key, idempotency_key, published_at)\n"+
		"VALUES ('u-1', 'orders', 'order-7', 'order-7:paid', '2026-03-01 12:00:00.123456')")
	require.NoError(t, err)
	var at string
	require.NoError(t, db.QueryRowContext(ctx, "SELECT published_at FROM "+ledger+" WHERE idempotency_key = 'order-7:paid'").Scan(&at))
	require.Equal(t, "2026-03-01 12:00:00.123456", at, "published_at keeps microseconds")
	indexes := func(table string) map[string]string {
		t.Helper()
		out := map[string]string{}
		rs, err := db.QueryContext(ctx, "SELECT INDEX_NAME, GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX) FROM information_schema.STATISTICS "+
			"WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? GROUP BY INDEX_NAME", name, table)
		require.NoError(t, err)
		for rs.Next() {
			var ix, cols string
			require.NoError(t, rs.Scan(&ix, &cols))
			out[ix] = cols
		}
		require.NoError(t, rs.Err())
		return out
	}
	require.Equal(t, map[string]string{"PRIMARY": "id", "outbox_ledger_key_idx": "idempotency_key", "outbox_ledger_published_at_idx": "published_at"}, indexes("outbox_ledger"))
	require.Equal(t, map[string]string{"PRIMARY": "id", "events_due_idx": "due_at,id"}, indexes("events_scheduled"))

	for i := len(ms) - 1; i >= 1; i-- {
		_, err := db.ExecContext(ctx, ms[i].Down)
		require.NoError(t, err, "%03d_%s down", ms[i].Version, ms[i].Name)
	}
	require.Equal(t, 2, count("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '"+name+"' AND TABLE_NAME LIKE 'inbox%'"), "the inbox's tables stay")
	require.Equal(t, 2, count("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '"+name+"'"), "the outbox, its lanes, the dead-letter, the ledger and the scheduled tables are gone")
}
