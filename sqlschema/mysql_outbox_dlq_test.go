package sqlschema_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/mysqltest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMySQLOutboxAndDLQMigrations: 002 creates the outbox with its 64
// lanes, 003 the dead-letter table whose once_key keeps one entry per
// consumer, topic and UUID until its replay is requested; applied twice
// they change nothing, and their down steps undo them.
func TestMySQLOutboxAndDLQMigrations(t *testing.T) {
	t.Parallel()
	name := mysqltest.Database(t)
	mc := mysqltest.Config(t, name)
	mc.MultiStatements = true // each step as one script, as a migration tool runs it
	db := mysqltest.Open(t, mc, 2)
	ctx := context.Background()
	cfg := sqlschema.Config{Schema: name, OutboxTable: "events"}
	ms, err := sqlschema.Migrations(sqlschema.MySQL, cfg)
	require.NoError(t, err)
	require.Len(t, ms, 3)
	require.Equal(t, "outbox", ms[1].Name)
	require.Equal(t, "dlq", ms[2].Name)
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

	for i := len(ms) - 1; i >= 1; i-- {
		_, err := db.ExecContext(ctx, ms[i].Down)
		require.NoError(t, err, "%03d_%s down", ms[i].Version, ms[i].Name)
	}
	require.Equal(t, 2, count("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '"+name+"' AND TABLE_NAME LIKE 'inbox%'"), "the inbox's tables stay")
	require.Equal(t, 2, count("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '"+name+"'"), "the outbox, its lanes and the dead-letter table are gone")
}
