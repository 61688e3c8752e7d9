package amqp_test

import (
	"context"
	"encoding/json"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

const wait = 10 * time.Second

// ackSent acks msg and waits until the subscriber has sent the ack to the
// broker: watermill-amqp cancels the message context once it has.
func ackSent(t *testing.T, msg *message.Message) {
	t.Helper()
	require.True(t, msg.Ack())
	select {
	case <-msg.Context().Done():
	case <-time.After(wait):
		t.Fatal("ack not sent")
	}
}

// nackSent nacks msg and waits until the subscriber has sent the nack.
func nackSent(t *testing.T, msg *message.Message) {
	t.Helper()
	require.True(t, msg.Nack())
	select {
	case <-msg.Context().Done():
	case <-time.After(wait):
		t.Fatal("nack not sent")
	}
}

func publishText(t *testing.T, pub message.Publisher, topic string, payloads ...string) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, len(payloads))
	for i, p := range payloads {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(p))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return msgs
}

// publishOneKey publishes payloads as publishText does, all with the
// partition key key, so that a subscription hands them out one at a time.
func publishOneKey(t *testing.T, pub message.Publisher, topic, key string, payloads ...string) {
	t.Helper()
	msgs := make([]*message.Message, len(payloads))
	for i, p := range payloads {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(p))
		msgs[i].Metadata.Set(delivery.PartitionKey, key)
	}
	require.NoError(t, pub.Publish(topic, msgs...))
}

func TestDeclaresQuorumQueueAndFanoutExchange(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.ConsumerGroup = "billing"
	topic := uniqueName("quorum")
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))

	queue := topic + ".billing"
	require.Equal(t, queue, cfg.QueueName(topic))
	ready, consumers := a.inspect(queue)
	require.Zero(t, ready)
	require.Zero(t, consumers)

	// The broker rejects a redeclaration whose arguments differ from the
	// queue's: declaring it as a classic queue must fail on x-queue-type,
	// declaring it as a durable quorum queue must succeed.
	ch, err := a.conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "classic"})
	var aerr *amqp091.Error
	require.ErrorAs(t, err, &aerr)
	require.Equal(t, amqp091.PreconditionFailed, aerr.Code)
	require.Contains(t, aerr.Reason, "x-queue-type")
	ch, err = a.conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(queue, true, false, false, false, amqp091.Table{"x-queue-type": "quorum"})
	require.NoError(t, err)

	// Same for the exchange: durable fanout.
	err = ch.ExchangeDeclare(topic, amqp091.ExchangeDirect, true, false, false, false, nil)
	require.ErrorAs(t, err, &aerr)
	require.Equal(t, amqp091.PreconditionFailed, aerr.Code)
	ch, err = a.conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare(topic, amqp091.ExchangeFanout, true, false, false, false, nil))
	require.NoError(t, ch.Close())

	// Where rabbitmqctl works (root on the broker host), ask the broker too.
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "name", "type", "durable").CombinedOutput()
	if err != nil {
		t.Logf("rabbitmqctl not usable here (%v); relied on the redeclaration checks", err)
		return
	}
	found := false
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == queue {
			found = true
			require.Equal(t, []string{"quorum", "true"}, f[1:], "rabbitmqctl list_queues: %s", line)
		}
	}
	require.True(t, found, "queue %s not in rabbitmqctl list_queues:\n%s", queue, out)
}

func TestNackRedeliversAndAckEmptiesQueue(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	topic := uniqueName("nack")
	sub := newSubscriber(t, a, cfg, topic)
	pub := newPublisher(t, cfg)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))

	sent := publishText(t, pub, topic, "hello")[0]
	sent.Metadata.Set(delivery.IdempotencyKey, "k-1")
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	first := msgtest.Receive(t, msgs, wait)
	require.Equal(t, sent.UUID, first.UUID)
	require.Equal(t, "hello", string(first.Payload))
	require.Equal(t, topic, first.Metadata.Get(delivery.Topic))
	require.Equal(t, "false", first.Metadata.Get(delivery.Redelivered))
	require.Equal(t, "1", first.Metadata.Get(delivery.Attempts))
	require.Empty(t, first.Metadata.Get(delivery.DecodeError))
	nackSent(t, first)

	second := msgtest.Receive(t, msgs, wait)
	require.Equal(t, sent.UUID, second.UUID)
	require.Equal(t, "true", second.Metadata.Get(delivery.Redelivered))
	require.Equal(t, "1", second.Metadata.Get(amqp.HeaderDeliveryCount), "x-delivery-count after one nack")
	require.Equal(t, "2", second.Metadata.Get(delivery.Attempts))
	n, ok := delivery.AttemptsOf(second)
	require.True(t, ok)
	require.Equal(t, 2, n)
	ackSent(t, second)

	// The ack reached the broker before the channel closes, so closing the
	// subscriber returns nothing to the queue: no message is ready, and none
	// was unacked (it would be ready again now).
	require.NoError(t, sub.Close())
	ready, consumers := a.inspect(topic)
	require.Zero(t, ready, "messages ready after ack")
	require.Zero(t, consumers)
}

