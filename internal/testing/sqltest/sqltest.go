// Package sqltest opens oncemill's tables, migrated, on each database the
// SQL layer supports, for the tests that run one promise on all of them:
// PostgreSQL through pgx and through database/sql, MariaDB (or MySQL)
// through database/sql, and SQLite in a file of the test's own. The
// servers are pgtest's and mysqltest's; under CI=true an unreachable one
// fails the test.
package sqltest

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite" // the SQLite driver

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// Database is oncemill's tables, migrated, in one database of its own.
type Database struct {
	// Pool is a PostgreSQL database through pgx; nil through
	// database/sql.
	Pool *pgxpool.Pool
	// DB is a database through database/sql, of Dialect; nil through pgx.
	DB *sql.DB
	// Dialect is DB's family: sqlschema.Postgres, MySQL or SQLite.
	Dialect sqlschema.Dialect
	// Schema names the tables, as given to the migration.
	Schema sqlschema.Config
	// Bare is a database of the same family where nothing was migrated,
	// and the names its tables would have.
	Bare func(t *testing.T) Database
}

// SQL is the database as the SQL layer reaches it, for writing rows as a
// writer of the tables would.
func (d Database) SQL() sqldb.DB {
	if d.Pool != nil {
		return sqldb.Pgx(d.Pool)
	}
	dialect, err := sqldb.For(d.Dialect)
	if err != nil {
		panic(err)
	}
	return sqldb.SQL(d.DB, dialect)
}

// Backend is one way to a database: its name, for subtests, and how to
// open a fresh one.
type Backend struct {
	Name string
	// Open returns a fresh database with conns connections at most,
	// closed and dropped when the test ends.
	Open func(t *testing.T, conns int32) Database
}

// Backends are the four ways to the tables the SQL layer supports.
var Backends = []Backend{
	{"postgres-pgx", func(t *testing.T, conns int32) Database {
		pool := pgtest.Pool(t, conns)
		db := Database{Pool: pool, Schema: sqlschema.Config{Schema: pgtest.Schema(t, pool)}}
		db.Bare = func(t *testing.T) Database {
			return Database{Pool: pool, Schema: sqlschema.Config{Schema: pgtest.Name(t)}}
		}
		return db
	}},
	{"postgres-sql", func(t *testing.T, conns int32) Database {
		pool := pgtest.Pool(t, conns)
		db := stdlib.OpenDBFromPool(pool)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		schema := sqlschema.Config{Schema: pgtest.Name(t)}
		t.Cleanup(func() {
			_, err := pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema.Schema}.Sanitize()+` CASCADE`)
			require.NoError(t, err)
		})
		require.NoError(t, sqlschema.MigrateSQL(t.Context(), db, sqlschema.Postgres, schema))
		bare := func(t *testing.T) Database {
			return Database{DB: db, Dialect: sqlschema.Postgres, Schema: sqlschema.Config{Schema: pgtest.Name(t)}}
		}
		return Database{DB: db, Dialect: sqlschema.Postgres, Schema: schema, Bare: bare}
	}},
	{"mariadb", func(t *testing.T, conns int32) Database {
		db, name := mysqltest.DB(t, int(conns))
		schema := sqlschema.Config{Schema: name}
		require.NoError(t, sqlschema.MigrateSQL(t.Context(), db, sqlschema.MySQL, schema))
		bare := func(t *testing.T) Database {
			db, name := mysqltest.DB(t, 2)
			return Database{DB: db, Dialect: sqlschema.MySQL, Schema: sqlschema.Config{Schema: name}}
		}
		return Database{DB: db, Dialect: sqlschema.MySQL, Schema: schema, Bare: bare}
	}},
	{"sqlite", func(t *testing.T, _ int32) Database {
		db := OpenSQLite(t, filepath.Join(t.TempDir(), "oncemill.db"))
		require.NoError(t, sqlschema.MigrateSQLite(t.Context(), db, sqlschema.Config{}))
		bare := func(t *testing.T) Database {
			return Database{DB: OpenSQLite(t, filepath.Join(t.TempDir(), "bare.db")), Dialect: sqlschema.SQLite}
		}
		return Database{DB: db, Dialect: sqlschema.SQLite, Bare: bare}
	}},
}

// DSN is the modernc.org/sqlite data source of the file at path, with
// what dedup/sqlite.Open sets: the WAL journal, a busy timeout, foreign
// keys and BEGIN IMMEDIATE transactions.
func DSN(path string) string {
	return "file:" + path + "?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=foreign_keys(1)&_txlock=immediate"
}

// OpenSQLite opens the SQLite file at path (see [DSN]) and closes it when
// the test ends.
func OpenSQLite(t testing.TB, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", DSN(path))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	return db
}
