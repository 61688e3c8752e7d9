package dlq_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestReplaySubscriber: only the requested entries of the subscriber's own
// consumer and topic are delivered; a nack leaves the entry for the next
// poll, an ack deletes it.
func TestReplaySubscriber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t)
	ids := e.seed(t,
		dead("orders", "charge", "declined"),    // requested: delivered
		dead("orders", "ship", "no address"),    // another consumer
		dead("refunds", "charge", "timeout"),    // another topic
		dead("orders", "charge", "not pending")) // not requested
	n, err := e.store.RequestReplay(ctx, dlq.Filter{IDs: ids[:3]})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	n, err = e.store.RequestReplay(ctx, dlq.Filter{IDs: ids[:1]})
	require.NoError(t, err)
	require.Zero(t, n, "already requested")
	_, err = e.store.RequestReplay(ctx, dlq.Filter{})
	require.ErrorIs(t, err, dlq.ErrNoSelection)

	_, err = dlq.NewReplaySubscriber(e.pool, sqlschema.Config{Schema: e.cfg.Schema}, dlq.ReplaySubscriberConfig{})
	require.ErrorContains(t, err, "ReplaySubscriberConfig.Consumer")
	sub, err := dlq.NewReplaySubscriber(e.pool, sqlschema.Config{Schema: e.cfg.Schema}, dlq.ReplaySubscriberConfig{Consumer: "charge", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	msgs, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	first := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, ids[0], e.replayID(t, first))
	first.Nack()
	again := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, ids[0], e.replayID(t, again), "a nacked replay comes back")
	require.NotEqual(t, first.Metadata.Get(delivery.Replay), again.Metadata.Get(delivery.Replay),
		"with a fresh grant: the nacked copy's no longer reopens the key")
	require.Equal(t, ids, e.ids(t), "nothing deleted before the ack")
	again.Ack()
	require.Eventually(t, func() bool { return len(e.ids(t)) == 3 }, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, ids[1:], e.ids(t), "the acked entry is gone, the others stay")
	msgtest.Nothing(t, msgs, 100*time.Millisecond)
}

// replayID is the dead-letter entry a replayed message came from.
func (e env) replayID(t *testing.T, m *message.Message) int64 {
	t.Helper()
	require.NotEmpty(t, m.Metadata.Get(delivery.Replay), "marked as a replay")
	var id int64
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT id FROM `+e.table()+` WHERE uuid = $1`, m.UUID).Scan(&id))
	return id
}
