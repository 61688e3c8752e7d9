package dlq_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

func TestCounts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()

	counts, err := e.store.Counts(ctx)
	require.NoError(t, err)
	require.Empty(t, counts, "an empty table has no counts")

	ids := seedFilterable(t, e)
	bare := e.seed(t, message.NewMessage("no-metadata", nil)) // no consumer, no topic
	_, err = e.pool.Exec(ctx, `UPDATE `+e.table()+` SET dead_at = $1 WHERE id = $2`, hour(9), bare[0])
	require.NoError(t, err)

	counts, err = e.store.Counts(ctx)
	require.NoError(t, err)
	for i := range counts {
		counts[i].Oldest = counts[i].Oldest.UTC()
	}
	require.Equal(t, []dlq.Count{
		{Consumer: "", Topic: "", Entries: 1, Oldest: hour(9)},
		{Consumer: "charge", Topic: "orders", Entries: 2, Oldest: hour(0)},
		{Consumer: "charge", Topic: "refunds", Entries: 1, Oldest: hour(4)},
		{Consumer: "refund", Topic: "refunds", Entries: 1, Oldest: hour(3)},
		{Consumer: "ship", Topic: "orders", Entries: 2, Oldest: hour(2)},
	}, counts, "grouped by consumer and topic, ordered, with the oldest entry's time")

	n, err := e.store.Purge(ctx, dlq.Filter{IDs: ids[:2]})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	_, err = e.store.RequestReplay(ctx, dlq.Filter{IDs: ids[2:3]})
	require.NoError(t, err)
	counts, err = e.store.Counts(ctx)
	require.NoError(t, err)
	require.Len(t, counts, 4, "a purged pair is left out")
	require.Equal(t, "charge", counts[1].Consumer)
	require.Equal(t, "refunds", counts[1].Topic)
	require.Equal(t, "ship", counts[3].Consumer)
	require.Equal(t, 2, counts[3].Entries, "an entry waiting for its replay is still counted")
}

func TestCountsErrors(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	store, err := dlq.NewStore(pool, sqlschema.Config{Schema: pgtest.Name(t)}) // never migrated
	require.NoError(t, err)
	_, err = store.Counts(context.Background())
	require.ErrorIs(t, err, dlq.ErrNotMigrated)
	require.ErrorContains(t, err, "dlq: count by consumer and topic")

	e := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = e.store.Counts(ctx)
	require.ErrorIs(t, err, context.Canceled)
}
