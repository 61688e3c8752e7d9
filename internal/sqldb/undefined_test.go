package sqldb_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestUndefinedTable: a missing table, or a missing schema (database), is
// a missing table on PostgreSQL (pgx), MariaDB and SQLite; a syntax error
// is not, nor is no error.
func TestUndefinedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 1)
	schema := pgtest.Schema(t, pool)
	my, name := mysqltest.DB(t, 1)
	for _, c := range []struct {
		db    sqldb.DB
		cases map[string]bool
	}{
		{sqldb.Pgx(pool), map[string]bool{
			`SELECT 1 FROM "` + schema + `".no_such_table`: true,
			`SELECT 1 FROM no_such_schema_x.no_such_table`: true,
			`SELEC 1`: false,
		}},
		{sqldb.SQL(my, sqldb.MySQL), map[string]bool{
			"SELECT 1 FROM `" + name + "`.no_such_table":     true,
			"SELECT 1 FROM no_such_database_x.no_such_table": true,
			"SELEC 1": false,
		}},
		{sqldb.SQL(sqltest.OpenSQLite(t, filepath.Join(t.TempDir(), "x.db")), sqldb.SQLite), map[string]bool{
			`SELECT 1 FROM no_such_table`: true,
			`SELEC 1`:                     false,
		}},
	} {
		d := c.db.Dialect()
		for q, want := range c.cases {
			_, err := c.db.Exec(ctx, q)
			require.Error(t, err, q)
			require.Equal(t, want, d.UndefinedTable(err), "%s: %s: %v", d, q, err)
		}
		require.False(t, d.UndefinedTable(nil))
	}
}
