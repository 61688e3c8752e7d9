package sqllayertest_test

import (
	"testing"

	"github.com/oncemill/oncemill/internal/testing/sqllayertest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestSQLLayer runs the suite on every backend the SQL layer supports:
// PostgreSQL through pgx and through database/sql, MariaDB (or MySQL)
// through database/sql, and SQLite in a file of the subtest's temporary
// directory (sqltest.Backends).
func TestSQLLayer(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		s := sqllayertest.Subject{Name: b.Name, Open: func(t *testing.T) sqllayertest.Database { return b.Open(t, 8) }}
		t.Run(s.Name, func(t *testing.T) {
			t.Parallel()
			sqllayertest.Run(t, s)
		})
	}
}
