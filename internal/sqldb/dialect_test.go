package sqldb_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// TestRebind: PostgreSQL numbers the placeholders; a '?' in a string
// literal or a quoted identifier stays; MySQL and SQLite keep '?'.
func TestRebind(t *testing.T) {
	t.Parallel()
	q := `SELECT a FROM "t?" WHERE b = ? AND c = '?' AND d IN (?, ?)`
	require.Equal(t, `SELECT a FROM "t?" WHERE b = $1 AND c = '?' AND d IN ($2, $3)`, sqldb.Postgres.Rebind(q))
	require.Equal(t, q, sqldb.MySQL.Rebind(q))
	require.Equal(t, q, sqldb.SQLite.Rebind(q))
}
