package kafka_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka"
	"github.com/oncemill/oncemill/dedup/sqlite"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestHandOutMarks: with a store of hand-out marks (an inbox store's),
// every offset goes out only once the durable mark covers it; a
// partition's first hand-outs carry delivery.Attempts 1, a nacked message
// handed out again is marked delivery.Redelivered, and after its owner
// went away without acking, the next owner hands out the offsets under
// the mark as redeliveries and those above it as first deliveries.
func TestHandOutMarks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	brokers := Brokers(t)
	topic, group := uniqueName("marks"), uniqueName("marks")
	createTopic(t, brokers, topic, 1)
	store, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "inbox.db"), sqlite.Config{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, store.Close()) })
	pub := newPublisher(t, brokers)
	const first, later = 10, 5
	for i := range first {
		publishKeyed(t, pub, topic, fmt.Sprint("k", i), fmt.Sprint(i))
	}
	subscribe := func() (func() error, <-chan *message.Message) {
		sub := newSubscriber(t, brokers, group, func(c *kafka.SubscriberConfig) {
			c.MaxInFlightPerPartition = 64
			c.CommitInterval = 20 * time.Millisecond
			c.DrainTimeout = 200 * time.Millisecond
			c.NackResendSleep = kafka.NoSleep
			c.HandOutMarks = store
		})
		msgs, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		return sub.Close, msgs
	}
	markNow := func() int64 {
		m, err := store.InboxHandOutMark(ctx, group, topic, 0)
		require.NoError(t, err)
		return m
	}

	closeA, msgs := subscribe()
	var (
		handed = map[int64]bool{}
		nacked = int64(-1)
		resent bool
	)
	for len(handed) < first || !resent {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		off := offsetOf(t, msg)
		if handed[off] {
			require.Equal(t, nacked, off, "only the nacked message is handed out again")
			require.Equal(t, "true", msg.Metadata.Get(delivery.Redelivered), "a nacked message handed out again")
			require.Empty(t, msg.Metadata.Get(delivery.Attempts))
			resent = true
			continue // held unacked
		}
		handed[off] = true
		require.GreaterOrEqual(t, markNow(), off, "offset %d went out under a durable mark", off)
		require.Equal(t, "1", msg.Metadata.Get(delivery.Attempts), "offset %d: a first hand-out", off)
		require.Empty(t, msg.Metadata.Get(delivery.Redelivered))
		switch {
		case off < first/2:
			msg.Ack()
		case nacked < 0:
			nacked = off
			msg.Nack()
		}
		// The rest is held unacked, as by a process that dies in them.
	}
	require.Equal(t, int64(first-1), markNow(), "one mark covered the batch received")
	require.NoError(t, closeA())

	for i := range later {
		publishKeyed(t, pub, topic, fmt.Sprint("n", i), fmt.Sprint(first+i))
	}
	closeB, msgs := subscribe()
	defer func() { require.NoError(t, closeB()) }()
	seen := map[int64]bool{}
	for len(seen) < first/2+later {
		msg := msgtest.Receive(t, msgs, 30*time.Second)
		off := offsetOf(t, msg)
		require.GreaterOrEqual(t, off, int64(first/2), "the acked offsets were committed")
		if off < first {
			require.Equal(t, "true", msg.Metadata.Get(delivery.Redelivered), "offset %d under the mark: maybe handed out before", off)
			require.Empty(t, msg.Metadata.Get(delivery.Attempts))
		} else {
			require.Equal(t, "1", msg.Metadata.Get(delivery.Attempts), "offset %d above the mark: a first hand-out", off)
			require.Empty(t, msg.Metadata.Get(delivery.Redelivered))
			require.GreaterOrEqual(t, markNow(), off)
		}
		seen[off] = true
		msg.Ack()
	}
	require.Equal(t, int64(first+later-1), markNow())
}
