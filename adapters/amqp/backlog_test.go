package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestBacklog: a subscriber's backlog is its queue's ready messages: an
// error wrapping ErrQueueNotFound before the queue is declared; the 10
// published; with a prefetch of 1, 10-5 while the consumer has acked 4
// and holds the fifth, which the broker has delivered and AMQP does not
// count; 10-4 once the fifth is nacked back to the queue. The broker's
// own passive declare agrees each time. A cancelled context and a closed
// subscriber are errors, not figures.
func TestBacklog(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	ctx := context.Background()
	topic := uniqueName("backlog")
	cfg := testConfig()
	cfg.ConsumerGroup = "billing"
	cfg.Prefetch = 1
	sub := newSubscriber(t, a, cfg, topic)
	backlogger, ok := sub.(adapters.Backlogger)
	require.True(t, ok, "%T is an adapters.Backlogger", sub)
	backlog := func() int64 {
		t.Helper()
		b, err := backlogger.Backlog(ctx, topic)
		require.NoError(t, err)
		require.Nil(t, b.Partitions)
		return b.Messages
	}

	_, err := backlogger.Backlog(ctx, topic)
	require.ErrorIs(t, err, amqp.ErrQueueNotFound)
	require.ErrorContains(t, err, cfg.QueueName(topic))

	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	pub := newPublisher(t, cfg)
	const published = 10
	for i := range published {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))))
	}
	queue := cfg.QueueName(topic)
	ready, _ := a.inspect(queue)
	require.Equal(t, published, ready)
	require.Equal(t, int64(published), backlog(), "published, confirmed, nothing consumed")

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	const acked = 4
	for range acked {
		require.True(t, msgtest.Receive(t, msgs, 10*time.Second).Ack())
	}
	// With a prefetch of 1 the broker delivers the fifth only once the
	// fourth is acked, and no sixth while the fifth is unacked.
	held := msgtest.Receive(t, msgs, 10*time.Second)
	ready, _ = a.inspect(queue)
	require.Equal(t, published-acked-1, ready)
	require.Equal(t, int64(published-acked-1), backlog(), "the held message is delivered, not ready")

	require.True(t, held.Nack())
	// Requeued as the broker processes the nack; it is then delivered
	// again, to this subscription, which holds it out of the queue:
	// stop consuming first.
	require.NoError(t, sub.Close())
	msgtest.WaitFor(t, "the nacked message back in the queue", func() bool {
		ready, _ := a.inspect(queue)
		return ready == published-acked
	})

	other, err := amqp.NewSubscriber(cfg, testLogger())
	require.NoError(t, err)
	defer func() { require.NoError(t, other.Close()) }()
	b, err := other.Backlog(ctx, topic)
	require.NoError(t, err)
	require.Equal(t, int64(published-acked), b.Messages, "read by a subscriber that never subscribed")

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = other.Backlog(cancelled, topic)
	require.ErrorIs(t, err, context.Canceled)

	_, err = backlogger.Backlog(ctx, topic)
	require.ErrorIs(t, err, amqp.ErrSubscriberClosed)
}
