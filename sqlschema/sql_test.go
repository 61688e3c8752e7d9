package sqlschema_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestMigrationsRenderMySQL(t *testing.T) {
	t.Parallel()
	ms, err := sqlschema.Migrations(sqlschema.MySQL, sqlschema.Config{Schema: "billing", InboxTable: "processed"})
	require.NoError(t, err)
	require.Equal(t, 1, ms[0].Version)
	require.Equal(t, "inbox", ms[0].Name)
	require.Contains(t, ms[0].Up, "CREATE TABLE IF NOT EXISTS `billing`.`processed` (")
	require.Contains(t, ms[0].Up, "CREATE TABLE IF NOT EXISTS `billing`.`processed_starts` (")
	require.Contains(t, ms[0].Down, "DROP TABLE IF EXISTS `billing`.`processed`;")
	require.NotContains(t, ms[0].Up, "{{")
	names := sqlschema.NamesFor(sqlschema.MySQL, sqlschema.Config{}.WithDefaults())
	require.Equal(t, "`oncemill`.`inbox`", names.Inbox)
	_, err = sqlschema.Migrations(sqlschema.MySQL, sqlschema.Config{InboxTable: "dlq"})
	require.ErrorContains(t, err, `InboxTable and DLQTable are both "dlq"`)
}

// TestMigrateSQLMySQLConcurrentAndIdempotent starts several migrators on a
// database that does not exist yet, as several service instances do on
// deploy, then runs one more: each version is recorded once, and the
// tables are there.
func TestMigrateSQLMySQLConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	db := mysqltest.Open(t, mysqltest.Config(t, ""), 8)
	schema := pgtest.Name(t)
	ctx := context.Background()
	t.Cleanup(func() {
		_, err := db.ExecContext(context.Background(), "DROP DATABASE IF EXISTS `"+schema+"`")
		require.NoError(t, err)
	})
	cfg := sqlschema.Config{Schema: schema}
	migrateConcurrently(t, db, sqlschema.MySQL, cfg)

	var versions, tables int
	require.NoError(t, db.QueryRowContext(ctx, "SELECT COUNT(*) FROM `"+schema+"`.oncemill_migrations").Scan(&versions))
	ms, err := sqlschema.Migrations(sqlschema.MySQL, cfg)
	require.NoError(t, err)
	require.Equal(t, len(ms), versions, "each version recorded once")
	require.NoError(t, db.QueryRowContext(ctx, `SELECT COUNT(*) FROM information_schema.TABLES
		WHERE TABLE_SCHEMA = ? AND TABLE_NAME IN ('inbox', 'inbox_starts') AND ENGINE = 'InnoDB'`, schema).Scan(&tables))
	require.Equal(t, 2, tables)

	// A migration cut short (its statements ran, its version was not
	// recorded) is applied again whole: every statement is idempotent.
	_, err = db.ExecContext(ctx, "DELETE FROM `"+schema+"`.oncemill_migrations")
	require.NoError(t, err)
	require.NoError(t, sqlschema.MigrateSQL(ctx, db, sqlschema.MySQL, cfg))
}

// TestMigrateSQLPostgres: the database/sql migrator applies the
// PostgreSQL migrations under Migrate's lock, and the two agree on what is
// applied.
func TestMigrateSQLPostgres(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	pcfg, err := pgx.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	db := stdlib.OpenDB(*pcfg)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	schema := pgtest.Name(t)
	ctx := context.Background()
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
	})
	cfg := sqlschema.Config{Schema: schema}
	migrateConcurrently(t, db, sqlschema.Postgres, cfg)
	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg), "Migrate finds nothing left to do")
	var versions int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "oncemill_migrations"}.Sanitize()).Scan(&versions))
	ms, err := sqlschema.Migrations(sqlschema.Postgres, cfg)
	require.NoError(t, err)
	require.Equal(t, len(ms), versions)

	require.ErrorContains(t, sqlschema.MigrateSQL(ctx, nil, sqlschema.Postgres, cfg), "db is nil")
	require.ErrorContains(t, sqlschema.MigrateSQL(ctx, db, "oracle", cfg), `unknown dialect "oracle"`)
}

func migrateConcurrently(t *testing.T, db *sql.DB, d sqlschema.Dialect, cfg sqlschema.Config) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- sqlschema.MigrateSQL(context.Background(), db, d, cfg)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, sqlschema.MigrateSQL(context.Background(), db, d, cfg))
}
