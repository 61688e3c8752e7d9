package kafka_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// parallelSubscriber is newSubscriber in the key-parallel mode, with
// frequent commits so that tests can watch the committed offset.
func parallelSubscriber(t testing.TB, brokers []string, group string) message.Subscriber {
	return newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) {
		c.MaxInFlightPerPartition = 64
		c.CommitInterval = 50 * time.Millisecond
	})
}

func publishKeyed(t testing.TB, pub message.Publisher, topic, key string, payload string) {
	t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
	msg.Metadata.Set(delivery.PartitionKey, key)
	require.NoError(t, pub.Publish(topic, msg))
}

func offsetOf(t testing.TB, msg *message.Message) int64 {
	t.Helper()
	off, err := strconv.ParseInt(msg.Metadata.Get(delivery.Offset), 10, 64)
	require.NoError(t, err)
	return off
}

// TestParallelKeys, on one partition: while a slow message of key A is
// in flight, the messages of key B behind it are delivered and acked;
// A's later messages wait for it, and a nacked one of A is delivered again
// before the next of A; the committed offset never passes A's unacked
// message, and reaches the end once everything is acked.
func TestParallelKeys(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic, group := uniqueName("keys"), uniqueName("keys")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	for i := range 3 {
		publishKeyed(t, pub, topic, "A", fmt.Sprint("A", i))
	}
	for i := range 5 {
		publishKeyed(t, pub, topic, "B", fmt.Sprint("B", i))
	}
	const end = 8

	sub := parallelSubscriber(t, brokers, group)
	defer func() { require.NoError(t, sub.Close()) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	var (
		slow   *message.Message
		orderA []string // payloads of A's deliveries, in delivery order
		bAcked int
	)
	for slow == nil || bAcked < 5 {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		switch p := string(msg.Payload); p[0] {
		case 'A':
			require.Nil(t, slow, "A's next message %s delivered while A0 is unacked", p)
			require.Equal(t, "A0", p)
			orderA = append(orderA, p)
			slow = msg // A0's handler is "still running"
		case 'B':
			require.Equal(t, fmt.Sprint("B", bAcked), p, "B in order")
			require.True(t, msg.Ack())
			bAcked++
		}
	}
	require.Equal(t, int64(0), offsetOf(t, slow))
	// B's five are acked while A0 is in flight; the committed offset
	// stays at or below A0's, through several commit intervals.
	for range 10 {
		require.LessOrEqual(t, committedOffset(t, brokers, group, topic, "0"), int64(0),
			"committed past A0, which is not acked")
		time.Sleep(50 * time.Millisecond)
	}
	msgtest.Nothing(t, msgs, 200*time.Millisecond)

	require.True(t, slow.Ack())
	nacks := 0
	for len(orderA) < 5 {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		p := string(msg.Payload)
		orderA = append(orderA, p)
		if p == "A1" && nacks < 2 {
			nacks++
			require.True(t, msg.Nack())
			continue
		}
		require.True(t, msg.Ack())
	}
	require.Equal(t, []string{"A0", "A1", "A1", "A1", "A2"}, orderA,
		"A strictly in order, the nacked A1 again before A2")
	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	require.Eventually(t, func() bool { return committedOffset(t, brokers, group, topic, "0") == end },
		10*time.Second, 20*time.Millisecond, "everything acked, committed to the end")
}

// TestParallelNackOtherKeysGoOn, on one partition: while a nacked message
// of key A waits out a long NackResendSleep, the messages of key B behind
// it are delivered and acked, one after the other; then A's message is
// delivered again, the same message at the same offset, and only once it
// is acked comes A's next one. The committed offset stays at the nacked
// message until it is acked, and reaches the end after.
func TestParallelNackOtherKeysGoOn(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic, group := uniqueName("nack"), uniqueName("nack")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	for _, p := range []string{"A0", "B0", "A1", "B1", "B2", "B3", "B4"} {
		publishKeyed(t, pub, topic, p[:1], p)
	}
	const end = 7

	// Long enough that B's four deliveries, each waiting only for the ack
	// of the one before, come first.
	const resend = 3 * time.Second
	sub := newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) {
		c.MaxInFlightPerPartition = 64
		c.CommitInterval = 50 * time.Millisecond
		c.NackResendSleep = resend
	})
	defer func() { require.NoError(t, sub.Close()) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	// The heads of both keys come at once; A1 and B1 wait for them.
	heads := map[string]*message.Message{}
	for range 2 {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		heads[string(msg.Payload)] = msg
	}
	require.Contains(t, heads, "A0")
	require.Contains(t, heads, "B0")
	a0 := heads["A0"]
	require.Equal(t, int64(0), offsetOf(t, a0))
	require.True(t, a0.Nack())
	require.True(t, heads["B0"].Ack())

	for i := 1; i < 5; i++ {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		require.Equal(t, fmt.Sprint("B", i), string(msg.Payload),
			"B's messages come in order while A0 waits to be delivered again, not after it")
		require.True(t, msg.Ack())
	}
	for range 5 {
		require.LessOrEqual(t, committedOffset(t, brokers, group, topic, "0"), int64(0),
			"committed past A0, which was nacked")
		time.Sleep(50 * time.Millisecond)
	}

	again := msgtest.Receive(t, msgs, 30*time.Second)
	require.Equal(t, "A0", string(again.Payload), "the nacked A0 again, before A1")
	require.Equal(t, a0.UUID, again.UUID)
	require.Equal(t, int64(0), offsetOf(t, again))
	require.LessOrEqual(t, committedOffset(t, brokers, group, topic, "0"), int64(0),
		"committed past A0 before it was acked")
	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	require.True(t, again.Ack())

	a1 := msgtest.Receive(t, msgs, 30*time.Second)
	require.Equal(t, "A1", string(a1.Payload))
	require.True(t, a1.Ack())
	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	require.Eventually(t, func() bool { return committedOffset(t, brokers, group, topic, "0") == end },
		10*time.Second, 20*time.Millisecond, "everything acked, committed to the end")
}

