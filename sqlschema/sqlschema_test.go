package sqlschema_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMigrationsRender(t *testing.T) {
	t.Parallel()
	ms, err := sqlschema.Migrations(sqlschema.Postgres, sqlschema.Config{Schema: "billing", InboxTable: "processed"})
	require.NoError(t, err)
	require.NotEmpty(t, ms)
	require.Equal(t, 1, ms[0].Version)
	require.Equal(t, "inbox", ms[0].Name)
	require.Contains(t, ms[0].Up, `CREATE TABLE IF NOT EXISTS "billing"."processed"`)
	require.Contains(t, ms[0].Down, `DROP TABLE IF EXISTS "billing"."processed"`)
	require.NotContains(t, ms[0].Up, "{{")

	lite, err := sqlschema.Migrations(sqlschema.SQLite, sqlschema.Config{})
	require.NoError(t, err)
	require.Contains(t, lite[0].Up, `"inbox"`)
	require.NotContains(t, lite[0].Up, "oncemill")

	_, err = sqlschema.Migrations("oracle", sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
	for field, cfg := range map[string]sqlschema.Config{
		"Schema":     {Schema: `x"; DROP SCHEMA public; --`},
		"InboxTable": {InboxTable: "Inbox"},
		"DLQTable":   {DLQTable: "dead letters"},
	} {
		_, err = sqlschema.Migrations(sqlschema.Postgres, cfg)
		require.ErrorContains(t, err, field)
	}
	require.ErrorContains(t, sqlschema.ValidateIdentifier("T", strings.Repeat("a", 49)), "1 to 48 characters")
}

// TestMigrateConcurrentAndIdempotent starts several migrators on one fresh
// schema at once, as several service instances do on deploy.
func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Name(t)
	ctx := context.Background()
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	cfg := sqlschema.Config{Schema: schema}
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- sqlschema.Migrate(ctx, pool, cfg)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))

	var versions, tables int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "oncemill_migrations"}.Sanitize()).Scan(&versions))
	ms, err := sqlschema.Migrations(sqlschema.Postgres, cfg)
	require.NoError(t, err)
	require.Equal(t, len(ms), versions, "each version recorded once")
	for _, table := range []string{"inbox", "outbox", "dlq"} {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2`, schema, table).Scan(&tables))
		require.Equal(t, 1, tables, table)
	}
}

func TestMigrationsRenderDLQ(t *testing.T) {
	t.Parallel()
	ms, err := sqlschema.Migrations(sqlschema.Postgres, sqlschema.Config{Schema: "billing", DLQTable: "dead"})
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(ms), 8)
	dlq := ms[2]
	require.Equal(t, 3, dlq.Version)
	require.Equal(t, "dlq", dlq.Name)
	require.Contains(t, dlq.Up, `CREATE TABLE IF NOT EXISTS "billing"."dead"`)
	require.Contains(t, dlq.Up, `"dead_dead_at_idx" ON "billing"."dead" (dead_at)`)
	require.Contains(t, dlq.Up, `"dead_topic_idx" ON "billing"."dead" (topic, id)`)
	require.Contains(t, dlq.Up, `"dead_consumer_idx" ON "billing"."dead" (consumer, id)`)
	require.Equal(t, `DROP TABLE IF EXISTS "billing"."dead";`, dlq.Down)
	require.NotContains(t, dlq.Up, "{{")

	names := sqlschema.NamesFor(sqlschema.Postgres, sqlschema.Config{Schema: "billing", DLQTable: "dead"}.WithDefaults())
	require.Equal(t, `"billing"."dead"`, names.DLQ)
	require.Equal(t, "dead", names.DLQName)
	require.Equal(t, "dlq", sqlschema.Config{}.WithDefaults().DLQTable)

	lite, err := sqlschema.Migrations(sqlschema.SQLite, sqlschema.Config{DLQTable: "dead"})
	require.NoError(t, err)
	var liteDLQ []string
	for _, m := range lite {
		if strings.Contains(m.Up, `CREATE TABLE IF NOT EXISTS "dead"`) {
			liteDLQ = append(liteDLQ, m.Name)
			require.Contains(t, m.Up, `"dead_once_idx" ON "dead" (consumer, topic, uuid)`)
		}
	}
	require.Equal(t, []string{"dlq"}, liteDLQ, "SQLite has the dead-letter table, created once")
}

func TestMigrationsRejectSharedTableNames(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  sqlschema.Config
		want string
	}{
		{sqlschema.Config{DLQTable: "inbox"}, `InboxTable and DLQTable are both "inbox"`},
		{sqlschema.Config{DLQTable: "outbox"}, `OutboxTable and DLQTable are both "outbox"`},
		{sqlschema.Config{InboxTable: "events", OutboxTable: "events"}, `InboxTable and OutboxTable are both "events"`},
		{sqlschema.Config{InboxTable: "outbox_scheduled"}, `InboxTable and the scheduled table of OutboxTable are both "outbox_scheduled"`},
		{sqlschema.Config{OutboxTable: "events", LedgerTable: "events_scheduled"}, `LedgerTable and the scheduled table of OutboxTable are both "events_scheduled"`},
	} {
		for _, d := range []sqlschema.Dialect{sqlschema.Postgres, sqlschema.MySQL, sqlschema.SQLite} {
			_, err := sqlschema.Migrations(d, tc.cfg)
			require.ErrorContains(t, err, tc.want, d)
		}
	}
}

// TestMigrateUpgradesToDLQ starts from a schema migrated before the
// dead-letter table existed (versions 1 and 2 recorded) and checks that
// Migrate adds version 3 and nothing else, keeping the existing rows.
func TestMigrateUpgradesToDLQ(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	schema := pgtest.Name(t)
	ctx := context.Background()
	qschema := pgx.Identifier{schema}.Sanitize()
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+qschema+` CASCADE`)
		require.NoError(t, err)
	})
	cfg := sqlschema.Config{Schema: schema}
	ms, err := sqlschema.Migrations(sqlschema.Postgres, cfg)
	require.NoError(t, err)
	for i, m := range ms {
		require.Equal(t, i+1, m.Version, "versions run from 1 without a gap")
	}

	// What Migrate of the previous release left behind.
	versions := qschema + `.oncemill_migrations`
	_, err = pool.Exec(ctx, `CREATE SCHEMA `+qschema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE `+versions+` (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now()
	)`)
	require.NoError(t, err)
	for _, m := range ms[:2] {
		_, err = pool.Exec(ctx, m.Up)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+versions+` (version, name) VALUES ($1, $2)`, m.Version, m.Name)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO `+qschema+`.outbox (topic, uuid, partition_key) VALUES ('t', 'u', 'k')`)
	require.NoError(t, err)
	require.False(t, tableExists(t, pool, schema, "dlq"))

	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))
	require.True(t, tableExists(t, pool, schema, "dlq"))
	rows, err := pool.Query(ctx, `SELECT version, name FROM `+versions+` ORDER BY version`)
	require.NoError(t, err)
	type version struct {
		Version int
		Name    string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[version])
	require.NoError(t, err)
	require.Len(t, got, len(ms), "every version recorded")
	require.Equal(t, []version{{1, "inbox"}, {2, "outbox"}, {3, "dlq"}, {4, "inbox_attempts"}, {5, "dlq_replay"}, {6, "outbox_order"}, {7, "dlq_once"}, {8, "inbox_replay_grant"}}, got[:8])
	var outboxRows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+qschema+`.outbox`).Scan(&outboxRows))
	require.Equal(t, 1, outboxRows, "the upgrade keeps existing rows")
	var triggers int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass AND NOT tgisinternal`,
		qschema+`.outbox`).Scan(&triggers))
	require.Zero(t, triggers, "the upgrade drops the outbox's notify trigger: nothing runs at a writer's commit")
	var laneIndex string
	require.NoError(t, pool.QueryRow(ctx, `SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'outbox_lane_id_idx'`,
		schema).Scan(&laneIndex))
	require.Contains(t, laneIndex, "(lane, id)")

	// The defaults and nullability the dlq package relies on.
	var (
		id        int64
		topic     string
		attempts  int
		permanent bool
		metadata  string
		first     *string
		partition *int32
		deadAt    bool
	)
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO `+qschema+`.dlq (uuid) VALUES ('u1')
		RETURNING id, topic, attempts, permanent, metadata::text, first_failed_at::text, kafka_partition, dead_at IS NOT NULL`).
		Scan(&id, &topic, &attempts, &permanent, &metadata, &first, &partition, &deadAt))
	require.Equal(t, int64(1), id)
	require.Equal(t, "", topic)
	require.Zero(t, attempts)
	require.False(t, permanent)
	require.Equal(t, "{}", metadata)
	require.Nil(t, first)
	require.Nil(t, partition)
	require.True(t, deadAt)

	var indexes []string
	rows, err = pool.Query(ctx, `SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'dlq' ORDER BY indexname`, schema)
	require.NoError(t, err)
	indexes, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"dlq_consumer_idx", "dlq_dead_at_idx", "dlq_once_idx", "dlq_pkey", "dlq_replay_idx", "dlq_topic_idx", "dlq_uuid_idx"}, indexes)

	// Down reverts the step; a second Migrate is a no-op.
	_, err = pool.Exec(ctx, ms[2].Down)
	require.NoError(t, err)
	require.False(t, tableExists(t, pool, schema, "dlq"))
	_, err = pool.Exec(ctx, `DELETE FROM `+versions+` WHERE version = 3`)
	require.NoError(t, err)
	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))
	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))
	require.True(t, tableExists(t, pool, schema, "dlq"))
	var recorded int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+versions).Scan(&recorded))
	require.Equal(t, len(ms), recorded)
}

func tableExists(t *testing.T, pool *pgxpool.Pool, schema, table string) bool {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2`, schema, table).Scan(&n))
	return n == 1
}

