package main

import (
	"context"
	"database/sql"
	"net/url"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestGORMExactlyOnce runs the example on PostgreSQL and on MariaDB, with
// GORM bound to the inbox's transaction both ways: every order charged
// once despite the copies, the errors and the panics after the charge.
func TestGORMExactlyOnce(t *testing.T) {
	t.Parallel()
	for _, dialect := range []string{"postgres", "mysql"} {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			cfg := config{Dialect: dialect, Orders: 30, Copies: 3}
			switch dialect {
			case "postgres":
				cfg.DSN, cfg.Schema = postgresSchema(t)
			case "mysql":
				database := mysqltest.Database(t)
				cfg.DSN = mysqltest.Config(t, database).FormatDSN()
				cfg.Schema = sqlschema.Config{Schema: database}
			}
			for _, perMessage := range []bool{false, true} {
				cfg.OpenPerMessage = perMessage
				charged, err := run(context.Background(), cfg)
				require.NoError(t, err, "gorm.Open per message: %v", perMessage)
				require.Equal(t, cfg.Orders, charged)
			}
		})
	}
}

// postgresSchema returns the test server's URL with a fresh schema first
// on its search_path (for GORM's tables), and the inbox's Config for the
// same schema; the schema is dropped when the test ends.
func postgresSchema(t *testing.T) (string, sqlschema.Config) {
	t.Helper()
	pgtest.Pool(t, 1) // fails or skips when PostgreSQL is down
	schema := pgtest.Name(t)
	u, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	t.Cleanup(func() {
		db, err := sql.Open("pgx", pgtest.URL())
		require.NoError(t, err)
		defer db.Close()
		_, err = db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`)
		require.NoError(t, err)
	})
	return u.String(), sqlschema.Config{Schema: schema}
}
