package adapters_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
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
		{"mqtt://127.0.0.1:1883", adapters.ErrUnknownScheme, `unknown broker scheme "mqtt"`},
		{"nats://oncemill:hunter2@127.0.0.1:1?group=g&connect_timeout=2s", nil, "nats: connect to nats://xxxxx@127.0.0.1:1"},
		{"127.0.0.1:9092", adapters.ErrBadURL, `"127.0.0.1:9092" has no scheme: write it as kafka://127.0.0.1:9092/`},
		{"localhost:9092", adapters.ErrUnknownScheme, `unknown broker scheme "localhost" in "localhost:9092": it looks like host:port without a scheme; write it as kafka://localhost:9092/`},
		{"orders-topic", adapters.ErrUnknownScheme, "has no scheme"},
		{"gochannel://?persistent=maybe", adapters.ErrBadURL, `persistent="maybe" is not a boolean`},
		{"postgres://oncemill:hunter2@127.0.0.1:1/test?connect_timeout=2", nil, "postgres unreachable"},
		{"postgres://oncemill:hunter2@127.0.0.1:5432/test?sslmode=bogus", adapters.ErrBadURL, "sslmode"},
		{"amqp://oncemill:hunter2@%zz", adapters.ErrBadURL, `has the invalid escape "%zz": write a literal % as %25`},
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

