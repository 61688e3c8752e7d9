package kafka_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestBacklogPartitions: a group's backlog, read by a subscriber of the
// group that never subscribes, is per partition the high watermark minus
// the group's committed offset, in both subscriber modes. 30 records over
// 3 partitions: before the group consumes, nothing is committed and every
// record is lag; after a member has acked 10 and closed, each partition's
// committed offset is its first record not acked (all 10 with one
// message per partition at a time; none is committed where the first is
// not acked, which leaves the whole partition as lag), and the figures
// match Sarama's own
// reads of the high watermarks and committed offsets.
func TestBacklogPartitions(t *testing.T) {
	t.Parallel()
	for name, tune := range map[string]func(*kafka.SubscriberConfig){
		"key-parallel":          func(*kafka.SubscriberConfig) {},
		"one message at a time": func(c *kafka.SubscriberConfig) { c.MaxInFlightPerPartition = 1 },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testBacklogPartitions(t, name == "one message at a time", tune)
		})
	}
}

func testBacklogPartitions(t *testing.T, inOrder bool, tune func(*kafka.SubscriberConfig)) {
	const (
		partitions = 3
		published  = 30
		acked      = 10
	)
	ctx := context.Background()
	brokers := Brokers(t)
	topic, group := uniqueName("backlog"), uniqueName("backlog")
	createTopic(t, brokers, topic, partitions)
	pub := newPublisher(t, brokers)
	for i := range published {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))
		msg.Metadata.Set(delivery.PartitionKey, fmt.Sprint("key-", i))
		require.NoError(t, pub.Publish(topic, msg))
	}
	high := highWatermarks(t, brokers, topic, partitions)

	monitor := newSubscriber(t, brokers, group, tune)
	defer func() { require.NoError(t, monitor.Close()) }()
	require.Implements(t, (*adapters.Backlogger)(nil), monitor)
	backlog := func() adapters.Backlog {
		t.Helper()
		b, err := monitor.(adapters.Backlogger).Backlog(ctx, topic)
		require.NoError(t, err)
		require.Len(t, b.Partitions, partitions)
		return b
	}

	before := backlog()
	require.Equal(t, int64(published), before.Messages, "nothing committed: every record, the group starting from the oldest")
	for i, p := range before.Partitions {
		require.Equal(t, int32(i), p.Partition)
		require.Equal(t, int64(-1), p.Committed)
		require.Equal(t, high[p.Partition], p.HighWatermark)
		require.Equal(t, p.HighWatermark, p.Lag)
	}

	// A member acks 10 records, noting each one's partition and offset.
	consumer := newSubscriber(t, brokers, group, tune)
	msgs, err := consumer.Subscribe(ctx, topic)
	require.NoError(t, err)
	done := map[int32]map[int64]bool{}
	for range acked {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		p, err := strconv.ParseInt(msg.Metadata.Get(delivery.Partition), 10, 32)
		require.NoError(t, err)
		o, err := strconv.ParseInt(msg.Metadata.Get(delivery.Offset), 10, 64)
		require.NoError(t, err)
		if done[int32(p)] == nil {
			done[int32(p)] = map[int64]bool{}
		}
		done[int32(p)][o] = true
		require.True(t, msg.Ack())
	}
	// The group commits, in each partition, up to its first record not
	// acked; the key-parallel member hands out records of different keys
	// at once, so that one need not be the tenth.
	want := map[int32]int64{}
	var committed int64
	for p := range int32(partitions) {
		for done[p][want[p]] {
			want[p]++
		}
		committed += want[p]
	}
	t.Logf("committed per partition: %v", want)
	if inOrder {
		require.Equal(t, int64(acked), committed, "records handed out in offset order")
	}
	// Commits go out every CommitInterval; watermill-kafka's Close may
	// drop the last ack's mark, so wait for them while the member runs.
	msgtest.WaitFor(t, fmt.Sprintf("backlog %d", published-committed), func() bool {
		n := backlog().Messages
		require.GreaterOrEqual(t, n, int64(published)-committed)
		return n == int64(published)-committed
	})
	require.NoError(t, consumer.Close())

	after := backlog()
	require.Equal(t, int64(published)-committed, after.Messages)
	var sum int64
	for _, p := range after.Partitions {
		if want[p.Partition] > 0 {
			require.Equal(t, want[p.Partition], p.Committed, "partition %d", p.Partition)
			require.Equal(t, want[p.Partition], committedOffset(t, brokers, group, topic, fmt.Sprint(p.Partition)), "Sarama's read of partition %d", p.Partition)
		} else {
			require.Equal(t, int64(-1), p.Committed, "partition %d: nothing acked, nothing committed", p.Partition)
		}
		require.Equal(t, high[p.Partition], p.HighWatermark, "partition %d", p.Partition)
		require.Equal(t, p.HighWatermark-want[p.Partition], p.Lag, "partition %d", p.Partition)
		sum += p.Lag
	}
	require.Equal(t, after.Messages, sum)
}

