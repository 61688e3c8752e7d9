package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// rabbit is a plain amqp091 connection to the test broker, which deletes
// the queues and exchanges of the topics it named when the test ends.
type rabbit struct {
	t    *testing.T
	url  string
	conn *amqp091.Connection
}

// newRabbit connects to the test broker, or skips the test (fails it under
// CI) when it is unreachable.
func newRabbit(t *testing.T) *rabbit {
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
	return &rabbit{t: t, url: u, conn: conn}
}

// topic returns a new topic name; its exchange and the queues named are
// deleted when the test ends.
func (r *rabbit) topic(prefix string, queues ...string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	topic := "oncemill-test-" + prefix + "-" + hex.EncodeToString(b[:])
	r.t.Cleanup(func() {
		ch, err := r.conn.Channel()
		require.NoError(r.t, err)
		defer ch.Close()
		for _, q := range queues {
			_, _ = ch.QueueDelete(strings.ReplaceAll(q, "$", topic), false, false, false)
		}
		_ = ch.ExchangeDelete(topic, false, false)
	})
	return topic
}

// ready returns how many messages queue holds.
func (r *rabbit) ready(queue string) int {
	r.t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(r.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(r.t, err, "queue %q", queue)
	return q.Messages
}

// publish publishes body to exchange as a producer that is not Go would,
// and waits for the broker's confirm.
func (r *rabbit) publish(exchange, key, body string) {
	r.t.Helper()
	ch, err := r.conn.Channel()
	require.NoError(r.t, err)
	defer ch.Close()
	require.NoError(r.t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, "", false, false, amqp091.Publishing{
		Headers:      amqp091.Table{delivery.IdempotencyKey: key},
		DeliveryMode: amqp091.Persistent,
		Body:         []byte(body),
	})
	require.NoError(r.t, err)
	ok, err := dc.WaitContext(ctx)
	require.NoError(r.t, err)
	require.True(r.t, ok)
}

func TestAMQPDeclareUsageErrors(t *testing.T) {
	t.Parallel()
	// Never contacted: usage errors are found before connecting.
	const u = "amqp://guest:s3cret@127.0.0.1:1/"
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"amqp"}, nil, "oncemill amqp: missing subcommand (declare)"},
		{[]string{"amqp", "delete"}, nil, `oncemill amqp: unknown subcommand "delete"`},
		{[]string{"amqp", "declare", "--url", u}, nil, "oncemill amqp declare: --topic is required"},
		{[]string{"amqp", "declare", "--url", u, "--topic", ""}, nil, `invalid value "" for flag -topic: empty topic`},
		{[]string{"amqp", "declare", "--topic", "t"}, nil, "--url is required (or set BROKER_URL)"},
		{[]string{"amqp", "declare", "--topic", "t", "extra", "--url", u}, nil, `unexpected argument "extra"`},
		{[]string{"amqp", "declare", "--topic", "t"}, map[string]string{"BROKER_URL": "kafka://127.0.0.1:9092"}, "want an amqp:// or amqps:// URL"},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u + "?colour=blue"}, nil, `unknown parameter "colour"`},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u + "?delivery_limit=x"}, nil, `delivery_limit="x" is not an integer`},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u + "?connect_timeout=soon"}, nil, `connect_timeout="soon"`},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u + "?group=a", "--group", "b"}, nil, `--group "b" and the URL's group="a" differ`},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u + "?delivery_limit=3", "--delivery-limit", "4"}, nil, "--delivery-limit 4 and the URL's delivery_limit=3 differ"},
		{[]string{"amqp", "declare", "--topic", "t", "--url", u, "--delivery-limit", "-2"}, nil, "DeliveryLimit must be"},
		{[]string{"amqp", "declare", "--topic", strings.Repeat("t", 250), "--url", u, "--group", "billing"}, nil, "--topic: amqp: invalid topic"},
	} {
		r := oncemill(t, tc.env, tc.args...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, tc.want, tc.args)
		require.NotContains(t, r.stderr, "s3cret")
		requireOneLine(t, r.stderr)
		require.Empty(t, r.stdout, tc.args)
	}

	r := oncemill(t, nil, "amqp", "declare", "--help")
	require.Equal(t, exitOK, r.code)
	require.Contains(t, r.stdout, "Usage: oncemill amqp declare --topic T")
}

func TestAMQPDeclareUnreachable(t *testing.T) {
	t.Parallel()
	r := oncemill(t, nil, "amqp", "declare", "--topic", "t", "--url", "amqp://guest:s3cret@127.0.0.1:1/")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill amqp declare: cannot connect to broker at amqp://guest:xxxxx@127.0.0.1:1/")
	require.NotContains(t, r.stderr, "s3cret")
	requireOneLine(t, r.stderr)
}