func TestCloseRequeuesUnacked(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.Prefetch = 2
	topic := uniqueName("close")
	a.track(cfg, topic)
	pub := newPublisher(t, cfg)
	sub1, err := amqp.NewSubscriber(cfg, testLogger())
	require.NoError(t, err)
	require.NoError(t, sub1.SubscribeInitialize(topic))
	publishOneKey(t, pub, topic, "k", "one", "two")

	msgs, err := sub1.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	// "one" is with the handler; "two", prefetched, waits behind it, its
	// key's previous message.
	got := msgtest.Receive(t, msgs, wait)
	require.Equal(t, "one", string(got.Payload))
	eventually(t, wait, func() bool { r, _ := a.inspect(topic); return r == 0 }, "both messages delivered to sub1")

	require.NoError(t, sub1.Close())
	// RabbitMQ requeues a closed channel's unacked messages as the
	// channel's process ends, which may be just after the close is
	// confirmed.
	eventually(t, wait, func() bool { r, _ := a.inspect(topic); return r == 2 }, "both unacked messages back in the queue")

	sub2 := newSubscriber(t, a, cfg, topic)
	msgs2, err := sub2.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	payloads := map[string]message.Metadata{}
	for range 2 {
		m := msgtest.Receive(t, msgs2, wait)
		payloads[string(m.Payload)] = m.Metadata
		ackSent(t, m)
	}
	require.Len(t, payloads, 2)
	for p, md := range payloads {
		require.Equal(t, "true", md.Get(delivery.Redelivered), "%s redelivered", p)
		t.Logf("%s after close: x-delivery-count=%q attempts=%q", p, md.Get(amqp.HeaderDeliveryCount), md.Get(delivery.Attempts))
	}
	// Closing nacks both (requeue) while the channel is still open, and
	// closes it: up to RabbitMQ 4.2 every return counts.
	for p, md := range payloads {
		n, err := strconv.Atoi(md.Get(delivery.Attempts))
		require.NoError(t, err, "%s attempts", p)
		require.GreaterOrEqual(t, n, 2, "%s attempts", p)
	}
}

func TestPrefetchLimitsUnacked(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.Prefetch = 2
	topic := uniqueName("prefetch")
	sub := newSubscriber(t, a, cfg, topic)
	pub := newPublisher(t, cfg)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	const total = 10
	payloads := make([]string, total)
	for i := range payloads {
		payloads[i] = string(rune('a' + i))
	}
	// One key, so that the subscription hands out one at a time.
	publishOneKey(t, pub, topic, "k", payloads...)

	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	held := msgtest.Receive(t, msgs, wait) // the handler holds it, unacked

	// The broker sends at most Prefetch unacked messages: the held one and
	// one waiting behind it, of the same key. The other eight stay ready,
	// and stay so.
	eventually(t, wait, func() bool { r, _ := a.inspect(topic); return r == total-2 }, "broker holds the rest")
	msgtest.Nothing(t, msgs, 300*time.Millisecond)
	ready, _ := a.inspect(topic)
	require.Equal(t, total-2, ready, "at most 2 unacked")

	ackSent(t, held)
	next := msgtest.Receive(t, msgs, wait)
	require.Equal(t, "b", string(next.Payload))
	eventually(t, wait, func() bool { r, _ := a.inspect(topic); return r == total-3 }, "one more sent after the ack")
	ackSent(t, next)
}