// highWatermarks reads each partition's high watermark with Sarama's own
// GetOffset.
func highWatermarks(t *testing.T, brokers []string, topic string, partitions int32) map[int32]int64 {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	client, err := sarama.NewClient(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, client.Close()) }()
	high := map[int32]int64{}
	var total int64
	for p := range partitions {
		high[p], err = client.GetOffset(topic, p, sarama.OffsetNewest)
		require.NoError(t, err)
		total += high[p]
	}
	require.Equal(t, int64(30), total, "every record published")
	return high
}

// TestBacklogNewest: a group that starts from the newest record and has
// committed nothing has no lag: it will never read what is there. A topic
// that does not exist is an error, and asking does not create it (the
// embedded broker creates topics on first use).
func TestBacklogNewest(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic := uniqueName("newest")
	createTopic(t, brokers, topic, 2)
	pub := newPublisher(t, brokers)
	for i := range 4 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(fmt.Sprint("m", i), nil)))
	}
	sub := newSubscriber(t, brokers, uniqueName("newest"), func(c *kafka.SubscriberConfig) { c.InitialOffset = kafka.Newest })
	defer func() { require.NoError(t, sub.Close()) }()
	b, err := sub.(adapters.Backlogger).Backlog(context.Background(), topic)
	require.NoError(t, err)
	require.Zero(t, b.Messages)
	var high int64
	for _, p := range b.Partitions {
		require.Equal(t, int64(-1), p.Committed)
		require.Zero(t, p.Lag)
		high += p.HighWatermark
	}
	require.Equal(t, int64(4), high, "the records are there")

	missing := uniqueName("missing")
	_, err = sub.(adapters.Backlogger).Backlog(context.Background(), missing)
	require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition)
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, admin.Close()) }()
	topics, err := admin.ListTopics()
	require.NoError(t, err)
	require.Contains(t, topics, topic)
	require.NotContains(t, topics, missing, "asking for a backlog creates no topic")
}

// TestBacklogWithoutGroup: a subscriber without a group commits nothing
// and is not a Backlogger.
func TestBacklogWithoutGroup(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, Brokers(t), "")
	defer func() { require.NoError(t, sub.Close()) }()
	_, ok := sub.(adapters.Backlogger)
	require.False(t, ok)
}

// TestBacklogSilentBroker: against a broker that accepts connections and
// never answers, Backlog returns when its context ends; Close waits for
// the read it left running, which ends when the connection drops, and
// Backlog after Close is ErrSubscriberClosed.
func TestBacklogSilentBroker(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	sub := newSubscriber(t, []string{ln.Addr().String()}, uniqueName("silent"))

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err = sub.(adapters.Backlogger).Backlog(ctx, "topic")
	require.ErrorIs(t, err, context.DeadlineExceeded)

	// The broker goes away: the read left running fails, and Close,
	// which waits for it, returns.
	require.NoError(t, ln.Close())
	<-accepted
	mu.Lock()
	for _, c := range conns {
		require.NoError(t, c.Close())
	}
	mu.Unlock()
	require.NoError(t, sub.Close())
	_, err = sub.(adapters.Backlogger).Backlog(context.Background(), "topic")
	require.ErrorIs(t, err, kafka.ErrSubscriberClosed)
}
