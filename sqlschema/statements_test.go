package sqlschema_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/sqlschema"
)

// TestMigrationStatements: a MySQL step is split at each ';' that ends a
// line, without its comment lines; the other dialects run a step whole.
func TestMigrationStatements(t *testing.T) {
	m := sqlschema.Migration{Up: "-- the table\nCREATE TABLE t (\n  a INT -- the key\n);\n\nCREATE INDEX i ON t (a);\nDROP TABLE x"}
	require.Equal(t, []string{"CREATE TABLE t (\n  a INT -- the key\n);", "CREATE INDEX i ON t (a);", "DROP TABLE x"}, m.Statements(sqlschema.MySQL))
	require.Equal(t, []string{m.Up}, m.Statements(sqlschema.Postgres))
	require.Equal(t, []string{m.Up}, m.Statements(sqlschema.SQLite))

	// Every MySQL step splits into statements that each end one.
	ms, err := sqlschema.Migrations(sqlschema.MySQL, sqlschema.Config{Schema: "app"})
	require.NoError(t, err)
	for _, m := range ms {
		stmts := m.Statements(sqlschema.MySQL)
		require.NotEmpty(t, stmts, "%03d_%s", m.Version, m.Name)
		for _, s := range stmts {
			require.Regexp(t, `;$`, s, "%03d_%s", m.Version, m.Name)
		}
	}
}