// TestParallelRebalance: a subscriber holds messages in flight (their
// handlers wait for their contexts) when a second member joins the group.
// The rebalance cancels those contexts, the first member commits nothing
// past them, and every message is eventually acked by one member or the
// other: none lost, and none of those committed before the rebalance
// delivered again.
func TestParallelRebalance(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic, group := uniqueName("rebalance"), uniqueName("rebalance")
	const (
		partitions = 2
		keys       = 40
		perKey     = 5
		hold       = 20 // per partition, offsets from here on are held in phase 1
		maxFlight  = 64
	)
	createTopic(t, brokers, topic, partitions)
	pub := newPublisher(t, brokers)
	for i := range perKey {
		for k := range keys {
			publishKeyed(t, pub, topic, fmt.Sprint("key-", k), fmt.Sprint(k, "/", i))
		}
	}
	ends := partitionEnds(t, brokers, topic, partitions)
	// In phase 1 each key with a message at or past hold has exactly one
	// held, its first there: the key's later messages wait for it.
	expectStuck := int64(0)
	{
		partitioner := kafka.NewKeyPartitioner(topic)
		next := make([]int64, partitions)
		held := map[string]bool{}
		for range perKey {
			for k := range keys {
				key := fmt.Sprint("key-", k)
				p, err := partitioner.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(key)}, partitions)
				require.NoError(t, err)
				if next[p] >= hold && !held[key] {
					held[key] = true
					expectStuck++
				}
				next[p]++
			}
		}
		for p := range partitions {
			require.Equal(t, ends[p], next[p], "partition %d as the partitioner says", p)
		}
	}
	require.Positive(t, expectStuck)
	require.LessOrEqual(t, expectStuck, int64(maxFlight))

	var (
		rebalanced atomic.Bool
		stuck      atomic.Int64
		cancelled  atomic.Int64
		gate       = make(chan struct{})
		mu         sync.Mutex
		acked      = map[[2]int64]int{} // (partition, offset) → acks
		handlers   sync.WaitGroup
	)
	handle := func(msg *message.Message) {
		defer handlers.Done()
		part, err := strconv.ParseInt(msg.Metadata.Get(delivery.Partition), 10, 32)
		if !assert.NoError(t, err) {
			return
		}
		off := offsetOf(t, msg)
		if !rebalanced.Load() {
			if off >= hold {
				stuck.Add(1)
				<-msg.Context().Done()
				cancelled.Add(1)
				msg.Nack()
				return
			}
		} else {
			select {
			case <-gate:
			case <-msg.Context().Done():
				msg.Nack()
				return
			}
		}
		mu.Lock()
		acked[[2]int64{part, off}]++
		mu.Unlock()
		msg.Ack()
	}
	consume := func(sub message.Subscriber) {
		msgs, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		handlers.Add(1)
		go func() {
			defer handlers.Done()
			for msg := range msgs {
				handlers.Add(1)
				go handle(msg)
			}
		}()
	}

	first := parallelSubscriber(t, brokers, group)
	consume(first)
	require.Eventually(t, func() bool {
		if stuck.Load() != expectStuck {
			return false
		}
		for p := range partitions {
			if ends[p] > hold && committedOffset(t, brokers, group, topic, fmt.Sprint(p)) != hold {
				return false
			}
		}
		return true
	}, 30*time.Second, 20*time.Millisecond, "the first member holds %d messages, committed up to them", expectStuck)

	rebalanced.Store(true)
	second := parallelSubscriber(t, brokers, group)
	consume(second)
	require.Eventually(t, func() bool { return cancelled.Load() == expectStuck }, 30*time.Second, 10*time.Millisecond,
		"the rebalance cancels the contexts of the first member's messages in flight")
	// Nothing is acked until the gate opens: the first member committed
	// nothing past its held messages, through several commit intervals.
	for range 5 {
		for p := range partitions {
			if ends[p] > hold {
				require.Equal(t, int64(hold), committedOffset(t, brokers, group, topic, fmt.Sprint(p)),
					"partition %d committed past a message that was never acked", p)
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(gate)

	total := 0
	for _, end := range ends {
		total += int(end)
	}
	require.Equal(t, keys*perKey, total)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(acked) == total
	}, 60*time.Second, 20*time.Millisecond, "every message acked")
	for p := range partitions {
		require.Eventually(t, func() bool { return committedOffset(t, brokers, group, topic, fmt.Sprint(p)) == ends[p] },
			30*time.Second, 20*time.Millisecond, "partition %d committed to its end", p)
	}
	require.NoError(t, first.Close())
	require.NoError(t, second.Close())
	handlers.Wait()

	mu.Lock()
	defer mu.Unlock()
	dups := 0
	for p := range partitions {
		for off := range ends[p] {
			n := acked[[2]int64{int64(p), off}]
			require.Positive(t, n, "partition %d offset %d never acked", p, off)
			if off < hold {
				require.Equal(t, 1, n, "partition %d offset %d was committed before the rebalance, yet delivered again", p, off)
			}
			dups += n - 1
		}
	}
	t.Logf("%d messages, %d held and cancelled by the rebalance, %d acked twice", total, expectStuck, dups)
}

