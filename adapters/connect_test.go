package adapters_test

import (
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/netfault"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// openBound is the generous upper bound on an Open against a server that
// never answers: well above the connect timeouts used here (1s to 2s, and
// the 10s default), far below the minutes a client without one can wait.
const openBound = 20 * time.Second

// refusedAddr returns a loopback host:port that refuses connections.
func refusedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// requireNoAnswer opens rawURL, which names a silent server at addr, and
// checks that Open returns within openBound with an ErrConnectTimeout
// error naming addr.
func requireNoAnswer(t *testing.T, ctx context.Context, rawURL, addr string, opts adapters.Options) error {
	t.Helper()
	start := time.Now()
	ps, err := adapters.Open(ctx, rawURL, opts)
	elapsed := time.Since(start)
	if ps != nil {
		require.NoError(t, ps.Close())
	}
	require.Error(t, err)
	require.Less(t, elapsed, openBound, "Open returned after %s: %v", elapsed, err)
	require.ErrorIs(t, err, adapters.ErrConnectTimeout)
	require.ErrorContains(t, err, addr)
	require.NotContains(t, err.Error(), "hunter2", "credentials never appear in errors")
	t.Logf("after %s: %v", elapsed.Round(time.Millisecond), err)
	return err
}

// TestOpenConnectTimeout opens every scheme that connects against a server
// that accepts connections and never answers, with a short connect_timeout
// in the URL, with Options.ConnectTimeout, and with the default: each Open
// returns, in time, an error that names the server.
func TestOpenConnectTimeout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		url  string // %s is the silent server's host:port
		opts adapters.Options
	}{
		{"postgres", "postgres://oncemill:hunter2@%s/test?connect_timeout=1", adapters.Options{}},
		{"postgres duration", "postgres://oncemill:hunter2@%s/test?sslmode=disable&connect_timeout=1500ms", adapters.Options{}},
		{"postgres default", "postgres://oncemill:hunter2@%s/test", adapters.Options{}},
		{"kafka", "kafka://%s?group=g&connect_timeout=1s", adapters.Options{}},
		{"kafka options", "kafka://%s", adapters.Options{ConsumerGroup: "g", ConnectTimeout: time.Second}},
		{"kafka default", "kafka://%s?group=g", adapters.Options{}},
		{"amqp", "amqp://guest:hunter2@%s/?connect_timeout=2s", adapters.Options{}},
		{"amqp default", "amqp://guest:hunter2@%s/", adapters.Options{}},
		{"sqs", "sqs://test:hunter2@us-east-1?endpoint=http://%s&connect_timeout=1s", adapters.Options{}},
		{"sqs default", "sqs://test:hunter2@us-east-1?endpoint=http://%s", adapters.Options{}},
		{"nats", "nats://oncemill:hunter2@%s?group=g&connect_timeout=1s", adapters.Options{}},
		{"nats default", "nats://%s?group=g", adapters.Options{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			addr := netfault.Silent(t)
			requireNoAnswer(t, context.Background(), strings.ReplaceAll(tc.url, "%s", addr), addr, tc.opts)
		})
	}

	t.Run("kafka several brokers", func(t *testing.T) {
		t.Parallel()
		silent, refused := netfault.Silent(t), refusedAddr(t)
		err := requireNoAnswer(t, context.Background(), "kafka://"+refused+","+silent+"?group=g&connect_timeout=1s", silent, adapters.Options{})
		require.ErrorContains(t, err, refused, "every broker's failure is reported")
		require.ErrorContains(t, err, "connection refused")
	})

	t.Run("context deadline", func(t *testing.T) {
		t.Parallel()
		// A context that ends before the default connect timeout bounds
		// the attempts too, even of clients that take no context.
		for _, rawURL := range []string{"kafka://%s?group=g", "amqp://guest:hunter2@%s/", "postgres://oncemill:hunter2@%s/test", "sqs://us-east-1?endpoint=http://%s", "nats://%s?group=g"} {
			addr := netfault.Silent(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			requireNoAnswer(t, ctx, strings.ReplaceAll(rawURL, "%s", addr), addr, adapters.Options{})
			cancel()
		}
	})
}

