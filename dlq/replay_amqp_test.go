package dlq_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// rabbitURL returns the RabbitMQ the tests use, or skips the test (fails it
// under CI) when it is unreachable. The connection it checks with stays
// open until the test ends, for inspection and cleanup.
func rabbitURL(t *testing.T) (string, *amqp091.Connection) {
	t.Helper()
	u := os.Getenv("ONCEMILL_AMQP_URL")
	if u == "" {
		u = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp091.DialConfig(u, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		pgtest.Unavailable(t, "RabbitMQ", err)
	}
	t.Cleanup(func() { require.NoError(t, conn.Close()) })
	return u, conn
}

// TestReplayToUnboundRabbitMQTopic replays an entry to a RabbitMQ topic
// that no queue is bound to: the broker confirms such a message although it
// drops it, so without the mandatory flag the entry would be deleted and
// the message lost. The publisher reports it unroutable instead: Replay
// returns the error and keeps the entry. Once a queue is bound, the same
// entry replays.
func TestReplayToUnboundRabbitMQTopic(t *testing.T) {
	t.Parallel()
	e := setup(t)
	url, admin := rabbitURL(t)
	var b [6]byte
	_, _ = rand.Read(b[:])
	topic := "oncemill-test-dlq-unbound-" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		ch, err := admin.Channel()
		require.NoError(t, err)
		_, _ = ch.QueueDelete(topic, false, false, false)
		require.NoError(t, ch.ExchangeDelete(topic, false, false))
		require.NoError(t, ch.Close())
	})

	cfg := amqp.Config{URL: url}
	pub, err := amqp.NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pub.Close()) })
	ids := e.seed(t, dead(topic, "charge", "boom"))

	n, err := e.store.Replay(context.Background(), pub, dlq.Filter{IDs: ids}, nil)
	require.ErrorIs(t, err, amqp.ErrUnroutable)
	require.Contains(t, err.Error(), topic)
	require.Zero(t, n)
	require.Equal(t, ids, e.ids(t), "the entry stays")

	require.NoError(t, amqp.Declare(context.Background(), cfg, topic))
	n, err = e.store.Replay(context.Background(), pub, dlq.Filter{IDs: ids}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Empty(t, e.ids(t))
	ch, err := admin.Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclarePassive(topic, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	require.NoError(t, err)
	require.Equal(t, 1, q.Messages, "the replayed message is in the queue")
	require.NoError(t, ch.Close())
}
