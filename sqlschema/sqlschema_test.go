package sqlschema_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/internal/pgtest"
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

	_, err = sqlschema.Migrations("mysql", sqlschema.Config{})
	require.ErrorContains(t, err, `unknown dialect "mysql"`)
	for field, cfg := range map[string]sqlschema.Config{
		"Schema":     {Schema: `x"; DROP SCHEMA public; --`},
		"InboxTable": {InboxTable: "Inbox"},
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
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'inbox'`, schema).Scan(&tables))
	require.Equal(t, 1, tables)
}
