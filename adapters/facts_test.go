package adapters_test

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestRepublishCarriesNoDeliveryFacts: a message consumed from one broker
// (Kafka, RabbitMQ, SQS, NATS), on its second delivery where the broker
// counts them, and published as it came to another, or to the same one,
// arrives there with the delivery facts of its new delivery only: the
// same delivery.IsAdapterFact keys as a message published straight to
// that broker, with that broker's topic, attempt count and redelivered
// flag, and none of the first broker's partition, offset, stream or
// sequence. Its own metadata, the replay marker and a dead-letter field
// travel with it.
func TestRepublishCarriesNoDeliveryFacts(t *testing.T) {
	t.Parallel()
	bs := []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), natsBroker(t)}
	for _, from := range bs {
		for _, to := range bs {
			t.Run(from.name+"_to_"+to.name, func(t *testing.T) {
				t.Parallel()
				runRepublish(t, from, to)
			})
		}
	}
}

func runRepublish(t *testing.T, from, to broker) {
	id := pgtest.Name(t)
	topicA, topicB, group := "facts_a_"+id, "facts_b_"+id, "facts_"+id
	for _, c := range []struct {
		b     broker
		topic string
	}{{from, topicA}, {to, topicB}} {
		if c.b.cleanup != nil {
			t.Cleanup(func() { c.b.cleanup(t, c.topic, group) })
		}
	}
	a, b := from.open(t, group), to.open(t, group)
	defer closeQuietly(t, a)
	defer closeQuietly(t, b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Subscribed first, so that every broker has the queue or consumer
	// that keeps what is published next.
	inA, err := a.Subscriber.Subscribe(ctx, topicA)
	require.NoError(t, err)
	inB, err := b.Subscriber.Subscribe(ctx, topicB)
	require.NoError(t, err)

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":7}`))
	msg.Metadata.Set(delivery.IdempotencyKey, "order-7")
	msg.Metadata.Set("tenant", "acme")
	msg.Metadata.Set(delivery.Replay, "grant-1")
	msg.Metadata.Set(delivery.DeadConsumer, "billing")
	require.NoError(t, a.Publisher.Publish(topicA, msg))
	first := msgtest.Receive(t, inA, time.Minute)
	first.Nack()
	got := msgtest.Receive(t, inA, time.Minute)
	got.Ack()
	require.Equal(t, msg.UUID, got.UUID)
	if n, ok := delivery.AttemptsOf(got); ok {
		require.Equal(t, 2, n, "%s counts the second delivery", from.name)
	}

	// Republished as it came, facts of the first delivery and all; and
	// the baseline, what the second broker sets on a message of its own.
	again := message.NewMessage(got.UUID, got.Payload)
	again.Metadata = maps.Clone(got.Metadata)
	require.NoError(t, b.Publisher.Publish(topicB, again))
	direct := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	require.NoError(t, b.Publisher.Publish(topicB, direct))
	byUUID := map[string]*message.Message{}
	for range 2 {
		m := msgtest.Receive(t, inB, time.Minute)
		m.Ack()
		byUUID[m.UUID] = m
	}
	arrived, baseline := byUUID[again.UUID], byUUID[direct.UUID]
	require.NotNil(t, arrived, "the republished message arrived")
	require.NotNil(t, baseline, "the direct message arrived")

	facts := func(m *message.Message) []string {
		var ks []string
		for k := range m.Metadata {
			if delivery.IsAdapterFact(k) {
				ks = append(ks, k)
			}
		}
		slices.Sort(ks)
		return ks
	}
	require.Equal(t, facts(baseline), facts(arrived), "the delivery facts %s sets, and no other", to.name)
	for _, k := range facts(arrived) {
		switch k {
		case delivery.Topic, delivery.Attempts, delivery.Redelivered:
			require.Equal(t, baseline.Metadata.Get(k), arrived.Metadata.Get(k), "%s is %s's own", k, to.name)
		}
	}
	require.Equal(t, topicB, arrived.Metadata.Get(delivery.Topic))
	require.Empty(t, delivery.DecodeErrorOf(arrived))
	for _, k := range []string{delivery.IdempotencyKey, "tenant", delivery.Replay, delivery.DeadConsumer} {
		require.Equal(t, msg.Metadata.Get(k), arrived.Metadata.Get(k), "%s travels", k)
	}
}

// TestProducerSetFactsDoNotTravel: the in-process GoChannel and the
// postgres:// broker set no delivery facts of their own, and a message
// published with some (a producer's copy of a consumed message, or a
// forged oncemill_decode_error that would have it dead-lettered unread)
// arrives without them, as on the other brokers; its own metadata, the
// replay marker and a dead-letter field travel with it.
func TestProducerSetFactsDoNotTravel(t *testing.T) {
	t.Parallel()
	for _, rawURL := range []string{"gochannel://", pgtest.URL()} {
		scheme, _, _ := strings.Cut(rawURL, ":")
		t.Run(scheme, func(t *testing.T) {
			t.Parallel()
			ps, err := adapters.Open(context.Background(), rawURL, adapters.Options{ConsumerGroup: "facts"})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, ps.Close()) })
			topic := "facts_" + pgtest.Name(t)
			if scheme == "postgres" {
				t.Cleanup(func() {
					_, err := pgtest.Pool(t, 1).Exec(context.Background(), `DROP TABLE IF EXISTS "watermill_`+topic+`"`)
					require.NoError(t, err)
				})
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			in, err := ps.Subscriber.Subscribe(ctx, topic)
			require.NoError(t, err)

			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":7}`))
			for _, k := range []string{delivery.Topic, delivery.Partition, delivery.Offset, delivery.Stream,
				delivery.StreamSequence, delivery.Attempts, delivery.Redelivered, delivery.DecodeError} {
				require.True(t, delivery.IsAdapterFact(k), k)
				msg.Metadata.Set(k, "3")
			}
			msg.Metadata.Set(delivery.IdempotencyKey, "order-7")
			msg.Metadata.Set(delivery.Replay, "grant-1")
			msg.Metadata.Set(delivery.DeadConsumer, "billing")
			sent := maps.Clone(msg.Metadata)
			require.NoError(t, ps.Publisher.Publish(topic, msg))
			require.Equal(t, sent, msg.Metadata, "the publisher leaves the caller's message alone")

			got := msgtest.Receive(t, in, time.Minute)
			got.Ack()
			require.Equal(t, msg.UUID, got.UUID)
			var facts []string
			for k := range got.Metadata {
				if delivery.IsAdapterFact(k) {
					facts = append(facts, k)
				}
			}
			require.Empty(t, facts, "no delivery fact the producer set arrives")
			require.Empty(t, delivery.DecodeErrorOf(got))
			for _, k := range []string{delivery.IdempotencyKey, delivery.Replay, delivery.DeadConsumer} {
				require.Equal(t, msg.Metadata.Get(k), got.Metadata.Get(k), "%s travels", k)
			}
		})
	}
}
