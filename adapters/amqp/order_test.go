package amqp_test

import (
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/middleware"
)

// requireSettled checks that the queue of topic has nothing left: every
// message was acked, none returned to the queue.
func requireSettled(t *testing.T, a *admin, cfg amqp.Config, topic string) {
	t.Helper()
	ready, _ := a.inspect(cfg.QueueName(topic))
	require.Zero(t, ready, "every message acked")
}

// TestKeyOrderConcurrent: 20 keys of 5 messages each, published
// interleaved, consumed with Prefetch 16 by a handler that sleeps a
// little: each key's messages are handled once each, in the order
// published, never two of a key at once, and messages of different keys
// are handled at once, up to Prefetch.
func TestKeyOrderConcurrent(t *testing.T) {
	const keys, perKey, prefetch = 20, 5, 16
	a := newAdmin(t)
	cfg := testConfig()
	cfg.Prefetch = prefetch
	topic := uniqueName("orders")
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	brokertest.PublishKeyed(t, newPublisher(t, cfg), topic, keys, perKey)

	run := brokertest.ConsumeKeyed(t, sub, topic, testLogger(), keys, perKey, prefetch)
	requireSettled(t, a, cfg, topic)
	for key, got := range run.Order {
		require.Equal(t, brokertest.InOrder(perKey), got, "key %s in the order published", key)
	}
	t.Logf("%d keys × %d messages: at most %d handled at once (Prefetch %d)", keys, perKey, run.MaxRunning, prefetch)
}

// TestBatchHandlerBatches: 300 messages of distinct keys, consumed with
// Prefetch 64 through the PostgreSQL inbox in batch mode (32 a batch)
// around a middleware.BatchHandler that inserts a batch's effects with
// one statement: each message is applied once, in batches of 8 messages
// or more on average.
func TestBatchHandlerBatches(t *testing.T) {
	const messages, prefetch = 300, 64
	a := newAdmin(t)
	cfg := testConfig()
	cfg.Prefetch = prefetch
	topic := uniqueName("ledger")
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	brokertest.PublishKeyed(t, newPublisher(t, cfg), topic, messages, 1)

	// A batch that starts while the next receive is under way (a loaded
	// machine) waits 100 ms for it: the mean measures the hand-out, not
	// the scheduler.
	sizes := brokertest.ConsumeBatches(t, sub, topic, testLogger(), messages, 1,
		middleware.BatchConfig{MaxMessages: 32, Parallel: 2, Linger: 100 * time.Millisecond})
	requireSettled(t, a, cfg, topic)
	mean := float64(messages) / float64(len(sizes))
	require.GreaterOrEqual(t, mean, 8.0, "mean batch")
	t.Logf("%d messages in %d calls (mean %.1f), largest batch %d (Prefetch %d)", messages, len(sizes), mean, slices.Max(sizes), prefetch)
}
