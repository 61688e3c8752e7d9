package main

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
)

// TestShowSaysWhoCountedAndWhere: "dlq show" and "dlq list" label a dead
// letter's attempt count with what it counts and who counted it, and show
// only the broker facts the entry has: nothing Kafka's on a RabbitMQ
// entry, Kafka's partition and offset on a Kafka one. The entries are
// written by the poison middleware from deliveries as the adapters
// describe them.
func TestShowSaysWhoCountedAndWhere(t *testing.T) {
	t.Parallel()
	f := setup(t)
	const maxAttempts = 5
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: f.pub, MaxAttempts: maxAttempts, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond,
	})
	require.NoError(t, err)
	fail := poison.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("ledger rejects it")
	})
	deliver := func(facts map[string]string) int64 {
		t.Helper()
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		m.Metadata.Set(delivery.IdempotencyKey, "key-"+m.UUID)
		for k, v := range facts {
			m.Metadata.Set(k, v)
		}
		// Redelivered until the poison middleware gives up, as a broker
		// redelivers a nacked message.
		for i := 1; ; i++ {
			if _, err := fail(m); err == nil {
				break
			}
			require.Less(t, i, maxAttempts, "dead-lettered by attempt %d", maxAttempts)
		}
		ids := f.ids(t)
		return ids[len(ids)-1]
	}
	// RabbitMQ's quorum queue has delivered it 36 times (the adapter's
	// delivery.Attempts is x-delivery-count + 1).
	const deliveries = 36
	rabbit := deliver(map[string]string{delivery.Topic: "orders", delivery.Attempts: strconv.Itoa(deliveries), delivery.Redelivered: "true"})
	// Kafka keeps no count: without an inbox, the consumer counts in memory.
	kafka := deliver(map[string]string{delivery.Topic: "orders", delivery.Partition: "3", delivery.Offset: "1234"})

	r := f.dlq(t, "show", strconv.FormatInt(rabbit, 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Regexp(t, `(?m)^Broker deliveries: +`+strconv.Itoa(deliveries)+` \(the broker's count, not failures: RabbitMQ x-delivery-count or SQS ApproximateReceiveCount\)$`, r.stdout)
	require.NotContains(t, r.stdout, "Kafka")
	require.NotContains(t, r.stdout, "JetStream")
	require.NotRegexp(t, `(?m)^Attempts:`, r.stdout)

	r = f.dlq(t, "show", strconv.FormatInt(kafka, 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Regexp(t, `(?m)^Failed attempts: +`+strconv.Itoa(maxAttempts)+` \(counted in the consumer's memory since it started\)$`, r.stdout)
	require.Regexp(t, `(?m)^Kafka partition: +3$`, r.stdout)
	require.Regexp(t, `(?m)^Kafka offset: +1234$`, r.stdout)
	require.NotContains(t, r.stdout, "Broker deliveries")

	r = f.dlq(t, "list")
	require.Equal(t, exitOK, r.code, r.stderr)
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	require.Len(t, lines, 3)
	col := strings.Index(lines[0], "COUNTED BY")
	require.Positive(t, col)
	require.True(t, strings.HasPrefix(lines[1][col:], delivery.AttemptsFromBroker+" "), lines[1])
	require.True(t, strings.HasPrefix(lines[2][col:], delivery.AttemptsFromProcess+" "), lines[2])
}
