package adapters_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// opened opens rawURL and closes it at the end of the test.
func opened(t *testing.T, rawURL string) message.Publisher {
	t.Helper()
	ps, err := adapters.Open(context.Background(), rawURL, adapters.Options{})
	require.NoError(t, err, rawURL)
	t.Cleanup(func() { require.NoError(t, ps.Close()) })
	return ps.Publisher
}

// goChannel is Watermill's own GoChannel, closed at the end of the test.
func goChannel(t *testing.T, persistent bool) *gochannel.GoChannel {
	t.Helper()
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: persistent}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	return gc
}

// decorator wraps a publisher, as a metrics wrapper does.
type decorator struct{ message.Publisher }

// TestCheckDurable: the publishers of an embedded broker (kafka:// and
// nats:// with no host) and non-persistent GoChannels are refused with
// ErrInProcess and an error that names the missing host and the fix; a
// persistent GoChannel is accepted, as is a decorator, which cannot be
// seen through.
func TestCheckDurable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		pub  message.Publisher
		want string // "" for accepted
	}{
		{"kafka:// with no host", opened(t, "kafka://?group=g"), "kafka:// has no host, which starts an embedded broker that lives and dies with this process: name the brokers, e.g. kafka://broker:9092"},
		{"nats:// with no host", opened(t, "nats://?group=x"), "nats:// has no host, which starts an embedded broker that lives and dies with this process: name the brokers, e.g. nats://nats:4222"},
		{"gochannel://", opened(t, "gochannel://"), "a non-persistent GoChannel (gochannel://) keeps nothing once this process exits"},
		{"raw GoChannel", goChannel(t, false), "a non-persistent *gochannel.GoChannel returns nil for a topic nobody subscribes to"},
		{"gochannel://?persistent=true", opened(t, "gochannel://?persistent=true"), ""},
		{"raw persistent GoChannel", goChannel(t, true), ""},
		{"decorated", decorator{goChannel(t, false)}, ""},
	} {
		err := adapters.CheckDurable(tc.pub)
		if tc.want == "" {
			require.NoError(t, err, tc.name)
			continue
		}
		require.ErrorIs(t, err, adapters.ErrInProcess, tc.name)
		require.ErrorContains(t, err, tc.want, tc.name)
	}
}

// TestCheckDurableURL: a URL that names no broker outside this process is
// refused before anything opens; one with a host is not checked further.
func TestCheckDurableURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ url, want string }{
		{"kafka://", "kafka:// has no host"},
		{"kafka://?group=billing", "e.g. kafka://broker:9092"},
		{"kafka:///", "kafka:// has no host"},
		{"nats://?group=x", "nats:// has no host"},
		{"gochannel://", "gochannel:// lives inside this process"},
		{"GoChannel://?persistent=true", "gochannel:// lives inside this process"},
		{"kafka://broker:9092?group=g", ""},
		{"nats://nats:4222", ""},
		{"amqp://guest:guest@127.0.0.1:5672/", ""},
		{"sqs://us-east-1", ""},
		{"postgres://127.0.0.1/db", ""},
		{"%%bad", ""}, // left to Open
	} {
		err := adapters.CheckDurableURL(tc.url)
		if tc.want == "" {
			require.NoError(t, err, tc.url)
			continue
		}
		require.ErrorIs(t, err, adapters.ErrInProcess, tc.url)
		require.ErrorContains(t, err, tc.want, tc.url)
	}
}

// TestInProcessRefusedByEveryCaller: everything that deletes or acks
// once a publish returned refuses a destination inside this process, by
// the one check: the relay (NewRelay), the Poison middleware (NewPoison),
// a dead-letter replay (Store.Replay, which deletes nothing then) and the
// console's replay to the topic (console.New).
func TestInProcessRefusedByEveryCaller(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 2)
	schema := pgtest.Schema(t, pool)
	cfg := sqlschema.Config{Schema: schema}
	require.NoError(t, sqlschema.Migrate(ctx, pool, cfg))
	table, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	store, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)
	dead := message.NewMessage(watermill.NewUUID(), []byte("{}"))
	dead.Metadata.Set(delivery.DeadTopic, "orders")
	require.NoError(t, table.Publish("orders.dlq", dead))
	entries := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "dlq"}.Sanitize()).Scan(&n))
		return n
	}
	require.Equal(t, 1, entries())

	for name, pub := range map[string]message.Publisher{
		"nats://?group=x":  opened(t, "nats://?group=x"),
		"kafka://?group=x": opened(t, "kafka://?group=x"),
		"raw GoChannel":    goChannel(t, false),
		"gochannel://":     opened(t, "gochannel://"),
	} {
		_, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: pub, Schema: cfg})
		require.ErrorIs(t, err, adapters.ErrInProcess, name)
		require.ErrorIs(t, err, forwarder.ErrLossyPublisher, name)

		_, err = middleware.NewPoison(middleware.PoisonConfig{Publisher: pub, Topic: "orders.dlq"})
		require.ErrorIs(t, err, adapters.ErrInProcess, name)
		require.ErrorContains(t, err, "PoisonConfig.Publisher", name)

		n, err := store.Replay(ctx, pub, dlq.Filter{All: true}, nil)
		require.ErrorIs(t, err, adapters.ErrInProcess, name)
		require.Zero(t, n, name)
		require.Equal(t, 1, entries(), "%s: the entry stays", name)

		_, err = console.New(console.Config{Pool: pool, Schema: cfg, DisableAuth: true, Publisher: pub})
		require.ErrorIs(t, err, adapters.ErrInProcess, name)
		require.ErrorIs(t, err, console.ErrInvalidConfig, name)
	}
}