// TestConfigNamesRefused: a name that is not a safe identifier, or that
// is the name of another table or of a relation named after one, is
// refused by Validate and by Migrations on every database, the error
// naming the field; empty names are their defaults.
func TestConfigNamesRefused(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("a", 64)
	for name, tc := range map[string]struct {
		cfg  sqlschema.Config
		want string
	}{
		"InboxTable of 64 characters": {sqlschema.Config{InboxTable: long},
			`sqlschema: InboxTable "` + long + `" is not a valid identifier: use 1 to 48 characters of a-z, 0-9 and _, not starting with a digit`},
		"Schema with a semicolon": {sqlschema.Config{Schema: "x;y"},
			`sqlschema: Schema "x;y" is not a valid identifier: use 1 to 48 characters of a-z, 0-9 and _, not starting with a digit`},
		"upper-case OutboxTable": {sqlschema.Config{OutboxTable: "Outbox"},
			`sqlschema: OutboxTable "Outbox" is not a valid identifier`},
		"LedgerTable starting with a digit": {sqlschema.Config{LedgerTable: "1ledger"},
			`sqlschema: LedgerTable "1ledger" is not a valid identifier`},
		"DLQTable inbox_starts": {sqlschema.Config{DLQTable: "inbox_starts"},
			`sqlschema: DLQTable and the table of started attempts of InboxTable are both "inbox_starts": each table needs its own name`},
		"RetryTable an index of the outbox": {sqlschema.Config{RetryTable: "outbox_due_idx"},
			`sqlschema: RetryTable and an index of OutboxTable are both "outbox_due_idx": each table needs its own name`},
		"LedgerTable the token sequence": {sqlschema.Config{InboxTable: "events", LedgerTable: "events_token_seq"},
			`sqlschema: LedgerTable and the token sequence of InboxTable are both "events_token_seq": each table needs its own name`},
		"DLQTable the same as InboxTable": {sqlschema.Config{DLQTable: "inbox"},
			`sqlschema: InboxTable and DLQTable are both "inbox": each table needs its own name`},
	} {
		t.Run(name, func(t *testing.T) {
			require.ErrorContains(t, tc.cfg.Validate(), tc.want, "Validate")
			for _, d := range []sqlschema.Dialect{sqlschema.Postgres, sqlschema.MySQL, sqlschema.SQLite} {
				_, err := sqlschema.Migrations(d, tc.cfg)
				require.ErrorContains(t, err, tc.want, d)
			}
		})
	}
	require.NoError(t, sqlschema.Config{}.Validate(), "the zero Config is the defaults")
}