func TestForeignMessages(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	topic := uniqueName("foreign")
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)

	ts := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	headers := amqp091.Table{
		"x-death": []any{amqp091.Table{
			"count":        int64(3),
			"exchange":     "orders",
			"queue":        "orders.billing",
			"reason":       "rejected",
			"routing-keys": []any{"orders"},
			"time":         ts,
		}},
		"retries":         int64(7),
		"small":           int32(-5),
		"flag":            true,
		"nested":          []any{int64(1), []any{"a", false}, amqp091.Table{"k": "v"}},
		"raw":             []byte("bytes"),
		"when":            ts,
		"price":           amqp091.Decimal{Scale: 2, Value: 1999},
		"ratio":           1.5,
		"nothing":         nil,
		"idempotency_key": "order-42",
	}
	// Published straight to the exchange, as a foreign producer would: no
	// Watermill UUID header and no message-id.
	a.publish(topic, "", amqp091.Publishing{Headers: headers, Body: []byte(`{"id":42}`), DeliveryMode: amqp091.Persistent})
	a.publish(topic, "", amqp091.Publishing{Headers: amqp091.Table{"n": int64(2)}}) // empty body
	a.publish(topic, "", amqp091.Publishing{MessageId: "third", Body: []byte("3")})

	m1 := msgtest.Receive(t, msgs, wait)
	require.Equal(t, `{"id":42}`, string(m1.Payload))
	require.Empty(t, m1.Metadata.Get(delivery.DecodeError))
	require.Equal(t, "7", m1.Metadata.Get("retries"))
	require.Equal(t, "-5", m1.Metadata.Get("small"))
	require.Equal(t, "true", m1.Metadata.Get("flag"))
	require.Equal(t, `[1,["a",false],{"k":"v"}]`, m1.Metadata.Get("nested"))
	require.Equal(t, "bytes", m1.Metadata.Get("raw"))
	require.Equal(t, "2024-05-06T07:08:09Z", m1.Metadata.Get("when"))
	require.Equal(t, "19.99", m1.Metadata.Get("price"))
	require.Equal(t, "1.5", m1.Metadata.Get("ratio"))
	require.Contains(t, m1.Metadata, "nothing")
	require.Equal(t, "order-42", m1.Metadata.Get(delivery.IdempotencyKey))
	var death []map[string]any
	require.NoError(t, json.Unmarshal([]byte(m1.Metadata.Get("x-death")), &death), m1.Metadata.Get("x-death"))
	require.Equal(t, []map[string]any{{
		"count": 3.0, "exchange": "orders", "queue": "orders.billing", "reason": "rejected",
		"routing-keys": []any{"orders"}, "time": "2024-05-06T07:08:09Z",
	}}, death)
	require.Equal(t, topic, m1.Metadata.Get(delivery.Topic))
	require.Equal(t, "1", m1.Metadata.Get(delivery.Attempts))
	require.NotEmpty(t, m1.UUID)
	nackSent(t, m1)

	// The other two were prefetched before m1 was requeued, so they come
	// first; none of the three blocks another.
	rest := map[string]*message.Message{}
	for range 3 {
		m := msgtest.Receive(t, msgs, wait)
		require.Empty(t, m.Metadata.Get(delivery.DecodeError))
		rest[string(m.Payload)] = m
		ackSent(t, m)
	}
	require.Len(t, rest, 3)

	// The fallback UUID is a function of the message: a redelivery keeps it.
	again := rest[`{"id":42}`]
	require.Equal(t, m1.UUID, again.UUID)
	require.Equal(t, "true", again.Metadata.Get(delivery.Redelivered))
	require.Equal(t, "2", again.Metadata.Get(delivery.Attempts))
	require.Equal(t, m1.Metadata.Get("x-death"), again.Metadata.Get("x-death"))

	empty := rest[""]
	require.Empty(t, empty.Payload)
	require.Equal(t, "2", empty.Metadata.Get("n"))
	require.Equal(t, "1", empty.Metadata.Get(delivery.Attempts))
	require.NotEmpty(t, empty.UUID)
	require.NotEqual(t, m1.UUID, empty.UUID)

	require.Equal(t, "third", rest["3"].UUID, "message-id is the UUID when the Watermill header is absent")

	msgtest.Nothing(t, msgs, 200*time.Millisecond)
	require.NoError(t, sub.Close())
	ready, _ := a.inspect(topic)
	require.Zero(t, ready)
}