// TestOpenStrictURLs checks that Open rejects, before it connects to
// anything, a parameter its scheme does not know, a value that is not
// valid, and a group or connect timeout that contradicts Options; every
// error wraps ErrBadURL and names the parameter.
func TestOpenStrictURLs(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Nothing listens on port 1: a case that reached the network would
	// fail with another error than ErrBadURL.
	cases := []struct {
		url  string
		opts adapters.Options
		want []string
	}{
		// Unknown parameters, named and listed with the known ones.
		{url: "amqp://guest:hunter2@127.0.0.1:1/?delivery_limt=5&prefech=3",
			want: []string{`unknown parameters "delivery_limt", "prefech" for amqp://`, "known parameters:", "delivery_limit", "prefetch", "connect_timeout", "group"}},
		{url: "amqp://guest:hunter2@127.0.0.1:1/?connection_timeout=500", want: []string{`"connection_timeout"`, "connect_timeout"}},
		{url: "kafka://127.0.0.1:1?group=g&ofset=newest", want: []string{`unknown parameter "ofset" for kafka://`, "offset", "read_timeout", "rebalance_timeout", "session_timeout", "max_in_flight", "max_in_flight_total", "instance_id"}},
		{url: "kafka://127.0.0.1:1?group=g&group_instance_id=pod-0", want: []string{`unknown parameter "group_instance_id" for kafka://`, "instance_id"}},
		{url: "kafka://?group=g&read_timout=90s", want: []string{`"read_timout"`, "read_timeout"}},
		{url: "sqs://test:hunter2@us-east-1?endpoint=http://127.0.0.1:1&visibilty_timeout=30s", want: []string{`"visibilty_timeout"`, "visibility_timeout", "endpoint", "create"}},
		{url: "postgres://oncemill:hunter2@127.0.0.1:1/test?sslmdoe=disable", want: []string{`"sslmdoe"`, "sslmode", "pool_max_conns"}},
		{url: "gochannel://?persistant=true", want: []string{`"persistant"`, "persistent"}},
		{url: "gochannel://?persistent=true&persistent=false", want: []string{"parameter persistent is given 2 times"}},
		{url: "gochannel://?persistent=true;x", want: []string{"query"}},
		{url: "nats://guest:hunter2@127.0.0.1:1?group=g&ack_wiat=10s", want: []string{`unknown parameter "ack_wiat" for nats://`, "ack_wait", "max_deliver", "max_ack_pending", "max_in_flight", "stream", "create", "duplicate_window", "drain_timeout"}},
		{url: "nats://?group=g&maxdeliver=5", want: []string{`"maxdeliver"`, "max_deliver"}},

		// Invalid values.
		{url: "kafka://127.0.0.1:1?group=g&read_timeout=soon", want: []string{`read_timeout="soon"`}},
		{url: "kafka://127.0.0.1:1?group=g&read_timeout=90", want: []string{`read_timeout="90"`, "Go duration"}},
		{url: "kafka://127.0.0.1:1?group=g&session_timeout=-6s", want: []string{`session_timeout="-6s"`}},
		{url: "kafka://127.0.0.1:1?group=g&rebalance_timeout=0s", want: []string{`rebalance_timeout="0s"`}},
		{url: "kafka://127.0.0.1:1?group=g&read_timeout=30s", want: []string{"read_timeout=30s must be longer than the default rebalance timeout (1m0s)"}},
		{url: "kafka://127.0.0.1:1?group=g&read_timeout=20s&rebalance_timeout=20s", want: []string{"read_timeout=20s must be longer than rebalance_timeout (20s)"}},
		{url: "kafka://127.0.0.1:1?group=g&offset=latest", want: []string{`offset="latest"`}},
		{url: "kafka://127.0.0.1:1?group=g&max_in_flight=0", want: []string{`max_in_flight="0"`, "positive integer"}},
		{url: "kafka://127.0.0.1:1?group=g&max_in_flight=-3", want: []string{`max_in_flight="-3"`, "positive integer"}},
		{url: "kafka://127.0.0.1:1?group=g&max_in_flight=many", want: []string{`max_in_flight="many"`, "positive integer"}},
		{url: "kafka://127.0.0.1:1?group=g&max_in_flight_total=0", want: []string{`max_in_flight_total="0"`, "positive integer"}},
		{url: "kafka://127.0.0.1:1", want: []string{"kafka needs a consumer group"}},
		{url: "kafka://127.0.0.1:1?group=g&connect_timeout=0", want: []string{`connect_timeout="0"`}},
		{url: "kafka://127.0.0.1:1?group=g&instance_id=", want: []string{`parameter instance_id=""`, "instance id is empty"}},
		{url: "kafka://127.0.0.1:1?group=g&instance_id=pod:0", want: []string{`parameter instance_id="pod:0"`, `has ":" at byte 3`}},
		{url: "kafka://?group=g&instance_id=..", want: []string{`parameter instance_id=".."`}},
		{url: "amqp://guest:hunter2@127.0.0.1:1/?connect_timeout=-1s", want: []string{`connect_timeout="-1s"`}},
		{url: "amqp://guest:hunter2@127.0.0.1:1/?prefetch=many", want: []string{`prefetch="many"`}},
		{url: "postgres://oncemill:hunter2@127.0.0.1:1/test?connect_timeout=soon", want: []string{`connect_timeout="soon"`}},
		{url: "sqs://us-east-1?connect_timeout=1x", want: []string{`connect_timeout="1x"`}},
		{url: "sqs://us-east-1?visibility_timeout=1500ms", want: []string{"visibility_timeout=1500ms", "whole seconds from 1s to 12h0m0s"}},
		{url: "sqs://us-east-1?visibility_timeout=13h", want: []string{"visibility_timeout=13h"}},
		{url: "sqs://us-east-1?visibility_timeout=0", want: []string{`visibility_timeout="0"`}},
		{url: "sqs://us-east-1?create=sometimes", want: []string{`create="sometimes"`}},
		{url: "gochannel://?connect_timeout=forever", want: []string{`connect_timeout="forever"`}},
		{url: "nats://127.0.0.1:1", want: []string{"nats needs a consumer group"}},
		{url: "nats://127.0.0.1:1?group=g&ack_wait=soon", want: []string{`ack_wait="soon"`, "Go duration"}},
		{url: "nats://127.0.0.1:1?group=g&ack_wait=500ms", want: []string{"ack_wait=500ms", "at least 1s"}},
		{url: "nats://127.0.0.1:1?group=g&max_deliver=0", want: []string{`max_deliver="0"`, "-1 for no limit"}},
		{url: "nats://127.0.0.1:1?group=g&max_deliver=-2", want: []string{`max_deliver="-2"`}},
		{url: "nats://127.0.0.1:1?group=g&max_ack_pending=0", want: []string{`max_ack_pending="0"`, "positive integer"}},
		{url: "nats://127.0.0.1:1?group=g&max_in_flight=many", want: []string{`max_in_flight="many"`, "positive integer"}},
		{url: "nats://127.0.0.1:1?group=g&max_in_flight=20&max_ack_pending=10", want: []string{"MaxInFlight must be between 1 and MaxAckPending (10), got 20"}},
		{url: "nats://127.0.0.1:1?group=g&stream=ORDERS&create=true", want: []string{"stream=ORDERS and create=true"}},
		{url: "nats://127.0.0.1:1?group=g&stream=orders.all", want: []string{`Stream "orders.all"`}},
		{url: "nats://127.0.0.1:1?group=g&create=maybe", want: []string{`create="maybe"`}},
		{url: "nats://127.0.0.1:1?group=g&drain_timeout=0s", want: []string{`drain_timeout="0s"`}},
		{url: "nats://127.0.0.1:1?group=g&duplicate_window=-1m", want: []string{`duplicate_window="-1m"`}},
		{url: "nats://127.0.0.1:99999?group=g", want: []string{`server "127.0.0.1:99999" has no valid port`}},

		// The URL and Options disagree.
		{url: "kafka://127.0.0.1:1?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a" and Options.ConsumerGroup "b" differ`}},
		{url: "amqp://guest:hunter2@127.0.0.1:1/?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a"`}},
		{url: "postgres://oncemill:hunter2@127.0.0.1:1/test?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a"`}},
		{url: "sqs://us-east-1?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a"`}},
		{url: "gochannel://?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a"`}},
		{url: "nats://guest:hunter2@127.0.0.1:1?group=a", opts: adapters.Options{ConsumerGroup: "b"}, want: []string{`group="a"`}},
		{url: "kafka://127.0.0.1:1?group=g&connect_timeout=2s", opts: adapters.Options{ConnectTimeout: 3 * time.Second}, want: []string{"connect_timeout=2s and Options.ConnectTimeout 3s differ"}},
		{url: "gochannel://", opts: adapters.Options{ConnectTimeout: -time.Second}, want: []string{"Options.ConnectTimeout is -1s"}},
	}
	for _, tc := range cases {
		_, err := adapters.Open(ctx, tc.url, tc.opts)
		require.ErrorIs(t, err, adapters.ErrBadURL, tc.url)
		for _, w := range tc.want {
			require.ErrorContains(t, err, w, tc.url)
		}
		require.NotContains(t, err.Error(), "hunter2", "credentials never appear in errors")
	}
}

// TestOpenAgreeingOptions opens URLs whose group and connect timeout
// Options repeat: the same value in both places is not a conflict.
func TestOpenAgreeingOptions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url  string
		opts adapters.Options
	}{
		{"gochannel://?group=billing&connect_timeout=2s", adapters.Options{ConsumerGroup: "billing", ConnectTimeout: 2 * time.Second}},
		{"gochannel://?connect_timeout=2", adapters.Options{ConnectTimeout: 2 * time.Second}},
		{"kafka://?group=billing", adapters.Options{ConsumerGroup: "billing"}},
		{"nats://?group=billing&connect_timeout=5s", adapters.Options{ConsumerGroup: "billing", ConnectTimeout: 5 * time.Second}},
	} {
		ps, err := adapters.Open(context.Background(), tc.url, tc.opts)
		require.NoError(t, err, tc.url)
		require.NoError(t, ps.Close())
	}
}

// TestOpenRefusesBadDrainTimeout: every scheme with a drain_timeout
// refuses one that is not a positive Go duration, naming the parameter,
// before it connects; SQS's max_messages is checked the same way.
func TestOpenRefusesBadDrainTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, prefix := range []string{"kafka://127.0.0.1:1?group=g&", "amqp://127.0.0.1:1/?", "sqs://eu-west-1?", "nats://127.0.0.1:1?group=g&"} {
		for _, bad := range []string{"0s", "-1s", "ten", "10"} {
			_, err := adapters.Open(ctx, prefix+"drain_timeout="+bad, adapters.Options{})
			require.ErrorIs(t, err, adapters.ErrBadURL, prefix+bad)
			require.ErrorContains(t, err, "parameter drain_timeout=", prefix+bad)
		}
	}
	for _, bad := range []string{"0", "11", "x"} {
		_, err := adapters.Open(ctx, "sqs://eu-west-1?max_messages="+bad, adapters.Options{})
		require.ErrorIs(t, err, adapters.ErrBadURL, bad)
		require.ErrorContains(t, err, "parameter max_messages=", bad)
	}
}
