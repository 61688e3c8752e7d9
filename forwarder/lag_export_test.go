package forwarder_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestOutboxLag: OutboxLag reads the backlog as a relay's Lag does, with no
// relay: the pending rows, those that wait on an open transaction and the
// transaction that holds them.
func TestOutboxLag(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()

	lag, err := forwarder.OutboxLag(ctx, b.pool, b.schema)
	require.NoError(t, err)
	require.Equal(t, forwarder.Lag{}, lag, "an empty outbox")

	// A transaction with an id, left open: every row committed after it
	// waits for it.
	open, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer open.Rollback(ctx) //nolint:errcheck // no-op after commit
	_, err = open.Exec(ctx, `SELECT pg_current_xact_id()`)
	require.NoError(t, err)
	b.write(t, "orders", event("order-1", 1), event("order-2", 2))

	lag, err = forwarder.OutboxLag(ctx, b.pool, b.schema)
	require.NoError(t, err)
	require.Equal(t, 2, lag.Pending)
	require.Equal(t, 2, lag.Waiting, "both rows wait for the open transaction")
	require.Positive(t, lag.OldestAge)
	require.NotNil(t, lag.HeldBy, "the oldest open transaction on the server")
	require.NotEmpty(t, lag.HeldBy.String())

	r := newRelay(t, b, &sink{}, nil)
	relayLag, err := r.Lag(ctx)
	require.NoError(t, err)
	require.Equal(t, lag.Pending, relayLag.Pending, "the same queries as the relay's")
	require.Equal(t, lag.Waiting, relayLag.Waiting)

	require.NoError(t, open.Commit(ctx))
	require.Eventually(t, func() bool {
		lag, err = forwarder.OutboxLag(ctx, b.pool, b.schema)
		require.NoError(t, err)
		return lag.Waiting == 0
	}, 30*time.Second, 10*time.Millisecond, "the rows may go out once it ends")
	require.Equal(t, 2, lag.Pending)
	require.Nil(t, lag.HeldBy)
}

func TestOutboxLagErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := forwarder.OutboxLag(ctx, nil, sqlschema.Config{})
	require.ErrorContains(t, err, "pool is nil")

	pool := pgtest.Pool(t, 2)
	_, err = forwarder.OutboxLag(ctx, pool, sqlschema.Config{OutboxTable: "Out Box"})
	require.ErrorContains(t, err, "OutboxTable")

	_, err = forwarder.OutboxLag(ctx, pool, sqlschema.Config{Schema: pgtest.Name(t)}) // never migrated
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr), "%v", err)
	require.Equal(t, "42P01", pgErr.Code, "undefined_table")
}
