package nats_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
)

func TestConfigValidate(t *testing.T) {
	valid := nats.Config{URL: "nats://127.0.0.1:4222"}
	require.NoError(t, valid.Validate())
	require.NoError(t, nats.Config{URL: "nats://a:4222, nats://b:4222"}.Validate())
	for want, cfg := range map[string]nats.Config{
		"URL is required":                        {},
		`URL has "nats://xxxxx@:4222"`:           {URL: "nats://user:hunter2@:4222"},
		`Stream "orders.all"`:                    {URL: valid.URL, Stream: "orders.all"},
		"cannot be combined with Stream":         {URL: valid.URL, Stream: "ORDERS", CreateStreams: true},
		"DuplicateWindow must be > 0":            {URL: valid.URL, DuplicateWindow: -time.Second},
		"Replicas must be between 1 and 5":       {URL: valid.URL, Replicas: 6},
		"ConnectTimeout must be > 0, or 0 for t": {URL: valid.URL, ConnectTimeout: -time.Second},
	} {
		err := cfg.Validate()
		require.ErrorIs(t, err, nats.ErrInvalidConfig, want)
		require.ErrorContains(t, err, want)
		require.NotContains(t, err.Error(), "hunter2")
	}
}

func TestPublisherConfigValidate(t *testing.T) {
	cfg := nats.PublisherConfig{Config: nats.Config{URL: "nats://127.0.0.1:4222"}}
	require.NoError(t, cfg.Validate())
	cfg.PublishTimeout = -time.Second
	require.ErrorIs(t, cfg.Validate(), nats.ErrInvalidConfig)
	require.ErrorContains(t, cfg.Validate(), "PublishTimeout")
	cfg.URL = ""
	require.ErrorContains(t, cfg.Validate(), "URL is required")
	_, err := nats.NewPublisher(context.Background(), cfg)
	require.ErrorIs(t, err, nats.ErrInvalidConfig)
}

func TestSubscriberConfigValidate(t *testing.T) {
	base := nats.Config{URL: "nats://127.0.0.1:4222"}
	require.NoError(t, nats.SubscriberConfig{Config: base, ConsumerGroup: "billing"}.Validate())
	require.NoError(t, nats.SubscriberConfig{Config: base, ConsumerGroup: "billing",
		BackOff: []time.Duration{time.Second, time.Minute}}.Validate(), "AckWait defaults to BackOff[0]")
	for want, cfg := range map[string]nats.SubscriberConfig{
		"ConsumerGroup is required":               {Config: base},
		"AckWait must be at least 1s, got 10ms":   {Config: base, ConsumerGroup: "g", AckWait: 10 * time.Millisecond},
		"BackOff[1] must be at least 1s":          {Config: base, ConsumerGroup: "g", BackOff: []time.Duration{time.Second, time.Millisecond}},
		"BackOff[0] must be at least 1s, got -1s": {Config: base, ConsumerGroup: "g", BackOff: []time.Duration{-time.Second}},
		"AckWait 30s must equal BackOff[0] 1s":    {Config: base, ConsumerGroup: "g", AckWait: 30 * time.Second, BackOff: []time.Duration{time.Second}},
		"MaxDeliver must be positive, or -1":      {Config: base, ConsumerGroup: "g", MaxDeliver: -2},
		"MaxDeliver 1 must be at least the 2":     {Config: base, ConsumerGroup: "g", MaxDeliver: 1, BackOff: []time.Duration{time.Second, time.Second}},
		"MaxAckPending must be at least 1":        {Config: base, ConsumerGroup: "g", MaxAckPending: -1},
		"MaxInFlight must be between 1 and Max":   {Config: base, ConsumerGroup: "g", MaxAckPending: 4, MaxInFlight: 5},
		"DrainTimeout must be > 0":                {Config: base, ConsumerGroup: "g", DrainTimeout: -time.Second},
		"URL is required":                         {ConsumerGroup: "g"},
	} {
		err := cfg.Validate()
		require.ErrorIs(t, err, nats.ErrInvalidConfig, want)
		require.ErrorContains(t, err, want)
		_, err = nats.NewSubscriber(context.Background(), cfg)
		require.ErrorIs(t, err, nats.ErrInvalidConfig, want)
	}
}

func TestNames(t *testing.T) {
	require.Equal(t, "orders", nats.Config{}.StreamName("orders"))
	require.Equal(t, "orders_eu_created", nats.Config{}.StreamName("orders.eu.created"))
	require.Equal(t, "ORDERS", nats.Config{Stream: "ORDERS"}.StreamName("orders.eu.created"))

	own := nats.SubscriberConfig{ConsumerGroup: "billing.v2"}
	require.Equal(t, "billing_v2", own.ConsumerName("orders.created"))
	shared := nats.SubscriberConfig{Config: nats.Config{Stream: "ORDERS"}, ConsumerGroup: "billing"}
	require.Equal(t, "billing__orders_created", shared.ConsumerName("orders.created"))
}

func TestDefaultNackBackoff(t *testing.T) {
	require.Equal(t, time.Second, nats.DefaultNackBackoff(0))
	require.Equal(t, time.Second, nats.DefaultNackBackoff(1))
	require.Equal(t, 2*time.Second, nats.DefaultNackBackoff(2))
	require.Equal(t, 256*time.Second, nats.DefaultNackBackoff(9))
	require.Equal(t, nats.DefaultNackBackoffMax, nats.DefaultNackBackoff(10))
	require.Equal(t, nats.DefaultNackBackoffMax, nats.DefaultNackBackoff(1000))
}
