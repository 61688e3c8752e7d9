package missingtable_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/missingtable"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestIs: a missing table, or a missing schema (database), on PostgreSQL
// and on MariaDB is a missing table; a syntax error is not.
func TestIs(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 1)
	schema := pgtest.Schema(t, pool)
	for q, want := range map[string]bool{
		`SELECT 1 FROM "` + schema + `".no_such_table`: true,
		`SELECT 1 FROM no_such_schema_x.no_such_table`: true,
		`SELEC 1`: false,
	} {
		_, err := pool.Exec(ctx, q)
		require.Error(t, err, q)
		require.Equal(t, want, missingtable.Is(err), "postgres: %s: %v", q, err)
	}
	db, name := mysqltest.DB(t, 1)
	for q, want := range map[string]bool{
		"SELECT 1 FROM `" + name + "`.no_such_table":     true,
		"SELECT 1 FROM no_such_database_x.no_such_table": true,
		"SELEC 1": false,
	} {
		_, err := db.ExecContext(ctx, q)
		require.Error(t, err, q)
		require.Equal(t, want, missingtable.Is(err), "mysql: %s: %v", q, err)
	}
	require.False(t, missingtable.Is(nil))
}
