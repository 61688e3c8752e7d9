package deduptest_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/sqlite"
)

// conformanceSQLite is what a transactional store's own test runs: a
// fresh store per subtest (here a database file in the subtest's
// temporary directory), with an effects table that the handler-side
// Effect writes through the inbox's transaction and Effects counts.
func conformanceSQLite(t *testing.T) {
	deduptest.RunTxStore(t, deduptest.TxHarness{
		New: func(t *testing.T) deduptest.TxBundle {
			store, err := sqlite.Open(t.Context(), filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := store.Close(); err != nil {
					t.Error(err)
				}
			})
			db := store.DB()
			if _, err := db.ExecContext(t.Context(), `CREATE TABLE effects (key TEXT NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			return deduptest.TxBundle{
				Store: store,
				Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
					// As a handler does: the transaction from the context.
					_, err := sqlite.Tx(tx.WithTx(ctx)).ExecContext(ctx, `INSERT INTO effects (key) VALUES (?)`, key)
					return err
				},
				Effects: func(ctx context.Context, key string) (n int, err error) {
					err = db.QueryRowContext(ctx, `SELECT count(*) FROM effects WHERE key = ?`, key).Scan(&n)
					return n, err
				},
				// An embedded database has no connection to cut: no Cut,
				// and the Cut subtest is skipped.
			}
		},
	})
}

// A transactional store runs the suite from a test of its own package:
//
//	func TestConformance(t *testing.T) { conformanceSQLite(t) }
func ExampleRunTxStore() {}