func TestDeliveryLimitDeadLetters(t *testing.T) {
	a := newAdmin(t)
	dlq := uniqueName("dlq")
	dlqCfg := testConfig()
	dlqSub := newSubscriber(t, a, dlqCfg, dlq)
	require.NoError(t, dlqSub.(message.SubscribeInitializer).SubscribeInitialize(dlq))

	cfg := testConfig()
	cfg.DeliveryLimit = 1
	cfg.DeadLetterExchange = dlq
	topic := uniqueName("limited")
	sub := newSubscriber(t, a, cfg, topic)
	pub := newPublisher(t, cfg)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	sent := publishText(t, pub, topic, "poison")[0]

	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for attempt := 1; attempt <= 2; attempt++ {
		m := msgtest.Receive(t, msgs, wait)
		require.Equal(t, sent.UUID, m.UUID)
		require.Equal(t, []string{"attempt", string(rune('0' + attempt))}, []string{"attempt", m.Metadata.Get(delivery.Attempts)})
		nackSent(t, m)
	}
	// x-delivery-count 2 exceeds the limit of 1: the broker dead-letters it.
	msgtest.Nothing(t, msgs, 300*time.Millisecond)

	dead, err := dlqSub.Subscribe(context.Background(), dlq)
	require.NoError(t, err)
	d := msgtest.Receive(t, dead, wait)
	require.Equal(t, sent.UUID, d.UUID)
	require.Equal(t, "poison", string(d.Payload))
	require.Equal(t, dlq, d.Metadata.Get(delivery.Topic))
	require.Empty(t, d.Metadata.Get(delivery.DecodeError))
	t.Logf("dead-lettered: attempts=%q x-death=%s", d.Metadata.Get(delivery.Attempts), d.Metadata.Get("x-death"))
	var death []map[string]any
	require.NoError(t, json.Unmarshal([]byte(d.Metadata.Get("x-death")), &death))
	require.Len(t, death, 1)
	require.Equal(t, topic, death[0]["queue"])
	require.Equal(t, "delivery_limit", death[0]["reason"])
	ackSent(t, d)
}

func TestNoRequeueOnNackDeadLetters(t *testing.T) {
	a := newAdmin(t)
	dlq := uniqueName("dlq")
	dlqSub := newSubscriber(t, a, testConfig(), dlq)
	require.NoError(t, dlqSub.(message.SubscribeInitializer).SubscribeInitialize(dlq))

	cfg := testConfig()
	cfg.NoRequeueOnNack = true
	cfg.DeadLetterExchange = dlq
	topic := uniqueName("norequeue")
	sub := newSubscriber(t, a, cfg, topic)
	pub := newPublisher(t, cfg)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	sent := publishText(t, pub, topic, "bad")[0]

	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	nackSent(t, msgtest.Receive(t, msgs, wait))
	msgtest.Nothing(t, msgs, 300*time.Millisecond)

	dead, err := dlqSub.Subscribe(context.Background(), dlq)
	require.NoError(t, err)
	d := msgtest.Receive(t, dead, wait)
	require.Equal(t, sent.UUID, d.UUID)
	var death []map[string]any
	require.NoError(t, json.Unmarshal([]byte(d.Metadata.Get("x-death")), &death))
	require.Equal(t, "rejected", death[0]["reason"])
	ackSent(t, d)
}

func TestUnreachableBrokerErrorHidesPassword(t *testing.T) {
	for _, rawURL := range []string{
		"amqp://user:s3cret@127.0.0.1:1/",
		"amqp://user:s3%40cret@127.0.0.1:1/vhost",
	} {
		cfg := amqp.Config{URL: rawURL}
		_, err := amqp.NewSubscriber(cfg, nil)
		require.ErrorIs(t, err, amqp.ErrConnect)
		require.Contains(t, err.Error(), "127.0.0.1:1")
		require.Contains(t, err.Error(), "user:xxxxx@")
		requireNoSecret(t, err)
		t.Log(err)

		_, err = amqp.NewPublisher(cfg, nil)
		require.ErrorIs(t, err, amqp.ErrConnect)
		requireNoSecret(t, err)
	}
}

func requireNoSecret(t *testing.T, err error) {
	t.Helper()
	// Neither the error nor any error it wraps (which a caller may print
	// after errors.As) holds the password, raw or decoded.
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		for _, s := range []string{"s3cret", "s3@cret", "s3%40cret"} {
			require.NotContains(t, e.Error(), s)
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				walk(e)
			}
		}
	}
	walk(err)
}

func TestWrongPasswordErrorHidesPassword(t *testing.T) {
	newAdmin(t) // skips when the broker is down
	u, err := url.Parse(testURL())
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "s3cret")
	_, err = amqp.NewSubscriber(amqp.Config{URL: u.String()}, nil)
	require.ErrorIs(t, err, amqp.ErrConnect)
	requireNoSecret(t, err)
	t.Log(err)
}
