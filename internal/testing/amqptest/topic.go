package amqptest

import (
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// Topic declares, on the shared node ([URL]), a topic of the test's own
// (prefix and a random suffix) with group's queue, and deletes both when
// the test ends. It returns the topic, the adapter's config for group,
// and an admin connection, closed at the end, for looking at the queue.
func Topic(t testing.TB, prefix, group string) (string, amqp.Config, *amqp091.Connection) {
	t.Helper()
	admin, err := amqp091.DialConfig(URL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	topic := prefix + hex.EncodeToString(suffix[:])
	cfg := amqp.Config{URL: URL(), ConsumerGroup: group}
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDelete(cfg.QueueName(topic), false, false, false)
		require.NoError(t, err)
		require.NoError(t, ch.ExchangeDelete(cfg.ExchangeName(topic), false, false))
		require.NoError(t, ch.Close())
		require.NoError(t, admin.Close())
	})
	require.NoError(t, amqp.Declare(t.Context(), cfg, topic))
	return topic, cfg, admin
}
