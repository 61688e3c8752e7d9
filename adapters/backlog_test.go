package adapters_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

const (
	backlogPublished = 12
	backlogConsumed  = 5
)

// backlogSettles names the brokers whose backlog reaches its figure some
// time after the event that sets it, and why; the others report it at
// once.
var backlogSettles = map[string]string{
	// AWS documents the ApproximateNumberOf… attributes as eventually
	// consistent.
	"sqs": "SQS's message counts are eventually consistent",
	// A closed consumer's prefetched, unacked messages go back to ready
	// as the quorum queue processes the consumer's departure, after the
	// connection has closed.
	"amqp": "the closed consumer's prefetched messages return to ready",
}

// backlogUncounted names the brokers whose backlog leaves out the
// messages delivered and not yet acked, and why.
var backlogUncounted = map[string]string{
	"amqp": "AMQP reports a queue's ready messages only",
}

// TestBacklog: on every broker that keeps a consumer's place,
// PubSub.Backlog, read by a PubSub of the group that never subscribes (a
// monitor), is what the broker holds for the group: all 12 messages
// published before anything is consumed; 12-5 once a consumer of the
// group has received and acked 5, while it holds the sixth (where the
// broker counts what is delivered and not acked), and once it has closed.
// The broker's own reading, through another client, agrees. GoChannel
// keeps no place and says so with ErrNoBacklog.
func TestBacklog(t *testing.T) {
	t.Parallel()
	for _, b := range brokers(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runBacklog(t, b)
		})
	}
}

func runBacklog(t *testing.T, b broker) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group := "backlog_"+id, "lag_"+id
	if b.cleanup != nil {
		t.Cleanup(func() { b.cleanup(t, topic, group) })
	}
	monitor := b.open(t, group)
	defer closeQuietly(t, monitor)
	if b.url == "" { // GoChannel
		_, err := monitor.Backlog(ctx, topic)
		require.ErrorIs(t, err, adapters.ErrNoBacklog)
		return
	}

	consumer := b.open(t, group)
	// The group's queue (or consumer) first: RabbitMQ drops what no queue
	// holds.
	if init, ok := consumer.Subscriber.(message.SubscribeInitializer); ok {
		require.NoError(t, init.SubscribeInitialize(topic))
	}
	for i := range backlogPublished {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
		// One ordering key: Kafka puts every message in one partition and
		// its key-parallel subscriber hands them out in order, so that
		// the acked ones are the first ones.
		msg.Metadata.Set(delivery.PartitionKey, "one")
		require.NoError(t, consumer.Publisher.Publish(topic, msg))
	}
	requireBacklog(t, b, monitor, topic, group, backlogPublished, "published, nothing consumed")

	msgs, err := consumer.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range backlogConsumed {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.True(t, msg.Ack())
	}
	held := msgtest.Receive(t, msgs, 30*time.Second) // the sixth, unacked
	if why, ok := backlogUncounted[b.name]; !ok {
		// The acks reach the broker after Ack returns (Kafka commits
		// every CommitInterval): the backlog comes down to 12-5, never
		// below, for the held message counts until it is acked.
		left := int64(backlogPublished - backlogConsumed)
		msgtest.WaitFor(t, fmt.Sprintf("backlog %d while the sixth is held", left), func() bool {
			got := readBacklog(t, monitor, topic, "sixth held")
			require.GreaterOrEqual(t, got, left, "the held message is not acked")
			return got == left
		})
	} else {
		t.Logf("the backlog while a consumer holds messages is not checked: %s", why)
	}
	// Given back, and the consumer goes: the backlog is the same.
	require.True(t, held.Nack())
	require.NoError(t, consumer.Close())
	requireBacklog(t, b, monitor, topic, group, backlogPublished-backlogConsumed, "consumed and acked some, consumer closed")
}

// requireBacklog checks that ps reports want messages held for group on
// topic, at once or, for a broker in backlogSettles, once it settles,
// never above what was published meanwhile; and that the broker's own
// reading says the same.
func requireBacklog(t *testing.T, b broker, ps *adapters.PubSub, topic, group string, want int64, when string) {
	t.Helper()
	read := func() int64 { return readBacklog(t, ps, topic, when) }
	if why, ok := backlogSettles[b.name]; ok {
		msgtest.WaitFor(t, fmt.Sprintf("backlog %d (%s; %s)", want, when, why), func() bool { return read() == want })
	} else {
		require.Equal(t, want, read(), when)
	}
	require.Equal(t, int(want), b.pending(t, topic, group), "the broker's own reading, %s", when)
}

// readBacklog reads ps's backlog of topic, which must succeed and lie
// between nothing and all that was published.
func readBacklog(t *testing.T, ps *adapters.PubSub, topic, when string) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, err := ps.Backlog(ctx, topic)
	require.NoError(t, err, when)
	require.GreaterOrEqual(t, got.Messages, int64(0), when)
	require.LessOrEqual(t, got.Messages, int64(backlogPublished), when)
	return got.Messages
}