// partitionEnds returns the next offset of each of topic's partitions.
func partitionEnds(t testing.TB, brokers []string, topic string, partitions int) []int64 {
	t.Helper()
	sc := sarama.NewConfig()
	sc.Version = sarama.V2_3_0_0
	client, err := sarama.NewClient(brokers, sc)
	require.NoError(t, err)
	defer func() { require.NoError(t, client.Close()) }()
	ends := make([]int64, partitions)
	for p := range partitions {
		ends[p], err = client.GetOffset(topic, int32(p), sarama.OffsetNewest)
		require.NoError(t, err)
	}
	return ends
}

// TestParallelCloseCommitsAcked: as a router closes (the Subscribe
// context cancelled, then Close), the handlers of the messages in flight,
// whose contexts have ended, still ack or nack, and Close waits for them
// and commits what they acked; a new member resumes at the first message
// not acked.
func TestParallelCloseCommitsAcked(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic, group := uniqueName("close"), uniqueName("close")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	for i := range 4 {
		publishKeyed(t, pub, topic, fmt.Sprint("k", i), fmt.Sprint(i))
	}

	sub := parallelSubscriber(t, brokers, group)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	var got []*message.Message
	for range 4 {
		got = append(got, msgtest.Receive(t, msgs, 30*time.Second))
	}
	// Handlers that finish once their context is cancelled: 0 and 1 ack,
	// 2 and 3 nack.
	var wg sync.WaitGroup
	for _, msg := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-msg.Context().Done()
			if offsetOf(t, msg) < 2 {
				msg.Ack()
			} else {
				msg.Nack()
			}
		}()
	}
	cancel()
	require.NoError(t, sub.Close())
	wg.Wait()
	_, open := <-msgs
	require.False(t, open, "the channel is closed after Close")
	require.Equal(t, int64(2), committedOffset(t, brokers, group, topic, "0"))
}

