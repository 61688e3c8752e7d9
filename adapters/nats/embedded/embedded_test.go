package embedded_test

import (
	"context"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/oncemill/oncemill/adapters/nats/embedded"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConfigValidate(t *testing.T) {
	require.NoError(t, embedded.Config{}.Validate())
	for _, port := range []int{-1, 70000} {
		err := embedded.Config{Port: port}.Validate()
		require.ErrorIs(t, err, embedded.ErrInvalidConfig)
		require.ErrorContains(t, err, "Config.Port")
		_, err = embedded.Start(embedded.Config{Port: port})
		require.ErrorIs(t, err, embedded.ErrInvalidConfig)
	}
}

// jetStream connects to url; the connection closes when the test ends.
func jetStream(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := natsgo.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return js
}

// TestStoreDirKeepsStreams: a server started on a store directory keeps
// its streams, messages and consumers there, and a server started again
// on it finds them; Close is idempotent.
func TestStoreDirKeepsStreams(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()

	srv, err := embedded.Start(embedded.Config{StoreDir: dir})
	require.NoError(t, err)
	require.Regexp(t, `^nats://127\.0\.0\.1:\d+$`, srv.URL())
	js := jetStream(t, srv.URL())
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "orders", Subjects: []string{"orders"}})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "orders", []byte("order-42"))
	require.NoError(t, err)
	_, err = s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "billing", AckPolicy: jetstream.AckExplicitPolicy})
	require.NoError(t, err)
	require.NoError(t, srv.Close())
	require.NoError(t, srv.Close(), "Close is idempotent")

	again, err := embedded.Start(embedded.Config{StoreDir: dir})
	require.NoError(t, err)
	defer func() { require.NoError(t, again.Close()) }()
	js = jetStream(t, again.URL())
	s, err = js.Stream(ctx, "orders")
	require.NoError(t, err)
	require.Equal(t, uint64(1), s.CachedInfo().State.Msgs)
	c, err := s.Consumer(ctx, "billing")
	require.NoError(t, err)
	msg, err := c.Next(jetstream.FetchMaxWait(10 * time.Second))
	require.NoError(t, err)
	require.Equal(t, "order-42", string(msg.Data()))
	require.NoError(t, msg.DoubleAck(ctx))
}
