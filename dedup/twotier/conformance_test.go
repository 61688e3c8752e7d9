package twotier_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/deduptest"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
)

// TestConformance runs the transactional store's conformance suite on a
// Redis lock in front of a PostgreSQL record, each subtest with a prefix
// and a schema of its own, the record's sessions running as a role granted
// what an application's user is, whose writes ReadOnly takes away. Both reach their servers through proxies, and
// Cut breaks both: with the lock alone cut the store goes on, on the
// record, by design. The lock's lease is short so that a key the lock
// learnt done is forgotten soon after the record's window passes (the
// lock keeps a key at least one lease).
func TestConformance(t *testing.T) {
	t.Parallel()
	deduptest.RunTxStore(t, deduptest.TxHarness{
		New: func(t *testing.T) deduptest.TxBundle {
			direct := redistest.Client(t)
			prefix := redistest.Prefix(t, direct) // its keys are deleted through the direct client
			opts, err := goredis.ParseURL(redistest.URL())
			require.NoError(t, err)
			redisProxy := deduptest.NewProxy(t, opts.Addr)
			opts.Addr, opts.MaxRetries, opts.DialerRetries = redisProxy.Addr(), -1, 1
			client := goredis.NewClient(opts)
			t.Cleanup(func() { _ = client.Close() })
			lock, err := redis.New(redis.Config{Client: client, Prefix: prefix})
			require.NoError(t, err)

			pool := pgtest.Pool(t, 2)
			schema := pgtest.Schema(t, pool)
			effects := pgx.Identifier{schema, "effects"}.Sanitize()
			_, err = pool.Exec(t.Context(), `CREATE TABLE `+effects+` (key text NOT NULL)`)
			require.NoError(t, err)
			role := pgtest.NewRole(t, pool, schema)
			pgCfg, err := pgx.ParseConfig(pgtest.URL())
			require.NoError(t, err)
			pgProxy := deduptest.NewProxy(t, net.JoinHostPort(pgCfg.Host, strconv.Itoa(int(pgCfg.Port))))
			cfg, err := pgxpool.ParseConfig(pgtest.URL())
			require.NoError(t, err)
			cfg.MaxConns = 8
			k, v := role.Param()
			cfg.ConnConfig.RuntimeParams[k] = v
			cfg.ConnConfig.DialFunc = func(ctx context.Context, network, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, network, pgProxy.Addr())
			}
			recordPool, err := pgxpool.NewWithConfig(t.Context(), cfg)
			require.NoError(t, err)
			t.Cleanup(recordPool.Close)
			record, err := postgres.New(recordPool, postgres.Config{Schema: schema})
			require.NoError(t, err)

			store, err := twotier.New(twotier.Config{Lock: lock, Record: record, Lease: 2 * time.Second})
			require.NoError(t, err)
			return deduptest.TxBundle{
				Store: store,
				Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
					_, err := postgres.Tx(tx.WithTx(ctx)).Exec(ctx, `INSERT INTO `+effects+` (key) VALUES ($1)`, key)
					return err
				},
				Effects: func(ctx context.Context, key string) (n int, err error) {
					err = pool.QueryRow(ctx, `SELECT count(*) FROM `+effects+` WHERE key = $1`, key).Scan(&n)
					return n, err
				},
				DeadCopies: func(ctx context.Context, key dedup.Key) (n int, err error) {
					err = pool.QueryRow(ctx, `SELECT dead_copies FROM `+pgx.Identifier{schema, "inbox_failures"}.Sanitize()+`
						WHERE consumer = $1 AND key = $2`, key.Consumer, key.Key).Scan(&n)
					if errors.Is(err, pgx.ErrNoRows) {
						return 0, nil
					}
					return n, err
				},
				Cut: func(*testing.T) {
					redisProxy.Cut()
					pgProxy.Cut()
				},
				Misconfigure: map[string]func(*testing.T) func(*testing.T){
					"MissingTable": func(t *testing.T) func(*testing.T) {
						renameRecord(t, pool, schema, "inbox", "inbox_away")
						return func(t *testing.T) { renameRecord(t, pool, schema, "inbox_away", "inbox") }
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

// TestConformanceSQLiteRecord runs the suite with the record on SQLite,
// through database/sql, whose transactions end with the context they were
// begun on: the store begins the record's transaction on the context
// InboxBegin was given, not on the claim's. The lock is cut off nowhere:
// with the lock alone cut the store goes on, on the record, by design.
func TestConformanceSQLiteRecord(t *testing.T) {
	t.Parallel()
	deduptest.RunTxStore(t, deduptest.TxHarness{
		New: func(t *testing.T) deduptest.TxBundle {
			direct := redistest.Client(t)
			lock, err := redis.New(redis.Config{Client: direct, Prefix: redistest.Prefix(t, direct)})
			require.NoError(t, err)
			record, err := sqlite.Open(t.Context(), filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, record.Close()) })
			db := record.DB()
			_, err = db.ExecContext(t.Context(), `CREATE TABLE effects (key TEXT NOT NULL)`)
			require.NoError(t, err)
			store, err := twotier.New(twotier.Config{Lock: lock, Record: record, Lease: 2 * time.Second})
			require.NoError(t, err)
			return deduptest.TxBundle{
				Store: store,
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
						renameSQLite := func(t *testing.T, from, to string) {
							for _, suffix := range []string{"", "_starts"} {
								_, err := db.ExecContext(t.Context(), `ALTER TABLE "`+from+suffix+`" RENAME TO "`+to+suffix+`"`)
								require.NoError(t, err)
							}
						}
						renameSQLite(t, "inbox", "inbox_away")
						return func(t *testing.T) { renameSQLite(t, "inbox_away", "inbox") }
					},
				},
			}
		},
	})
}

// renameRecord renames the PostgreSQL record's inbox table of schema and
// its starts table from to.
func renameRecord(t *testing.T, pool *pgxpool.Pool, schema, from, to string) {
	t.Helper()
	for _, suffix := range []string{"", "_starts"} {
		_, err := pool.Exec(t.Context(), `ALTER TABLE `+pgx.Identifier{schema, from + suffix}.Sanitize()+
			` RENAME TO `+pgx.Identifier{to + suffix}.Sanitize())
		require.NoError(t, err)
	}
}
