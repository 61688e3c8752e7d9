package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestFIFODeduplicatesRetriesNotReplays publishes, to one FIFO queue and
// within SQS's five-minute deduplication window, a message twice (a
// producer's retry: dropped), a replay of it from the dead-letter queue and
// two dead-lettered copies of it, one of them twice. Everything but the two
// retries is delivered.
func TestFIFODeduplicatesRetriesNotReplays(t *testing.T) {
	t.Parallel()
	a := newAdmin(t)
	topic := uniqueName("fifo-dedup") + ".fifo"
	a.trackTopic(topic)
	pub := newPublisher(t, sqs.PublisherConfig{Config: testConfig()})

	msg := func(payload string, md map[string]string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		m.Metadata.Set(delivery.IdempotencyKey, "pay-7")
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		return m
	}
	dead := func(at string) map[string]string {
		return map[string]string{
			delivery.DeadTopic:        "payments.fifo",
			delivery.DeadConsumer:     "charge",
			delivery.DeadAttempts:     "3",
			delivery.DeadError:        "card declined",
			delivery.DeadLastFailedAt: at,
		}
	}
	for _, m := range []*message.Message{
		msg("original", nil),
		msg("original, retried", nil),
		msg("replay of entry 12", map[string]string{delivery.Replay: "12"}),
		msg("dead-lettered", dead("2026-03-01T10:04:00.5Z")),
		msg("dead-lettered again", dead("2026-03-01T10:09:00.25Z")),
		msg("dead-lettered again, retried", dead("2026-03-01T10:09:00.25Z")),
	} {
		require.NoError(t, pub.Publish(topic, m))
	}

	sub := newSubscriber(t, testSubscriberConfig())
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	var got []string
	for range 4 {
		m := msgtest.Receive(t, msgs, 10*time.Second)
		got = append(got, string(m.Payload))
		m.Ack()
	}
	msgtest.Nothing(t, msgs, 2*time.Second)
	require.Equal(t, []string{"original", "replay of entry 12", "dead-lettered", "dead-lettered again"}, got,
		"one message group, in order; the retries are dropped")
}