// TestAMQPDeclare declares a topic for a consumer group from the command
// line, lets a producer that is not Go publish to the topic's exchange, and
// only then starts the consumer, through adapters.Open, which receives the
// message. A topic not declared loses what is published to it.
func TestAMQPDeclare(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	topic := rb.topic("cli-declare", "$.billing")

	r := oncemill(t, nil, "amqp", "declare", "--url", rb.url, "--topic", topic, "--group", "billing")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, fmt.Sprintf("declared exchange %q, quorum queue %q and their binding\n", topic, topic+".billing"), r.stdout)
	require.Empty(t, r.stderr)

	rb.publish(topic, "order-1", `{"order":1}`)
	require.Equal(t, 1, rb.ready(topic+".billing"))

	ctx, cancel := context.WithCancel(context.Background())
	ps, err := adapters.Open(ctx, rb.url+"?group=billing", adapters.Options{})
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		require.NoError(t, ps.Close())
	})
	msgs, err := ps.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := msgtest.Receive(t, msgs, 10*time.Second)
	require.Equal(t, `{"order":1}`, string(got.Payload))
	require.Equal(t, "order-1", got.Metadata.Get(delivery.IdempotencyKey))
	require.True(t, got.Ack())

	// Not declared: the plain producer's message is confirmed, and lost.
	late := rb.topic("cli-late", "$.billing")
	require.ErrorIs(t, ps.Publisher.Publish(late, message.NewMessage(watermill.NewUUID(), nil)), amqp.ErrUnroutable, "our publisher refuses it")
	rb.publish(late, "order-2", `{"order":2}`) // the exchange exists now: confirmed, and dropped
	r = oncemill(t, nil, "amqp", "declare", "--url", rb.url, "--topic", late, "--group", "billing")
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Zero(t, rb.ready(late+".billing"), "what was published before the declaration is lost")
}

// TestAMQPDeclareFromBrokerURL takes the URL, the group and the queue
// arguments from BROKER_URL, as the consumers' adapters.Open does, declares
// two topics at once, and checks the consumers' own declaration matches.
func TestAMQPDeclareFromBrokerURL(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	one := rb.topic("cli-env-one", "$.ship")
	two := rb.topic("cli-env-two", "$.ship")
	broker := rb.url + "?group=ship&delivery_limit=5&prefetch=4&connect_timeout=5s"

	r := oncemill(t, map[string]string{"BROKER_URL": broker}, "amqp", "declare", "--topic", one, "--topic", two)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, 2, strings.Count(r.stdout, "\n"), r.stdout)
	for _, topic := range []string{one, two} {
		rb.publish(topic, "k", "{}")
		require.Equal(t, 1, rb.ready(topic+".ship"), topic)
	}

	// The consumers' declaration, with the same URL, matches; one with
	// another delivery limit does not.
	ctx := context.Background()
	ps, err := adapters.Open(ctx, broker, adapters.Options{})
	require.NoError(t, err)
	require.NoError(t, ps.Subscriber.(message.SubscribeInitializer).SubscribeInitialize(one))
	require.NoError(t, ps.Close())
	r = oncemill(t, map[string]string{"BROKER_URL": rb.url + "?group=ship"}, "amqp", "declare", "--topic", one, "--delivery-limit", "6")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, "oncemill amqp declare: cannot declare topology: topic "+strconv.Quote(one))
	require.Contains(t, r.stderr, "PRECONDITION_FAILED")
	requireOneLine(t, r.stderr)
}

// TestReplayToUnboundRabbitMQTopic replays to a RabbitMQ topic that no
// queue is bound to: the broker would confirm and drop the message, so the
// publisher reports it unroutable, the command fails and the entry stays.
func TestReplayToUnboundRabbitMQTopic(t *testing.T) {
	t.Parallel()
	f := setup(t)
	rb := newRabbit(t)
	topic := rb.topic("cli-replay", "$")
	ids := f.seed(t, dead(topic, "charge", "boom"))

	r := f.dlq(t, "replay", "--all", "--broker", rb.url)
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Contains(t, r.stderr, fmt.Sprintf("oncemill dlq replay: replayed 0 of 1 entries, then: dlq: replay entry %d", ids[0]))
	require.Contains(t, r.stderr, "amqp: message unroutable")
	require.Contains(t, r.stderr, "NO_ROUTE")
	requireOneLine(t, r.stderr)
	require.Equal(t, ids, f.ids(t), "the entry stays")

	r = oncemill(t, nil, "amqp", "declare", "--url", rb.url, "--topic", topic)
	require.Equal(t, exitOK, r.code, r.stderr)
	r = f.dlq(t, "replay", "--all", "--broker", rb.url)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "replayed 1 entry\n", r.stdout)
	require.Empty(t, f.ids(t))
	require.Equal(t, 1, rb.ready(topic))
}

// TestReplayRefusesGoChannel refuses an in-process broker before it reads
// or deletes any entry: nobody outside the command would receive the
// replayed messages.
func TestReplayRefusesGoChannel(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "c", "e"), dead("orders", "c", "e"))
	for _, tc := range []struct {
		env  map[string]string
		args []string
	}{
		{nil, []string{"--all", "--broker", "gochannel://"}},
		{nil, []string{strconv.FormatInt(ids[0], 10), "--broker", "GoChannel://?persistent=true"}},
		{map[string]string{"BROKER_URL": "gochannel://"}, []string{"--topic", "orders"}},
	} {
		args := append([]string{"dlq", "replay"}, tc.args...)
		args = append(args, "--database", pgtest.URL(), "--schema", f.schema)
		r := oncemill(t, tc.env, args...)
		require.Equal(t, exitUsage, r.code, "%v: %s", tc.args, r.stderr)
		require.Contains(t, r.stderr, "oncemill dlq replay: --broker: adapters: not a durable destination: gochannel:// lives inside this process")
		require.Contains(t, r.stderr, "gochannel:// lives inside this process")
		require.Contains(t, r.stderr, "nothing replayed")
		requireOneLine(t, r.stderr)
		require.Empty(t, r.stdout)
		require.Equal(t, ids, f.ids(t), "no entry deleted")
	}

	// Refused before the database is opened: an unreachable one is not
	// even tried.
	r := oncemill(t, nil, "dlq", "replay", "--all", "--broker", "gochannel://", "--database", "postgres://postgres@127.0.0.1:1/never")
	require.Equal(t, exitUsage, r.code, r.stderr)
	require.Contains(t, r.stderr, "gochannel:// lives inside this process")
}
