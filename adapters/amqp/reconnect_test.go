package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
)

// TestConsumingResumesAfterConnectionDrops: the connection drops while
// handlers hold messages of several keys. Their acks, which come after,
// cannot reach the broker and are dropped; the broker delivers those
// messages again once the subscriber has reconnected and consumes again,
// together with what was published meanwhile, and nothing is left in the
// queue.
func TestConsumingResumesAfterConnectionDrops(t *testing.T) {
	const held, later = 5, 5
	a := newAdmin(t)
	cfg := testConfig()
	topic := uniqueName("reconnect")
	a.track(cfg, topic)
	sub, err := amqp.NewSubscriber(cfg, testLogger())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	pub := newPublisher(t, cfg)

	publish := func(from, n int) {
		var msgs []*message.Message
		for i := from; i < from+n; i++ {
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d", i))
			msg.Metadata.Set(delivery.PartitionKey, fmt.Sprintf("key-%02d", i))
			msgs = append(msgs, msg)
		}
		require.NoError(t, pub.Publish(topic, msgs...))
	}
	receive := func(out <-chan *message.Message) *message.Message {
		t.Helper()
		select {
		case msg, ok := <-out:
			require.True(t, ok, "channel of messages closed")
			return msg
		case <-time.After(30 * time.Second):
			t.Fatal("no message within 30s")
			return nil
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	publish(0, held)
	// Messages of different keys are handed out at once: all of them
	// are held before any is acked.
	var first []*message.Message
	for range held {
		first = append(first, receive(out))
	}

	amqp.DropConnections(sub)
	for _, msg := range first {
		require.True(t, msg.Ack())
	}
	publish(held, later)

	// Payload to whether it came back marked redelivered.
	seen := map[string]bool{}
	for len(seen) < held+later {
		msg := receive(out)
		seen[string(msg.Payload)] = wamqp.IsMessageRedelivered(msg)
		require.True(t, msg.Ack())
	}
	for _, msg := range first {
		redelivered, ok := seen[string(msg.Payload)]
		require.True(t, ok, "message %s, whose ack was dropped, delivered again", msg.Payload)
		require.True(t, redelivered, "message %s delivered again marked redelivered", msg.Payload)
	}
	cancel()
	for range out {
		t.Fatal("a message handed out after the subscription's context was done")
	}
	require.NoError(t, sub.Close())
	ready, _ := a.inspect(cfg.QueueName(topic))
	require.Zero(t, ready, "every message acked after the reconnection")
}
