package sqlschema_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestMigrateDLQUniqueRemovesDuplicates upgrades a dead-letter table that
// already holds duplicate entries, as concurrent writers left them before
// migration 009: the migration keeps the oldest entry of each message and
// consumer, leaves entries whose replay was requested, and from then on
// the database refuses a second entry.
func TestMigrateDLQUniqueRemovesDuplicates(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	schema := pgtest.Name(t)
	ctx := context.Background()
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	cfg := sqlschema.Config{Schema: schema}
	ms, err := sqlschema.Migrations(sqlschema.Postgres, cfg)
	require.NoError(t, err)
	var unique *sqlschema.Migration
	for i := range ms {
		if ms[i].Version == 9 {
			unique = &ms[i]
		}
	}
	require.NotNil(t, unique, "migration 009")
	require.Equal(t, "dlq_unique", unique.Name)

	// The schema as Migrate left it before 009: every earlier step applied
	// and recorded.
	q := pgx.Identifier{schema}.Sanitize()
	_, err = pool.Exec(ctx, `CREATE SCHEMA `+q+`; CREATE TABLE `+q+`.oncemill_migrations (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range ms {
		if m.Version >= unique.Version {
			continue
		}
		_, err = pool.Exec(ctx, m.Up)
		require.NoError(t, err, "%03d_%s", m.Version, m.Name)
		_, err = pool.Exec(ctx, `INSERT INTO `+q+`.oncemill_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
		require.NoError(t, err)
	}

	table := q + `.dlq`
	insert := func(consumer, topic, uuid string, replay bool) int64 {
		t.Helper()
		var id int64
		require.NoError(t, pool.QueryRow(ctx, `INSERT INTO `+table+` (consumer, topic, uuid, replay_requested_at)
VALUES ($1, $2, $3, CASE WHEN $4 THEN now() END) RETURNING id`, consumer, topic, uuid, replay).Scan(&id))
		return id
	}
	keepA := insert("billing", "orders", "a", false)
	insert("billing", "orders", "a", false)
	replayed := insert("billing", "orders", "a", true)
	insert("billing", "orders", "a", false)
	keepB := insert("billing", "orders", "b", false)
	insert("billing", "orders", "b", false)
	otherConsumer := insert("shipping", "orders", "a", false)
	otherTopic := insert("billing", "orders.v2", "a", false)

	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))

	rows, err := pool.Query(ctx, `SELECT id FROM `+table+` ORDER BY id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, []int64{keepA, replayed, keepB, otherConsumer, otherTopic}, ids,
		"the oldest entry of each message and consumer, and the replayed one")

	_, err = pool.Exec(ctx, `INSERT INTO `+table+` (consumer, topic, uuid) VALUES ('billing', 'orders', 'a')`)
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "a second entry is refused: %v", err)
	require.Equal(t, "23505", pgErr.Code) // unique_violation
	insert("billing", "orders", "a", true)

	// Down drops the index; the removed duplicates stay removed.
	_, err = pool.Exec(ctx, unique.Down)
	require.NoError(t, err)
	insert("billing", "orders", "a", false)
}
