package sqldb

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNamed: :name parameters become the dialect's placeholders, numbered
// and reused where it numbers them, one '?' per use elsewhere; casts,
// quoted strings and quoted identifiers are left alone, and an unknown
// name panics where the statement is written.
func TestNamed(t *testing.T) {
	q := `SELECT ':c', "a:k", x::text FROM t WHERE consumer = :c AND key = :k AND owner = :c`
	pg := Postgres.named(q)
	require.Equal(t, `SELECT ':c', "a:k", x::text FROM t WHERE consumer = $1 AND key = $2 AND owner = $1`, pg.sql)
	require.Equal(t, []arg{argConsumer, argKey}, pg.args)
	my := MySQL.named(q)
	require.Equal(t, `SELECT ':c', "a:k", x::text FROM t WHERE consumer = ? AND key = ? AND owner = ?`, my.sql)
	require.Equal(t, []arg{argConsumer, argKey, argConsumer}, my.args)
	require.Equal(t, "a = ? AND b = ':'", SQLite.named("a = :k AND b = ':'").sql)
	require.PanicsWithValue(t, "sqldb: unknown parameter :nope", func() { Postgres.named("a = :nope") })
}