// TestOpenScrubsOnlyUserinfo opens URLs whose password is a single common
// letter: the errors hide the user info and nothing else, so they stay
// readable.
func TestOpenScrubsOnlyUserinfo(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		addr := netfault.Silent(t)
		_, err := adapters.Open(context.Background(), "postgres://oncemill:e@"+addr+"/test?sslmode=disable&connect_timeout=1", adapters.Options{})
		require.Error(t, err)
		msg := err.Error()
		require.NotContains(t, msg, "oncemill:e@")
		require.Contains(t, msg, "adapters: open postgres://oncemill:xxxxx@"+addr+"/test?")
		require.Contains(t, msg, "postgres unreachable: adapters: no answer within the connect timeout (1s) from "+addr)
		require.Contains(t, msg, "failed to connect to `user=oncemill database=test`")
	})
	t.Run("amqp", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(amqptest.URL())
		require.NoError(t, err)
		conn, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
		if err != nil {
			pgtest.Unavailable(t, "RabbitMQ", err)
		}
		require.NoError(t, conn.Close())
		u.User = url.UserPassword(u.User.Username(), "e")
		_, err = adapters.Open(context.Background(), u.String(), adapters.Options{})
		require.Error(t, err)
		msg := err.Error()
		require.NotContains(t, msg, u.User.Username()+":e@")
		require.Contains(t, msg, u.User.Username()+":xxxxx@"+u.Host)
		require.Contains(t, msg, "cannot connect to broker")
		require.Contains(t, msg, "username or password not allowed", "the broker's reason is readable")
		t.Log(err)
	})
}

// TestOpenWithParameters opens each real broker with the parameters this
// package adds, and Kafka through the broker probe, and checks that a
// message goes through Kafka with the group timeouts set.
func TestOpenWithParameters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("kafka", func(t *testing.T) {
		t.Parallel()
		cluster, err := embedded.Start(embedded.Config{})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, cluster.Close()) })
		ps, err := adapters.Open(ctx, "kafka://"+strings.Join(cluster.Addrs(), ",")+
			"?group=g&offset=oldest&connect_timeout=2s&read_timeout=90s&session_timeout=6s&rebalance_timeout=20s", adapters.Options{})
		require.NoError(t, err)
		defer func() { require.NoError(t, ps.Close()) }()
		subCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		msgs, err := ps.Subscriber.Subscribe(subCtx, "params")
		require.NoError(t, err)
		sent := message.NewMessage(watermill.NewUUID(), []byte("hello"))
		require.NoError(t, ps.Publisher.Publish("params", sent))
		select {
		case got := <-msgs:
			require.Equal(t, sent.UUID, got.UUID)
			got.Ack()
		case <-time.After(60 * time.Second):
			t.Fatal("no message from the kafka subscriber")
		}
	})
	t.Run("amqp", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(amqptest.URL())
		require.NoError(t, err)
		q := u.Query()
		q.Set("connect_timeout", "2s")
		q.Set("heartbeat", "5")
		q.Set("prefetch", "4")
		q.Set("group", pgtest.Name(t))
		u.RawQuery = q.Encode()
		ps, err := adapters.Open(ctx, u.String(), adapters.Options{})
		if err != nil {
			pgtest.Unavailable(t, "RabbitMQ", err)
		}
		require.NoError(t, ps.Close())
	})
	t.Run("sqs", func(t *testing.T) {
		t.Parallel()
		ps, err := adapters.Open(ctx, "sqs://test:test@us-east-1?create=true&visibility_timeout=5s&connect_timeout=2s&group=ignored&endpoint="+sqsEndpoint(), adapters.Options{})
		if err != nil {
			pgtest.Unavailable(t, "SQS at "+sqsEndpoint(), err)
		}
		require.NoError(t, ps.Close())
	})
	t.Run("nats", func(t *testing.T) {
		t.Parallel()
		group, topic := pgtest.Name(t), pgtest.Name(t)+".params"
		ps, err := adapters.Open(ctx, natsURL()+"?create=true&connect_timeout=2s&ack_wait=10s&max_deliver=20&max_ack_pending=64"+
			"&max_in_flight=4&drain_timeout=3s&duplicate_window=1m&group="+group, adapters.Options{})
		if err != nil {
			pgtest.Unavailable(t, "NATS at "+natsURL(), err)
		}
		defer func() { require.NoError(t, ps.Close()) }()
		b := natsBroker(t)
		defer b.cleanup(t, topic)
		subCtx, cancel := context.WithCancel(ctx)
		defer cancel()
		msgs, err := ps.Subscriber.Subscribe(subCtx, topic)
		require.NoError(t, err)
		sent := message.NewMessage(watermill.NewUUID(), []byte("hello"))
		require.NoError(t, ps.Publisher.Publish(topic, sent))
		select {
		case got := <-msgs:
			require.Equal(t, sent.UUID, got.UUID)
			got.Ack()
		case <-time.After(30 * time.Second):
			t.Fatal("no message from the nats subscriber")
		}
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		pgtest.Pool(t, 1) // fails under CI, skips elsewhere, when PostgreSQL is down
		u, err := url.Parse(pgtest.URL())
		require.NoError(t, err)
		q := u.Query()
		q.Set("connect_timeout", "2s")
		q.Set("group", pgtest.Name(t))
		q.Set("application_name", "oncemill-test")
		u.RawQuery = q.Encode()
		ps, err := adapters.Open(ctx, u.String(), adapters.Options{})
		require.NoError(t, err)
		require.NoError(t, ps.Close())
	})
}
