package kafka_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestManualAck: offsets are committed only for acked messages, so a new
// subscriber in the group resumes at the first message not acked, with
// periodic commits and with SyncCommit.
func TestManualAck(t *testing.T) {
	t.Parallel()
	for _, syncCommit := range []bool{false, true} {
		t.Run(fmt.Sprintf("SyncCommit=%t", syncCommit), func(t *testing.T) {
			t.Parallel()
			testManualAck(t, func(c *kafka.SubscriberConfig) { c.SyncCommit = syncCommit })
		})
	}
}

func testManualAck(t *testing.T, tune func(*kafka.SubscriberConfig)) {
	brokers := Brokers(t)
	topic, group := uniqueName("ack"), uniqueName("ack")
	pub := newPublisher(t, brokers)

	var sent []string
	for i := range 10 {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
		msg.Metadata.Set(delivery.IdempotencyKey, "k") // one partition, in order
		require.NoError(t, pub.Publish(topic, msg))
		sent = append(sent, msg.UUID)
	}

	first := newSubscriber(t, brokers, group, tune)
	msgs, err := first.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for i := range 5 {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.Equal(t, sent[i], msg.UUID)
		require.True(t, msg.Ack())
	}
	sixth := msgtest.Receive(t, msgs, 30*time.Second)
	require.Equal(t, sent[5], sixth.UUID)
	require.Equal(t, "5", sixth.Metadata.Get(delivery.Offset))
	// The sixth is not acked; the subscriber goes away.
	require.NoError(t, first.Close())

	partition := sixth.Metadata.Get(delivery.Partition)
	require.Equal(t, int64(5), committedOffset(t, brokers, group, topic, partition),
		"the group's committed offset is the first message not acked")

	second := newSubscriber(t, brokers, group, tune)
	defer func() { require.NoError(t, second.Close()) }()
	msgs, err = second.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for i := 5; i < 10; i++ {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.Equal(t, sent[i], msg.UUID, "message %d", i)
		require.Equal(t, fmt.Sprint(i), msg.Metadata.Get(delivery.Offset))
		require.True(t, msg.Ack())
	}
	msgtest.Nothing(t, msgs, 500*time.Millisecond)
}

// TestInitialOffsetNewest: a new group with InitialOffset Newest skips
// what was published before it subscribed.
func TestInitialOffsetNewest(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic := uniqueName("newest")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	require.NoError(t, pub.Publish(topic, message.NewMessage("old", nil)))

	sub := newSubscriber(t, brokers, uniqueName("newest"), func(c *kafka.SubscriberConfig) { c.InitialOffset = kafka.Newest })
	defer func() { require.NoError(t, sub.Close()) }()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	// The group's start offset is resolved after it joins; publish until
	// something arrives, and it must not be "old".
	deadline := time.After(30 * time.Second)
	for i := 0; ; i++ {
		require.NoError(t, pub.Publish(topic, message.NewMessage(fmt.Sprint("new-", i), nil)))
		select {
		case msg := <-msgs:
			require.NotEqual(t, "old", msg.UUID)
			require.True(t, msg.Ack())
			return
		case <-time.After(200 * time.Millisecond):
		case <-deadline:
			t.Fatal("nothing received")
		}
	}
}

// committedOffset returns the offset group committed for topic's
// partition, through Sarama's admin client. It speaks 2.3 for the reason
// the subscriber does (see config.go).
func committedOffset(t *testing.T, brokers []string, group, topic, partition string) int64 {
	t.Helper()
	var p int32
	_, err := fmt.Sscan(partition, &p)
	require.NoError(t, err)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, admin.Close()) }()
	resp, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{topic: {p}})
	require.NoError(t, err)
	block := resp.GetBlock(topic, p)
	require.NotNil(t, block)
	require.Equal(t, sarama.ErrNoError, block.Err)
	return block.Offset
}
