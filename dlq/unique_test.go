package dlq_test

import (
	"context"
	"hash/fnv"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestPublishUniqueUnderConcurrentWriters: many writers dead-letter the
// same message at once, each in its own transaction on its own
// connection, with no inbox to order them, and the table keeps one entry.
// A trigger holds every writer's insert at an advisory lock until all of
// them are inside their insert, past any look at the table, so the writers
// overlap for certain.
func TestPublishUniqueUnderConcurrentWriters(t *testing.T) {
	t.Parallel()
	const writers = 8
	pool := pgtest.Pool(t, writers+2)
	cfg := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	pub, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	e := env{pool: pool, cfg: cfg, pub: pub}
	ctx := context.Background()

	h := fnv.New32a()
	h.Write([]byte(cfg.Schema))
	gate := int64(h.Sum32())
	q := `"` + cfg.Schema + `"`
	_, err = pool.Exec(ctx, `CREATE FUNCTION `+q+`.gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_advisory_xact_lock_shared(`+itoa(gate)+`);
	RETURN NEW;
END $$;
CREATE TRIGGER gate BEFORE INSERT ON `+e.table()+` FOR EACH ROW EXECUTE FUNCTION `+q+`.gate()`)
	require.NoError(t, err)

	// The gate is shut: a session of its own holds the lock.
	holder, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock($1)`, gate)
	require.NoError(t, err)

	m := dead("orders", "billing", "card declined")
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() { errs <- pub.Publish("orders.dlq", m.Copy()) })
	}
	waitForGate(t, pool, gate, writers)
	_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock($1)`, gate)
	require.NoError(t, err)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Len(t, e.ids(t), 1, "one entry for the message, however many wrote it at once")

	// An entry whose replay was requested does not block a new one.
	store, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)
	n, err := store.RequestReplay(ctx, dlq.Filter{IDs: e.ids(t)})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, pub.Publish("orders.dlq", m.Copy()))
	require.NoError(t, pub.Publish("orders.dlq", m.Copy()))
	require.Len(t, e.ids(t), 2, "the replayed entry and one new entry")
}

// waitForGate waits until n sessions wait for the advisory lock gate.
func waitForGate(t *testing.T, pool *pgxpool.Pool, gate int64, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND ((classid::bigint << 32) | objid::bigint) = $1`, gate).Scan(&waiting))
		return waiting == n
	}, 30*time.Second, 5*time.Millisecond, "%d writers at the gate", n)
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
