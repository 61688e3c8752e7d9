package kafka_test

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
)

// TestPubSub runs Watermill's universal Pub/Sub tests for the
// one-at-a-time subscriber (MaxInFlightPerPartition 1).
//
// Features:
//   - ConsumerGroups: subscribers in one group share the partitions, each
//     group gets every message.
//   - ExactlyOnceDelivery: false; Kafka redelivers whatever was not
//     committed, which the inbox middleware deduplicates.
//   - GuaranteedOrder: true; the Marshaler keys every record by its
//     partition key, keyless messages by the empty key, so the suite's
//     keyless messages share one partition and keep their order, also
//     across the ten subscribers of TestPublishSubscribeInOrder.
//   - Persistent: true.
//   - TestReconnect is skipped by the suite: it needs a command that
//     restarts the broker.
func TestPubSub(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	tests.TestPubSub(t,
		tests.Features{
			ConsumerGroups:      true,
			ExactlyOnceDelivery: false,
			GuaranteedOrder:     true,
			Persistent:          true,
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			// One group per suite test: every subscriber of a test is
			// one "service", and tests do not rebalance each other.
			return suitePubSub(t, brokers, "suite_"+unsafeName.ReplaceAllString(t.Name(), "_"), 1, false)
		},
		func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
			return suitePubSub(t, brokers, group, 1, false)
		},
	)
}

// TestPubSubParallel runs the universal tests for the key-parallel
// subscriber (MaxInFlightPerPartition 64), twice:
//   - keyless: the suite's messages carry no key, so they all share the
//     empty key, one partition and one key's strict order: GuaranteedOrder
//     holds, TestNoAck included (an unacked message holds back its key).
//   - keyed: the publisher gives every message its UUID as partition key,
//     so messages spread over the partitions and are handled concurrently
//     within each; there is no order across keys, so GuaranteedOrder is
//     false.
//
// ExactlyOnceDelivery is false, as for the one-at-a-time subscriber.
func TestPubSubParallel(t *testing.T) {
	t.Parallel()
	for _, keyed := range []bool{false, true} {
		name := "keyless"
		if keyed {
			name = "keyed"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			brokers := Brokers(t)
			tests.TestPubSub(t,
				tests.Features{
					ConsumerGroups:      true,
					ExactlyOnceDelivery: false,
					GuaranteedOrder:     !keyed,
					Persistent:          true,
				},
				func(t *testing.T) (message.Publisher, message.Subscriber) {
					return suitePubSub(t, brokers, "suite_"+unsafeName.ReplaceAllString(t.Name(), "_"), 64, keyed)
				},
				func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
					return suitePubSub(t, brokers, group, 64, keyed)
				},
			)
		})
	}
}

// suitePubSub returns a publisher and a subscriber of group for the
// universal tests, with the subscriber's MaxInFlightPerPartition; keyed
// gives every published message without a partition key its UUID as one.
func suitePubSub(t *testing.T, brokers []string, group string, maxInFlight int, keyed bool) (message.Publisher, message.Subscriber) {
	kp, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	var p message.Publisher = kp
	if keyed {
		p = keyingPublisher{kp}
	}
	// Some tests never close a publisher they get
	// (TestNewSubscriberReceivesOldMessages) or close it in a goroutine
	// of their own (TestMessageCtx); close each once, at the latest when
	// its test ends.
	pub := &closeOncePublisher{Publisher: p}
	t.Cleanup(func() { _ = pub.Close() })
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:         brokers,
		ConsumerGroup:   group,
		NackResendSleep: kafka.NoSleep,
		TopicPartitions: 4,
		Sarama:          fastGroups,
		// TestMessageCtx closes the subscriber while its message is
		// unacked and wants the message's context cancelled within its
		// timeout: Close cancels it when the drain ends.
		DrainTimeout: time.Second,

		MaxInFlightPerPartition: maxInFlight,
	}, testLogger())
	if err != nil {
		t.Fatal(err)
	}
	// TestPublishSubscribeInOrder closes its subscribers before it
	// subscribes them (defer require.NoError(t, sub.Close()) calls Close
	// at once), so close every subscriber again at the end of its test;
	// Close is idempotent and safe for concurrent use.
	t.Cleanup(func() { _ = sub.Close() })
	return pub, sub
}

// TestPubSubNoGroup runs the universal tests for a subscriber without a
// consumer group, which reads every partition from the oldest record on
// each Subscribe and commits nothing: every subscriber receives every
// message, old ones included.
func TestPubSubNoGroup(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	tests.TestPubSub(t,
		tests.Features{
			ConsumerGroups:                   false,
			ExactlyOnceDelivery:              false,
			GuaranteedOrder:                  true,
			Persistent:                       true,
			NewSubscriberReceivesOldMessages: true,
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) {
			return suitePubSub(t, brokers, "", 1, false)
		},
		nil,
	)
}

// closeOncePublisher makes Close idempotent and safe for concurrent use;
// watermill-kafka's Publisher.Close is neither.
type closeOncePublisher struct {
	message.Publisher
	once sync.Once
	err  error
}

func (p *closeOncePublisher) Close() error {
	p.once.Do(func() { p.err = p.Publisher.Close() })
	return p.err
}

// keyingPublisher sets each message's partition key to its UUID unless it
// has one.
type keyingPublisher struct{ message.Publisher }

func (p keyingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.Metadata.Get(delivery.PartitionKey) == "" {
			m.Metadata.Set(delivery.PartitionKey, m.UUID)
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}
