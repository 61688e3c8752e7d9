package sqs_test

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/middleware"
)

// requireEmpty waits until queue holds no message, visible or in flight:
// every message was acked and deleted.
func requireEmpty(t *testing.T, a *admin, queue string) {
	t.Helper()
	require.Eventually(t, func() bool {
		visible, inFlight := a.counts(queue)
		return visible == 0 && inFlight == 0
	}, 20*time.Second, 50*time.Millisecond, "every message deleted")
}

// consumeKeyed publishes keys × perKey messages to topic and consumes
// them with MaxNumberOfMessages 10 (see brokertest.ConsumeKeyed); it
// returns what the handler observed, once the queue is empty.
func consumeKeyed(t *testing.T, a *admin, topic string, keys, perKey int) brokertest.KeyedRun {
	t.Helper()
	brokertest.PublishKeyed(t, newPublisher(t, sqs.PublisherConfig{Config: testConfig()}), topic, keys, perKey)
	cfg := testSubscriberConfig()
	cfg.MaxNumberOfMessages = 10
	run := brokertest.ConsumeKeyed(t, newSubscriber(t, cfg), topic, testLogger(), keys, perKey, cfg.MaxNumberOfMessages)
	requireEmpty(t, a, sqs.DefaultQueueName(topic))
	return run
}

// TestKeyOrderConcurrentFIFO: 20 message groups of 5 messages each,
// published interleaved to a FIFO queue: each group's messages are
// handled once each, in the order published, never two of a group at
// once, and messages of different groups at once, up to
// MaxNumberOfMessages.
func TestKeyOrderConcurrentFIFO(t *testing.T) {
	t.Parallel()
	const keys, perKey = 20, 5
	a := newAdmin(t)
	topic := uniqueName("keyed") + ".fifo"
	a.trackTopic(topic)
	run := consumeKeyed(t, a, topic, keys, perKey)
	for key, got := range run.Order {
		require.Equal(t, brokertest.InOrder(perKey), got, "group %s in the order published", key)
	}
	t.Logf("FIFO, %d groups × %d messages: at most %d handled at once", keys, perKey, run.MaxRunning)
}

// TestKeyOrderConcurrentStandard: the same on a standard queue, whose
// messages SQS returns in no promised order: each key's messages are
// handled once each, never two of a key at once, and messages of
// different keys at once.
func TestKeyOrderConcurrentStandard(t *testing.T) {
	t.Parallel()
	const keys, perKey = 20, 5
	a := newAdmin(t)
	topic := uniqueName("keyed")
	a.trackTopic(topic)
	run := consumeKeyed(t, a, topic, keys, perKey)
	for key, got := range run.Order {
		require.ElementsMatch(t, brokertest.InOrder(perKey), got, "key %s: each version once", key)
	}
	t.Logf("standard, %d keys × %d messages: at most %d handled at once", keys, perKey, run.MaxRunning)
}

// TestBatchHandlerBatches: eight accounts, versions 1 to 25 of each, on a
// FIFO queue (the account the message group), consumed through the
// PostgreSQL inbox in batch mode (16 a batch) around a
// middleware.BatchHandler that inserts a batch's effects with one
// statement: batches hold more than one message, so fewer calls than
// messages, and each account's versions are applied once each, in the
// order published.
func TestBatchHandlerBatches(t *testing.T) {
	t.Parallel()
	const accounts, versions = 8, 25
	a := newAdmin(t)
	topic := uniqueName("ledger") + ".fifo"
	a.trackTopic(topic)
	brokertest.PublishKeyed(t, newPublisher(t, sqs.PublisherConfig{Config: testConfig()}), topic, accounts, versions)
	cfg := testSubscriberConfig()
	cfg.MaxNumberOfMessages = 10
	sizes := brokertest.ConsumeBatches(t, newSubscriber(t, cfg), topic, testLogger(), accounts, versions,
		middleware.BatchConfig{MaxMessages: 16, Parallel: 2, Linger: 5 * time.Millisecond})
	requireEmpty(t, a, sqs.DefaultQueueName(topic))
	t.Logf("%d messages in %d calls, largest batch %d", accounts*versions, len(sizes), slices.Max(sizes))
}

// TestBatchHandlerBatchesBeyondOneReceive: 300 messages of distinct keys
// on a standard queue, consumed with MaxInFlight 64 (receives of 10)
// through the inbox in batch mode (32 a batch): the subscription holds
// more than one receive's worth, so batches average at least 8 messages.
func TestBatchHandlerBatchesBeyondOneReceive(t *testing.T) {
	t.Parallel()
	const messages = 300
	a := newAdmin(t)
	topic := uniqueName("ledger")
	a.trackTopic(topic)
	brokertest.PublishKeyed(t, newPublisher(t, sqs.PublisherConfig{Config: testConfig()}), topic, messages, 1)
	cfg := testSubscriberConfig()
	cfg.MaxInFlight = 64
	// A batch that starts while the next receive is under way (a loaded
	// machine) waits 100 ms for it: the mean measures the hand-out, not
	// the scheduler.
	sizes := brokertest.ConsumeBatches(t, newSubscriber(t, cfg), topic, testLogger(), messages, 1,
		middleware.BatchConfig{MaxMessages: 32, Parallel: 2, Linger: 100 * time.Millisecond})
	requireEmpty(t, a, sqs.DefaultQueueName(topic))
	mean := float64(messages) / float64(len(sizes))
	require.GreaterOrEqual(t, mean, 8.0, "mean batch")
	require.Greater(t, slices.Max(sizes), 10, "a batch holds more than one receive's 10")
	t.Logf("%d messages in %d calls (mean %.1f), largest batch %d (MaxInFlight %d)", messages, len(sizes), mean, slices.Max(sizes), cfg.MaxInFlight)
}
