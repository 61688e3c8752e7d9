package sqlstore_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/sqlstore"
)

// TestConformance runs the public TxStore suite on every dialect and
// driver, each subtest on its own schema or database, the store dialing
// its server through a proxy that the Cut subtest breaks.
func TestConformance(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pgx", "pq", "mysql"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			deduptest.RunTxStore(t, deduptest.TxHarness{
				New: func(t *testing.T) deduptest.TxBundle {
					b := open(t, name, 4)
					proxy := deduptest.NewProxy(t, b.upstream(t))
					store, err := sqlstore.New(b.openVia(t, proxy.Addr()), sqlstore.Config{Dialect: b.dialect, Schema: b.schema})
					require.NoError(t, err)
					return deduptest.TxBundle{
						Store: store,
						Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
							return b.effect(tx.WithTx(ctx), key)
						},
						Effects: func(ctx context.Context, key string) (n int, err error) {
							err = b.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+b.table("effects")+` WHERE k = `+b.ph(1), key).Scan(&n)
							return n, err
						},
						DeadCopies: func(ctx context.Context, key dedup.Key) (int, error) {
							r, _ := b.row(t, key)
							return r.deadCopies, nil
						},
						Cut: func(*testing.T) { proxy.Cut() },
						Misconfigure: map[string]func(*testing.T) func(*testing.T){
							"MissingTable": func(t *testing.T) func(*testing.T) {
								b.renameInbox(t, "inbox", "inbox_away")
								return func(t *testing.T) { b.renameInbox(t, "inbox_away", "inbox") }
							},
						},
					}
				},
			})
		})
	}
}

// renameInbox renames the inbox table and its starts table from to.
func (b backend) renameInbox(t *testing.T, from, to string) {
	t.Helper()
	for _, suffix := range []string{"", "_starts"} {
		q := `ALTER TABLE ` + b.table(from+suffix) + ` RENAME TO "` + to + suffix + `"`
		if b.dialect == sqlstore.MySQL {
			q = `RENAME TABLE ` + b.table(from+suffix) + ` TO ` + b.table(to+suffix)
		}
		_, err := b.db.ExecContext(t.Context(), q)
		require.NoError(t, err)
	}
}
