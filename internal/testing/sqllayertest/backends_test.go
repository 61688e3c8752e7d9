package sqllayertest_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqllayertest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestSQLLayer runs the suite on every backend the SQL layer supports:
// PostgreSQL through pgx and through database/sql, MariaDB (or MySQL)
// through database/sql, and SQLite in a file of the subtest's temporary
// directory. The servers are the test servers of pgtest and mysqltest;
// under CI=true an unreachable one fails the test.
func TestSQLLayer(t *testing.T) {
	t.Parallel()
	for _, s := range []sqllayertest.Subject{
		{Name: "postgres-pgx", Open: func(t *testing.T) sqllayertest.Database {
			pool := pgtest.Pool(t, 8)
			return sqllayertest.Database{Pool: pool, Schema: sqlschema.Config{Schema: pgtest.Schema(t, pool)}}
		}},
		{Name: "postgres-sql", Open: func(t *testing.T) sqllayertest.Database {
			pool := pgtest.Pool(t, 8)
			db := stdlib.OpenDBFromPool(pool)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			schema := sqlschema.Config{Schema: pgtest.Name(t)}
			require.NoError(t, sqlschema.MigrateSQL(t.Context(), db, sqlschema.Postgres, schema))
			t.Cleanup(func() {
				_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema.Schema}.Sanitize()+` CASCADE`)
				require.NoError(t, err)
			})
			return sqllayertest.Database{DB: db, Dialect: sqlschema.Postgres, Schema: schema}
		}},
		{Name: "mariadb", Open: func(t *testing.T) sqllayertest.Database {
			db, name := mysqltest.DB(t, 8)
			schema := sqlschema.Config{Schema: name}
			require.NoError(t, sqlschema.MigrateSQL(t.Context(), db, sqlschema.MySQL, schema))
			return sqllayertest.Database{DB: db, Dialect: sqlschema.MySQL, Schema: schema}
		}},
		{Name: "sqlite", Open: func(t *testing.T) sqllayertest.Database {
			path := filepath.Join(t.TempDir(), "oncemill.db")
			db, err := sql.Open("sqlite", "file:"+path+
				"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate")
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			require.NoError(t, sqlschema.MigrateSQLite(t.Context(), db, sqlschema.Config{}))
			return sqllayertest.Database{DB: db, Dialect: sqlschema.SQLite}
		}},
	} {
		t.Run(s.Name, func(t *testing.T) {
			t.Parallel()
			sqllayertest.Run(t, s)
		})
	}
}