// TestParallelCloseDrainsLiveContexts: Close leaves the contexts of the
// messages in flight alone while it drains: handlers that ack after Close
// began find their context live and their offsets committed; a handler
// that does not finish has its context cancelled when DrainTimeout has
// passed, and its message is not committed.
func TestParallelCloseDrainsLiveContexts(t *testing.T) {
	t.Parallel()
	brokers := Brokers(t)
	topic, group := uniqueName("drain"), uniqueName("drain")
	createTopic(t, brokers, topic, 1)
	pub := newPublisher(t, brokers)
	for i := range 4 {
		publishKeyed(t, pub, topic, fmt.Sprint("k", i), fmt.Sprint(i))
	}

	sub := newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) {
		c.MaxInFlightPerPartition = 64
		c.CommitInterval = 50 * time.Millisecond
		c.DrainTimeout = 2 * time.Second
	})
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	var got []*message.Message
	for range 4 {
		got = append(got, msgtest.Receive(t, msgs, 30*time.Second))
	}
	closing := make(chan struct{})
	live := make([]error, len(got))
	var wg sync.WaitGroup
	for i, msg := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if offsetOf(t, msg) == 3 {
				// Slower than the drain: it ends with its context.
				<-msg.Context().Done()
				msg.Nack()
				return
			}
			<-closing
			// Give Close time to begin its drain: the handler acks while
			// Close waits.
			time.Sleep(100 * time.Millisecond)
			live[i] = msg.Context().Err()
			msg.Ack()
		}()
	}
	close(closing)
	require.NoError(t, sub.Close())
	wg.Wait()
	for i, err := range live {
		if offsetOf(t, got[i]) != 3 {
			require.NoError(t, err, "message %d's context during the drain", offsetOf(t, got[i]))
		}
	}
	require.Equal(t, int64(3), committedOffset(t, brokers, group, topic, "0"), "committed up to the slow message")
}

// TestParallelMaxInFlight: with MaxInFlight, the messages in flight
// across all the partitions of a subscription never exceed it, however
// many each partition may have, and every message is still delivered and
// acked.
func TestParallelMaxInFlight(t *testing.T) {
	t.Parallel()
	const (
		partitions = 4
		messages   = 120
		limit      = 5
	)
	brokers := Brokers(t)
	topic, group := uniqueName("total"), uniqueName("total")
	createTopic(t, brokers, topic, partitions)
	pub := newPublisher(t, brokers)
	for i := range messages {
		publishKeyed(t, pub, topic, fmt.Sprint("key-", i), fmt.Sprint(i))
	}
	sub := newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) {
		c.MaxInFlightPerPartition = 64
		c.MaxInFlight = limit
	})
	defer func() { require.NoError(t, sub.Close()) }()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	var (
		held, peak atomic.Int64
		wg         sync.WaitGroup
		mu         sync.Mutex
		seen       = map[string]bool{}
	)
	deadline := time.After(time.Minute)
	for len(seen) < messages {
		select {
		case msg := <-msgs:
			n := held.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			mu.Lock()
			seen[string(msg.Payload)] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(20 * time.Millisecond) // a handler that takes a while
				held.Add(-1)
				msg.Ack()
			}()
		case <-deadline:
			t.Fatalf("received %d of %d messages", len(seen), messages)
		}
	}
	wg.Wait()
	require.Len(t, seen, messages, "every message delivered")
	require.LessOrEqual(t, peak.Load(), int64(limit), "never more than MaxInFlight handlers at once across %d partitions", partitions)
	require.Equal(t, int64(limit), peak.Load(), "the limit is used, not just respected")
}
