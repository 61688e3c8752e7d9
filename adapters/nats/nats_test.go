package nats_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/msgtest"
)

// TestRoundTrip publishes a message with metadata and receives it with
// its UUID, payload and metadata, and the delivery facts of JetStream.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := a.topic(".orders")
	pub := publisher(t, a.config())
	sub := subscriber(t, nats.SubscriberConfig{Config: a.config(), ConsumerGroup: "billing"})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	sent := message.NewMessage(watermill.NewUUID(), []byte(`{"id":42}`))
	sent.Metadata.Set(delivery.IdempotencyKey, "order-42")
	sent.Metadata.Set("trace", "abc")
	sent.Metadata.Set(delivery.Attempts, "7") // a delivery fact: never sent
	require.NoError(t, pub.Publish(topic, sent))

	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, sent.UUID, got.UUID)
	require.Equal(t, sent.Payload, got.Payload)
	require.Equal(t, "order-42", got.Metadata.Get(delivery.IdempotencyKey))
	require.Equal(t, "abc", got.Metadata.Get("trace"))
	require.Equal(t, topic, got.Metadata.Get(delivery.Topic))
	require.Equal(t, nats.Config{}.StreamName(topic), got.Metadata.Get(delivery.Stream))
	require.Equal(t, "1", got.Metadata.Get(delivery.StreamSequence))
	require.Equal(t, "1", got.Metadata.Get(delivery.Attempts))
	require.Equal(t, "false", got.Metadata.Get(delivery.Redelivered))
	require.Empty(t, delivery.DecodeErrorOf(got))
	require.True(t, got.Ack())

	require.Eventually(t, func() bool {
		ci := a.consumer(nats.Config{}.StreamName(topic), "billing")
		return ci.NumAckPending == 0 && ci.AckFloor.Stream == 1
	}, 10*time.Second, 20*time.Millisecond, "the ack reached JetStream")
}
