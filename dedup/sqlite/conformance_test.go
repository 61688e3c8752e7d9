package sqlite_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestConformance runs the transactional store's conformance suite, each
// subtest on a database file of its own. An embedded database has no
// connection to cut.
func TestConformance(t *testing.T) {
	t.Parallel()
	deduptest.RunTxStore(t, deduptest.TxHarness{
		New: func(t *testing.T) deduptest.TxBundle {
			s := openStore(t)
			db := s.DB()
			_, err := db.ExecContext(t.Context(), `CREATE TABLE effects (key TEXT NOT NULL)`)
			require.NoError(t, err)
			return deduptest.TxBundle{
				Store: s,
				Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
					_, err := sqlite.Tx(tx.WithTx(ctx)).ExecContext(ctx, `INSERT INTO effects (key) VALUES (?)`, key)
					return err
				},
				Effects: func(ctx context.Context, key string) (n int, err error) {
					err = db.QueryRowContext(ctx, `SELECT count(*) FROM effects WHERE key = ?`, key).Scan(&n)
					return n, err
				},
				DeadCopies: func(ctx context.Context, key dedup.Key) (n int, err error) {
					err = db.QueryRowContext(ctx, `SELECT COALESCE(SUM(dead_copies), 0) FROM inbox_failures WHERE consumer = ? AND key = ?`,
						key.Consumer, key.Key).Scan(&n)
					return n, err
				},
				Misconfigure: map[string]func(*testing.T) func(*testing.T){
					"MissingTable": func(t *testing.T) func(*testing.T) {
						renameInbox(t, db, "inbox", "inbox_away")
						return func(t *testing.T) { renameInbox(t, db, "inbox_away", "inbox") }
					},
				},
			}
		},
	})
}

// renameInbox renames the inbox table and its starts table from to.
func renameInbox(t *testing.T, db *sql.DB, from, to string) {
	t.Helper()
	for _, suffix := range []string{"", "_starts"} {
		_, err := db.ExecContext(t.Context(), `ALTER TABLE "`+from+suffix+`" RENAME TO "`+to+suffix+`"`)
		require.NoError(t, err)
	}
}

// TestConformanceUpgrade: tables migrated from the wide inbox row hold
// their records, which the store answers as before.
func TestConformanceUpgrade(t *testing.T) {
	t.Parallel()
	deduptest.RunUpgrade(t, sqltest.Upgrade(sqltest.Backends[3], func(t *testing.T, db sqltest.Database) dedup.TxStore {
		store, err := sqlite.New(t.Context(), db.DB, sqlite.Config{})
		require.NoError(t, err)
		return store
	}))
}
