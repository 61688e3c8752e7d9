package postgres_test

import (
	"context"
	"errors"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// conformanceStore is a store in a schema of its own, beside an effects
// table, whose connections go through a proxy that cut breaks and run as a
// role granted what an application's user is (read and write the schema's
// tables), and a direct pool, a superuser's, for reading the tables behind
// it, which the cut leaves alone.
func conformanceStore(t *testing.T) (store *postgres.Store, direct *pgxpool.Pool, schema string, role pgtest.Role, cut func(*testing.T)) {
	t.Helper()
	direct = pgtest.Pool(t, 2)
	schema = pgtest.Schema(t, direct)
	_, err := direct.Exec(t.Context(), `CREATE TABLE `+pgx.Identifier{schema, "effects"}.Sanitize()+` (key text NOT NULL)`)
	require.NoError(t, err)
	role = pgtest.NewRole(t, direct, schema)
	proxy := deduptest.NewProxy(t, upstream(t))
	cfg, err := pgxpool.ParseConfig(pgtest.URL())
	require.NoError(t, err)
	cfg.MaxConns = 12 // concurrent claims of one key wait for the pool or the row alike
	k, v := role.Param()
	cfg.ConnConfig.RuntimeParams[k] = v
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, proxy.Addr())
	}
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err = postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	return store, direct, schema, role, func(*testing.T) { proxy.Cut() }
}

// deadCopies reads a record's count of dead copies, 0 without a record.
func deadCopies(direct *pgxpool.Pool, schema string) func(context.Context, dedup.Key) (int, error) {
	return func(ctx context.Context, key dedup.Key) (int, error) {
		var n int
		err := direct.QueryRow(ctx, `SELECT dead_copies FROM `+pgx.Identifier{schema, "inbox_failures"}.Sanitize()+`
			WHERE consumer = $1 AND key = $2`, key.Consumer, key.Key).Scan(&n)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, nil
		}
		return n, err
	}
}

func TestConformanceTx(t *testing.T) {
	t.Parallel()
	deduptest.RunTxStore(t, deduptest.TxHarness{
		New: func(t *testing.T) deduptest.TxBundle {
			store, direct, schema, role, cut := conformanceStore(t)
			effects := pgx.Identifier{schema, "effects"}.Sanitize()
			return deduptest.TxBundle{
				Store: store,
				Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
					_, err := postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, key)
					return err
				},
				Effects: func(ctx context.Context, key string) (n int, err error) {
					err = direct.QueryRow(ctx, `SELECT count(*) FROM `+effects+` WHERE key = $1`, key).Scan(&n)
					return n, err
				},
				DeadCopies: deadCopies(direct, schema),
				Cut:        cut,
				Refused: func(ctx context.Context, tx dedup.InboxTx) error {
					_, err := postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `SELECT 1 / 0`)
					return err
				},
				Misconfigure: map[string]func(*testing.T) func(*testing.T){
					"MissingTable": func(t *testing.T) func(*testing.T) {
						renameInbox(t, direct, schema, "inbox", "inbox_away")
						return func(t *testing.T) { renameInbox(t, direct, schema, "inbox_away", "inbox") }
					},
					"ReadOnly": func(t *testing.T) func(*testing.T) {
						role.ReadOnly(t, "inbox", "inbox_starts")
						return func(t *testing.T) { role.Writable(t, "inbox", "inbox_starts") }
					},
				},
			}
		},
	})
}

func TestConformanceLease(t *testing.T) {
	t.Parallel()
	deduptest.RunLeaseStore(t, deduptest.LeaseHarness{
		New: func(t *testing.T) deduptest.LeaseBundle {
			store, direct, schema, _, cut := conformanceStore(t)
			return deduptest.LeaseBundle{Store: store, DeadCopies: deadCopies(direct, schema), Cut: cut}
		},
	})
}

// renameInbox renames the inbox table of schema and its starts table from
// to.
func renameInbox(t *testing.T, direct *pgxpool.Pool, schema, from, to string) {
	t.Helper()
	for _, suffix := range []string{"", "_starts"} {
		_, err := direct.Exec(t.Context(), `ALTER TABLE `+pgx.Identifier{schema, from + suffix}.Sanitize()+
			` RENAME TO `+pgx.Identifier{to + suffix}.Sanitize())
		require.NoError(t, err)
	}
}

// TestConformanceUpgrade: tables migrated from the wide inbox row hold
// their records, which the store answers as before.
func TestConformanceUpgrade(t *testing.T) {
	t.Parallel()
	deduptest.RunUpgrade(t, sqltest.Upgrade(sqltest.Backends[0], func(t *testing.T, db sqltest.Database) dedup.TxStore {
		store, err := postgres.New(db.Pool, db.Schema)
		require.NoError(t, err)
		return store
	}))
}
