package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestPartitionKey: messages with one partition key land in one
// partition, in publish order, and the partition is the one franz-go
// (like the Java client) picks for that key; published one by one, and as
// batches of many messages in one Publish (which go out as one batch).
func TestPartitionKey(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 64} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			testPartitionKey(t, batch)
		})
	}
}

func testPartitionKey(t *testing.T, batch int) {
	brokers := Brokers(t)
	topic := uniqueName("pkey")
	createTopic(t, brokers, topic, 4)
	pub := newPublisher(t, brokers)

	const keys, perKey = 8, 25
	sent := map[string][]string{} // key → UUIDs in publish order
	var pending []*message.Message
	for i := range keys * perKey {
		key := fmt.Sprintf("customer-%d", i%keys)
		msg := message.NewMessage(watermill.NewUUID(), []byte(key))
		if i%2 == 0 {
			msg.Metadata.Set(delivery.PartitionKey, key)
		} else {
			// The idempotency key orders when there is no partition key.
			msg.Metadata.Set(delivery.IdempotencyKey, key)
		}
		pending = append(pending, msg)
		if len(pending) == batch || i == keys*perKey-1 {
			require.NoError(t, pub.Publish(topic, pending...))
			pending = nil
		}
		sent[key] = append(sent[key], msg.UUID)
	}

	sub := newSubscriber(t, brokers, uniqueName("pkey"))
	defer func() { require.NoError(t, sub.Close()) }()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	got := map[string][]string{}
	partitionOf := map[string]string{}
	partitions := map[string]bool{}
	for range keys * perKey {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		key := string(msg.Payload)
		p := msg.Metadata.Get(delivery.Partition)
		if prev, ok := partitionOf[key]; ok {
			require.Equal(t, prev, p, "key %s in two partitions", key)
		}
		partitionOf[key] = p
		partitions[p] = true
		got[key] = append(got[key], msg.UUID)
		require.True(t, msg.Ack())
	}
	require.Equal(t, sent, got, "per-key publish order")
	require.Greater(t, len(partitions), 1, "keys spread over partitions")

	// franz-go's default partitioner puts each key where we did.
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic))
	require.NoError(t, err)
	defer cl.Close()
	for key, p := range partitionOf {
		res := cl.ProduceSync(context.Background(), &kgo.Record{Key: []byte(key), Value: []byte("kgo")})
		require.NoError(t, res.FirstErr())
		require.Equal(t, p, strconv.Itoa(int(res[0].Record.Partition)), "key %s", key)
	}
}

// TestPoisonRecord: records that are not Watermill messages, written by
// another client, reach the subscriber as messages with DecodeError set,
// and the partition goes on with the good messages behind them; no
// reconnect loop.
func TestPoisonRecord(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic := uniqueName("poison")
	createTopic(t, brokers, topic, 1)

	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.DefaultProduceTopic(topic))
	require.NoError(t, err)
	defer cl.Close()
	bad := []*kgo.Record{
		{Value: []byte{0xde, 0xad, 0xbe, 0xef}, Headers: []kgo.RecordHeader{{Key: "\xff\xfe", Value: []byte{0, 1, 2}}}},
		{Value: nil}, // a tombstone: no value, no headers
		{Value: []byte("x"), Headers: []kgo.RecordHeader{{Key: kafka.UUIDHeader, Value: []byte("poison-uuid")}, {Key: "k", Value: []byte{0xc3, 0x28}}}},
	}
	require.NoError(t, cl.ProduceSync(context.Background(), bad...).FirstErr())

	pub := newPublisher(t, brokers)
	var good []string
	for i := range 100 {
		msg := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		require.NoError(t, pub.Publish(topic, msg))
		good = append(good, msg.UUID)
	}

	sub := newSubscriber(t, brokers, uniqueName("poison"))
	defer func() { require.NoError(t, sub.Close()) }()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	for i, want := range []struct{ uuid, reason string }{
		{topic + "/0/0", `header 0: key "\xff\xfe" is not valid UTF-8; missing header _watermill_message_uuid`},
		{topic + "/0/1", "missing header _watermill_message_uuid (null value and no headers: a tombstone)"},
		{"poison-uuid", `header "k": value "\xc3(" is not valid UTF-8`},
	} {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.Equal(t, want.uuid, msg.UUID)
		require.Equal(t, want.reason, delivery.DecodeErrorOf(msg))
		require.Equal(t, bad[i].Value, []byte(msg.Payload), "the raw value")
		require.Equal(t, topic, msg.Metadata.Get(delivery.Topic))
		require.Equal(t, "0", msg.Metadata.Get(delivery.Partition))
		require.Equal(t, strconv.Itoa(i), msg.Metadata.Get(delivery.Offset))
		require.True(t, msg.Ack())
	}
	for i, uuid := range good {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.Equal(t, uuid, msg.UUID, "good message %d", i)
		require.Empty(t, delivery.DecodeErrorOf(msg))
		require.Equal(t, strconv.Itoa(i+len(bad)), msg.Metadata.Get(delivery.Offset))
		require.True(t, msg.Ack())
	}
	msgtest.Nothing(t, msgs, 500*time.Millisecond)
}

// TestIdempotentProducer: the publisher writes through an idempotent
// producer, so every record carries a producer ID and epoch, which the
// broker (kfake too, through InitProducerID) assigned and deduplicates
// retries by.
func TestIdempotentProducer(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic := uniqueName("idem")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	for i := range 20 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))))
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < 20 {
		fetches := cl.PollFetches(ctx)
		require.NoError(t, fetches.Err())
		recs = append(recs, fetches.Records()...)
	}
	producerID := recs[0].ProducerID
	require.GreaterOrEqual(t, producerID, int64(0), "an idempotent producer's record has a producer ID")
	for i, r := range recs {
		require.Equal(t, producerID, r.ProducerID, "record %d", i)
		require.GreaterOrEqual(t, r.ProducerEpoch, int16(0))
		require.Equal(t, int64(i), r.Offset)
		require.Equal(t, strconv.Itoa(i), string(r.Value))
	}
}

// TestPublishInvalidMessage: Publish refuses a message that no subscriber
// could decode.
func TestPublishInvalidMessage(t *testing.T) {
	t.Parallel()
	pub := newPublisher(t, Brokers(t))
	err := pub.Publish(uniqueName("invalid"), message.NewMessage("", []byte("x")))
	require.ErrorIs(t, err, kafka.ErrInvalidMessage)
}
