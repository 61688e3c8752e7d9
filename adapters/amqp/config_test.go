package amqp_test

import (
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
)

func TestConfigValidate(t *testing.T) {
	const u = "amqp://user:s3cret@127.0.0.1:5672/"
	for name, tc := range map[string]struct {
		cfg   amqp.Config
		field string
	}{
		"empty URL":         {amqp.Config{}, "URL is empty"},
		"bad scheme":        {amqp.Config{URL: "http://user:s3cret@host/"}, "URL"},
		"bad port":          {amqp.Config{URL: "amqp://user:s3cret@host:port/"}, "URL"},
		"bad escape":        {amqp.Config{URL: "amqp://user:s3cret%zz@host/"}, "URL"},
		"negative prefetch": {amqp.Config{URL: u, Prefetch: -1}, "Prefetch"},
		"prefetch too big":  {amqp.Config{URL: u, Prefetch: 65536}, "Prefetch"},
		"delivery limit":    {amqp.Config{URL: u, DeliveryLimit: -2}, "DeliveryLimit"},
		"dlx routing key":   {amqp.Config{URL: u, DeadLetterRoutingKey: "rk"}, "DeadLetterRoutingKey"},
		"publish channels":  {amqp.Config{URL: u, PublishChannels: -1}, "PublishChannels"},
		"long group":        {amqp.Config{URL: u, ConsumerGroup: string(make([]byte, 256))}, "ConsumerGroup"},
		"connect timeout":   {amqp.Config{URL: u, ConnectTimeout: -time.Second}, "ConnectTimeout"},
		"connect timeout twice": {
			amqp.Config{URL: u + "?connection_timeout=500", ConnectTimeout: time.Second}, "ConnectTimeout is set and the URL has connection_timeout",
		},
	} {
		t.Run(name, func(t *testing.T) {
			err := tc.cfg.Validate()
			require.ErrorIs(t, err, amqp.ErrInvalidConfig)
			require.Contains(t, err.Error(), tc.field)
			require.NotContains(t, err.Error(), "s3cret")
			t.Log(err)

			_, err = amqp.NewSubscriber(tc.cfg, nil)
			require.ErrorIs(t, err, amqp.ErrInvalidConfig)
			_, err = amqp.NewPublisher(tc.cfg, nil)
			require.ErrorIs(t, err, amqp.ErrInvalidConfig)
		})
	}

	valid := amqp.Config{URL: u, DeliveryLimit: -1, DeadLetterExchange: "dlx", DeadLetterRoutingKey: "rk"}
	require.NoError(t, valid.Validate())
	require.NoError(t, amqp.Config{URL: "amqps://h/vhost"}.Validate())
}

// TestConnectTimeoutInURI checks that the connect timeout reaches amqp091
// as the connection_timeout of the URI, the rest of the URL as written.
func TestConnectTimeoutInURI(t *testing.T) {
	for _, tc := range []struct {
		cfg  amqp.Config
		want string
	}{
		{amqp.Config{URL: "amqp://guest:p%40ss@127.0.0.1:5672/"}, "amqp://guest:p%40ss@127.0.0.1:5672/?connection_timeout=10000"},
		{amqp.Config{URL: "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5", ConnectTimeout: 1500 * time.Millisecond}, "amqp://guest:guest@127.0.0.1:5672/vh?heartbeat=5&connection_timeout=1500"},
		{amqp.Config{URL: "amqps://h/vh?", ConnectTimeout: time.Second}, "amqps://h/vh?connection_timeout=1000"},
		{amqp.Config{URL: "amqp://h/?connection_timeout=500"}, "amqp://h/?connection_timeout=500"},
	} {
		w, err := tc.cfg.WatermillConfig()
		require.NoError(t, err, tc.cfg.URL)
		require.Equal(t, tc.want, w.Connection.AmqpURI)
		uri, err := amqp091.ParseURI(w.Connection.AmqpURI)
		require.NoError(t, err)
		require.Positive(t, uri.ConnectionTimeout)
	}
}

// TestValidateKeepsPasswordText checks that hiding a password of one
// common letter hides the user info only: the rest of the message stays
// readable.
func TestValidateKeepsPasswordText(t *testing.T) {
	err := amqp.Config{URL: "http://user:e@host/vhost"}.Validate()
	require.ErrorIs(t, err, amqp.ErrInvalidConfig)
	require.NotContains(t, err.Error(), "user:e@")
	require.Contains(t, err.Error(), "amqp: invalid config: URL http://user:xxxxx@host/vhost is not an AMQP URL: AMQP scheme must be either 'amqp://' or 'amqps://'")
}

func TestWatermillConfig(t *testing.T) {
	cfg := amqp.Config{URL: "amqp://guest:guest@127.0.0.1:5672/", ConsumerGroup: "billing"}
	before := cfg
	w, err := cfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, before, cfg, "the caller's Config is not modified")

	require.Equal(t, "orders", w.Exchange.GenerateName("orders"))
	require.Equal(t, amqp091.ExchangeFanout, w.Exchange.Type)
	require.True(t, w.Exchange.Durable)
	require.Equal(t, "orders.billing", w.Queue.GenerateName("orders"))
	require.True(t, w.Queue.Durable)
	require.False(t, w.Queue.AutoDelete)
	require.False(t, w.Queue.Exclusive)
	require.Equal(t, amqp091.Table{"x-queue-type": "quorum"}, w.Queue.Arguments)
	require.Equal(t, "", w.QueueBind.GenerateRoutingKey("orders"))
	require.Equal(t, "", w.Publish.GenerateRoutingKey("orders"))
	require.True(t, w.Publish.ConfirmDelivery)
	require.Equal(t, amqp.DefaultPublishChannels, w.Publish.ChannelPoolSize)
	require.False(t, w.Publish.Transactional)
	require.Equal(t, wamqp.QosConfig{PrefetchCount: amqp.DefaultPrefetch}, w.Consume.Qos)
	require.False(t, w.Consume.NoRequeueOnNack)
	require.IsType(t, amqp.Marshaler{}, w.Marshaler)
	require.NoError(t, w.ValidateSubscriber())
	require.NoError(t, w.ValidatePublisher())

	cfg.ConsumerGroup = ""
	cfg.DeliveryLimit = 5
	cfg.DeadLetterExchange = "orders.dlq"
	cfg.DeadLetterRoutingKey = "dead"
	cfg.NoRequeueOnNack = true
	cfg.Prefetch = 3
	w, err = cfg.WatermillConfig()
	require.NoError(t, err)
	require.Equal(t, "orders", w.Queue.GenerateName("orders"))
	require.Equal(t, amqp091.Table{
		"x-queue-type":              "quorum",
		"x-delivery-limit":          int64(5),
		"x-dead-letter-exchange":    "orders.dlq",
		"x-dead-letter-routing-key": "dead",
	}, w.Queue.Arguments)
	require.True(t, w.Consume.NoRequeueOnNack)
	require.Equal(t, 3, w.Consume.Qos.PrefetchCount)
}
