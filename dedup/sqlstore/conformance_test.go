package sqlstore_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestConformance runs the public TxStore suite on every dialect and
// driver, each subtest on its own schema or database, the store dialing
// its server through a proxy that the Cut subtest breaks, as a database
// user of its own that the ReadOnly misconfiguration takes the writes on
// the inbox tables from.
func TestConformance(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pgx", "pq", "mysql"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			deduptest.RunTxStore(t, deduptest.TxHarness{
				New: func(t *testing.T) deduptest.TxBundle {
					b := open(t, name, 4)
					proxy := deduptest.NewProxy(t, b.upstream(t))
					user, readOnly, writable := b.storeUser(t)
					store, err := sqlstore.New(b.openVia(t, proxy.Addr(), user), sqlstore.Config{Dialect: b.dialect, Schema: b.schema})
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
							"ReadOnly": func(t *testing.T) func(*testing.T) {
								readOnly(t)
								return writable
							},
						},
					}
				},
			})
		})
	}
}

// storeUser creates the store's database user for the test, granted what
// an application's user is (read and write every table of the backend's
// schema or database): a PostgreSQL role that the store's sessions run as
// ([pgtest.Role]), a MySQL user that it logs in as ([mysqltest.User]),
// because the test server's own user skips every permission check. It
// returns the user's name for [backend.openVia], and what takes its writes
// on the inbox tables away and gives them back.
func (b backend) storeUser(t *testing.T) (name string, readOnly, writable func(*testing.T)) {
	t.Helper()
	inbox := []string{b.names.InboxName, b.names.InboxName + "_starts"}
	if b.dialect == sqlstore.MySQL {
		u := mysqltest.NewUser(t, b.db, b.schema.Schema)
		return u.Name, func(t *testing.T) { u.ReadOnly(t, inbox...) }, func(t *testing.T) { u.Writable(t, inbox...) }
	}
	r := pgtest.NewRole(t, pgtest.Pool(t, 1), b.schema.Schema)
	return r.Name, func(t *testing.T) { r.ReadOnly(t, inbox...) }, func(t *testing.T) { r.Writable(t, inbox...) }
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

// TestConformanceUpgrade: tables migrated from the wide inbox row hold
// their records, which the store answers as before, on PostgreSQL and
// MariaDB.
func TestConformanceUpgrade(t *testing.T) {
	t.Parallel()
	for _, b := range sqltest.Backends {
		d := sqlstore.Postgres
		switch b.Name {
		case "postgres-sql":
		case "mariadb":
			d = sqlstore.MySQL
		default:
			continue
		}
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			deduptest.RunUpgrade(t, sqltest.Upgrade(b, func(t *testing.T, db sqltest.Database) dedup.TxStore {
				store, err := sqlstore.New(db.DB, sqlstore.Config{Dialect: d, Schema: db.Schema})
				require.NoError(t, err)
				return store
			}))
		})
	}
}
