package adapters_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/internal/pgtest"
)

func TestOpenBadURLs(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cases := []struct {
		url     string
		wantErr error
		want    string
	}{
		{"nats://127.0.0.1:4222", adapters.ErrUnknownScheme, `unknown broker scheme "nats"`},
		{"127.0.0.1:9092", adapters.ErrBadURL, "cannot parse"},
		{"localhost:9092", adapters.ErrUnknownScheme, `unknown broker scheme "localhost"`},
		{"orders-topic", adapters.ErrUnknownScheme, "has no scheme"},
		{"gochannel://?persistent=maybe", adapters.ErrBadURL, `persistent="maybe" is not a boolean`},
		{"postgres://oncemill:hunter2@127.0.0.1:1/test?connect_timeout=2", nil, "postgres unreachable"},
		{"postgres://oncemill:hunter2@127.0.0.1:5432/test?sslmode=bogus", adapters.ErrBadURL, "sslmode"},
		{"amqp://oncemill:hunter2@%zz", adapters.ErrBadURL, "cannot parse"},
	}
	for _, tc := range cases {
		_, err := adapters.Open(ctx, tc.url, adapters.Options{})
		require.Error(t, err, tc.url)
		if tc.wantErr != nil {
			require.ErrorIs(t, err, tc.wantErr, tc.url)
		}
		require.ErrorContains(t, err, tc.want, tc.url)
		require.NotContains(t, err.Error(), "hunter2", "credentials never appear in errors")
	}
}

func TestOpenPostgresPubSub(t *testing.T) {
	t.Parallel()
	pgtest.Pool(t, 1) // fails under CI, skips elsewhere, when PostgreSQL is down
	ctx := context.Background()
	ps, err := adapters.Open(ctx, pgtest.URL(), adapters.Options{ConsumerGroup: pgtest.Name(t)})
	require.NoError(t, err)
	defer func() { require.NoError(t, ps.Close()) }()

	topic := pgtest.Name(t)
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := ps.Subscriber.Subscribe(subCtx, topic)
	require.NoError(t, err)
	sent := message.NewMessage(watermill.NewUUID(), []byte("hello"))
	sent.Metadata.Set("idempotency_key", "k1")
	require.NoError(t, ps.Publisher.Publish(topic, sent))
	select {
	case got := <-msgs:
		require.Equal(t, sent.UUID, got.UUID)
		require.Equal(t, "k1", got.Metadata.Get("idempotency_key"))
		got.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("no message from the postgres subscriber")
	}
}
