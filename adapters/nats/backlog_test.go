package nats_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestBacklogSharedStream: in a stream that holds two topics, a group's
// backlog of one topic counts that topic's messages only: 4 of the 4+6
// before the group's consumer exists, then NumPending + NumAckPending of
// the consumer, 4-1 once one is acked and another held (the held one
// counted), the same as the consumer's own info says. A topic the stream
// does not hold is ErrTopicNotInStream; one whose stream does not exist is
// ErrStreamNotFound, even with CreateStreams: Backlog creates nothing.
func TestBacklogSharedStream(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	ctx := context.Background()
	base := safe(a.topic(""))
	stream := "shared_" + base
	topic, other := base+".orders", base+".refunds"
	a.createStream(t, stream, base+".>")
	cfg := a.config()
	cfg.CreateStreams = false
	cfg.Stream = stream
	pub := publisher(t, cfg)
	for i := range 4 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))))
	}
	for i := range 6 {
		require.NoError(t, pub.Publish(other, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))))
	}

	scfg := nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing"}
	sub := subscriber(t, scfg)
	backlog := func() int64 {
		t.Helper()
		b, err := sub.Backlog(ctx, topic)
		require.NoError(t, err)
		require.Nil(t, b.Partitions)
		return b.Messages
	}
	require.Equal(t, int64(4), backlog(), "before the consumer exists: the topic's messages in the stream")

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.True(t, msgtest.Receive(t, msgs, 10*time.Second).Ack())
	held := msgtest.Receive(t, msgs, 10*time.Second)
	// The ack is confirmed by JetStream after Ack returns.
	msgtest.WaitFor(t, "backlog 3", func() bool {
		n := backlog()
		require.GreaterOrEqual(t, n, int64(3), "the held message counts")
		return n == 3
	})
	info := a.consumer(stream, scfg.ConsumerName(topic))
	require.Equal(t, int64(3), int64(info.NumPending)+int64(info.NumAckPending), "the consumer's own info")
	require.Equal(t, 1, info.NumAckPending, "the held message")
	require.True(t, held.Ack())

	_, err = sub.Backlog(ctx, base+"_elsewhere")
	require.ErrorIs(t, err, nats.ErrTopicNotInStream)
	own := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing"})
	missing := a.topic("_missing")
	_, err = own.Backlog(ctx, missing)
	require.ErrorIs(t, err, nats.ErrStreamNotFound, "CreateStreams does not apply to Backlog")
	_, err = own.Backlog(ctx, missing)
	require.ErrorIs(t, err, nats.ErrStreamNotFound, "still not created")

	// Closed: an error, not a figure.
	require.NoError(t, sub.Close())
	_, err = sub.Backlog(ctx, topic)
	require.ErrorIs(t, err, nats.ErrClosed)
}
