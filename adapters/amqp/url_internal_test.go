package amqp

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/internal/brokerurl"
)

func mustParse(t *testing.T, raw string) *url.URL {
	u, err := url.Parse(raw)
	require.NoError(t, err, raw)
	return u
}

// TestAMQPURLParameters checks that this package's parameters leave the
// URL, amqp091's stay in it, and connect_timeout becomes its
// connection_timeout.
func TestAMQPURLParameters(t *testing.T) {
	cfg, err := urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/vh?group=billing&prefetch=4&delivery_limit=5&dead_letter_exchange=dlx&connect_timeout=2s&heartbeat=5"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, "billing", cfg.ConsumerGroup)
	require.Equal(t, 4, cfg.Prefetch)
	require.Equal(t, 5, cfg.DeliveryLimit)
	require.Equal(t, "dlx", cfg.DeadLetterExchange)
	require.Equal(t, 2*time.Second, cfg.ConnectTimeout)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5", cfg.URL)
	w, err := cfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5&connection_timeout=2000", w.Connection.AmqpURI)

	cfg, err = urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, brokerurl.DefaultConnectTimeout, cfg.ConnectTimeout)
	require.False(t, cfg.SingleActiveConsumer)
	require.NotContains(t, cfg.QueueArguments(), "x-single-active-consumer")
}

// TestAMQPURLSingleActiveConsumer: single_active_consumer=true declares
// the queue with x-single-active-consumer and does not reach amqp091; a
// value that is not a boolean is refused, naming the parameter.
func TestAMQPURLSingleActiveConsumer(t *testing.T) {
	cfg, err := urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/?single_active_consumer=true&heartbeat=5"), brokerurl.Options{})
	require.NoError(t, err)
	require.True(t, cfg.SingleActiveConsumer)
	require.Equal(t, true, cfg.QueueArguments()["x-single-active-consumer"])
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/?heartbeat=5", cfg.URL)
	_, err = urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/?single_active_consumer=yes-please"), brokerurl.Options{})
	require.ErrorIs(t, err, brokerurl.ErrBadURL)
	require.ErrorContains(t, err, "single_active_consumer")
}

// TestAMQPURLDrainTimeout: drain_timeout reaches the subscriber's
// DrainTimeout and not amqp091; absent, the subscriber's default applies.
func TestAMQPURLDrainTimeout(t *testing.T) {
	cfg, err := urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/?drain_timeout=1500ms&heartbeat=5"), brokerurl.Options{})
	require.NoError(t, err)
	require.Equal(t, 1500*time.Millisecond, cfg.DrainTimeout)
	require.Equal(t, "amqp://guest:guest@127.0.0.1:5672/?heartbeat=5", cfg.URL, "drain_timeout does not reach amqp091")
	cfg, err = urlConfig(mustParse(t, "amqp://guest:guest@127.0.0.1:5672/"), brokerurl.Options{})
	require.NoError(t, err)
	require.Zero(t, cfg.DrainTimeout, "the subscriber's default")
}
