package middleware_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// txBackend is a transactional store plus the handler-side effect written
// through the transaction that the inbox puts in the context.
type txBackend struct {
	store dedup.TxStore
	// effect writes one effect row for key in the inbox's transaction.
	effect func(ctx context.Context, key string) error
	// effects counts effect rows, committed ones only.
	effects func(t *testing.T) int
	// attempts reads the recorded attempts of a key, or -1 if no row.
	attempts func(t *testing.T, consumer, key string) int
	// status reads the status of a key's record, or "" if no row.
	status func(t *testing.T, consumer, key string) string
	// starts reads the started-and-unfinished attempts of a key, 0 if none.
	starts func(t *testing.T, consumer, key string) int
}

// txBackends runs fn once per transactional store, each on its own fresh
// schema or database.
func txBackends(t *testing.T, maxConns int32, fn func(t *testing.T, b txBackend)) {
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		fn(t, postgresBackend(t, maxConns))
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		fn(t, sqliteBackend(t))
	})
}

func postgresBackend(t *testing.T, maxConns int32) txBackend {
	pool := pgtest.Pool(t, maxConns)
	return postgresBackendIn(t, pool, pgtest.Schema(t, pool))
}

// postgresBackendIn is the PostgreSQL backend on a schema that pgtest
// migrated.
func postgresBackendIn(t *testing.T, pool *pgxpool.Pool, schema string) txBackend {
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	q := `"` + schema + `"`
	_, err = pool.Exec(context.Background(), `CREATE TABLE `+q+`.effects (key text NOT NULL)`)
	require.NoError(t, err)
	return txBackend{
		store: store,
		effect: func(ctx context.Context, key string) error {
			tx := postgres.Tx(ctx)
			if tx == nil {
				return errors.New("no postgres transaction in context")
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+q+`.effects (key) VALUES ($1)`, key)
			return err
		},
		effects: func(t *testing.T) int {
			var n int
			require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM `+q+`.effects`).Scan(&n))
			return n
		},
		attempts: func(t *testing.T, consumer, key string) int {
			n := -1
			err := pool.QueryRow(context.Background(), `SELECT COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) FROM `+q+`.inbox i LEFT JOIN `+q+`.inbox_failures f USING (consumer, key) WHERE consumer = $1 AND key = $2`, consumer, key).Scan(&n)
			if !errors.Is(err, pgx.ErrNoRows) {
				require.NoError(t, err)
			}
			return n
		},
		status: func(t *testing.T, consumer, key string) string {
			var st string
			err := pool.QueryRow(context.Background(), `SELECT status FROM `+q+`.inbox WHERE consumer = $1 AND key = $2`, consumer, key).Scan(&st)
			if !errors.Is(err, pgx.ErrNoRows) {
				require.NoError(t, err)
			}
			return st
		},
		starts: func(t *testing.T, consumer, key string) int {
			var n int
			err := pool.QueryRow(context.Background(), `SELECT started FROM `+q+`.inbox_starts WHERE consumer = $1 AND key = $2`, consumer, key).Scan(&n)
			if !errors.Is(err, pgx.ErrNoRows) {
				require.NoError(t, err)
			}
			return n
		},
	}
}

func sqliteBackend(t *testing.T) txBackend {
	ctx := context.Background()
	store, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, store.Close()) })
	db := store.DB()
	_, err = db.ExecContext(ctx, `CREATE TABLE effects (key TEXT NOT NULL)`)
	require.NoError(t, err)
	return txBackend{
		store: store,
		effect: func(ctx context.Context, key string) error {
			tx := sqlite.Tx(ctx)
			if tx == nil {
				return errors.New("no sqlite transaction in context")
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO effects (key) VALUES (?)`, key)
			return err
		},
		effects: func(t *testing.T) int {
			var n int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM effects`).Scan(&n))
			return n
		},
		attempts: func(t *testing.T, consumer, key string) int {
			n := -1
			err := db.QueryRowContext(ctx, `SELECT COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) FROM inbox i LEFT JOIN inbox_failures f USING (consumer, key) WHERE consumer = ? AND key = ?`, consumer, key).Scan(&n)
			if !errors.Is(err, sql.ErrNoRows) {
				require.NoError(t, err)
			}
			return n
		},
		status: func(t *testing.T, consumer, key string) string {
			var st string
			err := db.QueryRowContext(ctx, `SELECT status FROM inbox WHERE consumer = ? AND key = ?`, consumer, key).Scan(&st)
			if !errors.Is(err, sql.ErrNoRows) {
				require.NoError(t, err)
			}
			return st
		},
		starts: func(t *testing.T, consumer, key string) int {
			var n int
			err := db.QueryRowContext(ctx, `SELECT started FROM inbox_starts WHERE consumer = ? AND key = ?`, consumer, key).Scan(&n)
			if !errors.Is(err, sql.ErrNoRows) {
				require.NoError(t, err)
			}
			return n
		},
	}
}
