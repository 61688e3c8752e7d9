package nats_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/middleware"
)

// requireSettled waits until the group's consumer of topic has nothing
// pending and nothing unacked.
func requireSettled(t *testing.T, a *admin, cfg nats.SubscriberConfig, topic string) {
	t.Helper()
	stream, consumer := cfg.StreamName(topic), cfg.ConsumerName(topic)
	require.Eventually(t, func() bool {
		info := a.consumer(stream, consumer)
		return info.NumPending == 0 && info.NumAckPending == 0
	}, 20*time.Second, 50*time.Millisecond, "every message acked")
}

// TestKeyOrderConcurrent: 20 keys of 5 messages each, published
// interleaved, consumed with MaxInFlight 16 by a handler that sleeps a
// little: each key's messages are handled once each, in the order
// published, never two of a key at once, and messages of different keys
// are handled at once, up to MaxInFlight.
func TestKeyOrderConcurrent(t *testing.T) {
	const keys, perKey, maxInFlight = 20, 5, 16
	a := newAdmin(t)
	cfg := a.config()
	topic := a.topic(".orders")
	scfg := nats.SubscriberConfig{Config: cfg, ConsumerGroup: "billing", MaxInFlight: maxInFlight}
	sub := subscriber(t, scfg)
	require.NoError(t, sub.SubscribeInitialize(topic))
	brokertest.PublishKeyed(t, publisher(t, cfg), topic, keys, perKey)

	run := brokertest.ConsumeKeyed(t, sub, topic, testLogger(), keys, perKey, maxInFlight)
	requireSettled(t, a, scfg, topic)
	for key, got := range run.Order {
		require.Equal(t, brokertest.InOrder(perKey), got, "key %s in the order published", key)
	}
	t.Logf("%d keys × %d messages: at most %d handled at once (MaxInFlight %d)", keys, perKey, run.MaxRunning, maxInFlight)
}

// TestBatchHandlerBatches: eight accounts, versions 1 to 25 of each,
// consumed with MaxInFlight 32 through the PostgreSQL inbox in batch mode
// (16 a batch) around a middleware.BatchHandler that inserts a batch's
// effects with one statement: batches hold more than one message, so
// fewer calls than messages, and each account's versions are applied
// once each, in the order published.
func TestBatchHandlerBatches(t *testing.T) {
	const accounts, versions, maxInFlight = 8, 25, 32
	a := newAdmin(t)
	cfg := a.config()
	topic := a.topic(".ledger")
	scfg := nats.SubscriberConfig{Config: cfg, ConsumerGroup: "ledger", MaxInFlight: maxInFlight}
	sub := subscriber(t, scfg)
	require.NoError(t, sub.SubscribeInitialize(topic))
	brokertest.PublishKeyed(t, publisher(t, cfg), topic, accounts, versions)

	sizes := brokertest.ConsumeBatches(t, sub, topic, testLogger(), accounts, versions,
		middleware.BatchConfig{MaxMessages: 16, Parallel: 2, Linger: 5 * time.Millisecond})
	requireSettled(t, a, scfg, topic)
	t.Logf("%d messages in %d calls, largest batch %d (MaxInFlight %d)", accounts*versions, len(sizes), slices.Max(sizes), maxInFlight)
}

// TestBatchHandlerBatchesDistinctKeys: 300 messages of distinct keys,
// consumed with MaxInFlight 64 through the inbox in batch mode (32 a
// batch): each is applied once, in batches of 8 messages or more on
// average.
func TestBatchHandlerBatchesDistinctKeys(t *testing.T) {
	const messages, maxInFlight = 300, 64
	a := newAdmin(t)
	cfg := a.config()
	topic := a.topic(".keys")
	scfg := nats.SubscriberConfig{Config: cfg, ConsumerGroup: "ledger", MaxInFlight: maxInFlight}
	sub := subscriber(t, scfg)
	require.NoError(t, sub.SubscribeInitialize(topic))
	brokertest.PublishKeyed(t, publisher(t, cfg), topic, messages, 1)

	// A batch that starts while the next receive is under way (a loaded
	// machine) waits 100 ms for it: the mean measures the hand-out, not
	// the scheduler.
	sizes := brokertest.ConsumeBatches(t, sub, topic, testLogger(), messages, 1,
		middleware.BatchConfig{MaxMessages: 32, Parallel: 2, Linger: 100 * time.Millisecond})
	requireSettled(t, a, scfg, topic)
	mean := float64(messages) / float64(len(sizes))
	require.GreaterOrEqual(t, mean, 8.0, "mean batch")
	t.Logf("%d messages in %d calls (mean %.1f), largest batch %d (MaxInFlight %d)", messages, len(sizes), mean, slices.Max(sizes), maxInFlight)
}
