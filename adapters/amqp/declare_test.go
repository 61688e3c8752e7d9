package amqp_test

import (
	"context"
	"fmt"
	"net/url"
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

// foreignPublish publishes body to topic's exchange as a producer that is
// not Go would: a plain AMQP client, the idempotency key and partition key
// as headers, no Watermill UUID. It waits for the broker's confirm.
func foreignPublish(a *admin, cfg amqp.Config, topic, key, body string) {
	a.publish(cfg.ExchangeName(topic), "", amqp091.Publishing{
		Headers:      amqp091.Table{delivery.IdempotencyKey: key, delivery.PartitionKey: "customer-7"},
		ContentType:  "application/json",
		DeliveryMode: amqp091.Persistent,
		Body:         []byte(body),
	})
}

// TestDeclareBeforeForeignProducer declares a topic's topology ahead of its
// consumer, lets a non-Go producer publish to it, and only then starts the
// consumer, which receives the message. Without the declaration the same
// publish is lost: the broker confirms it and drops it.
func TestDeclareBeforeForeignProducer(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.ConsumerGroup = "billing"
	cfg.DeliveryLimit = 7
	cfg.DeadLetterExchange = uniqueName("dlx")
	topic := uniqueName("declared")
	a.track(cfg, topic)
	ctx := context.Background()

	require.NoError(t, amqp.Declare(ctx, cfg, topic))
	require.NoError(t, amqp.Declare(ctx, cfg, topic), "declaring again changes nothing")
	foreignPublish(a, cfg, topic, "order-7", `{"order":7}`)
	ready, consumers := a.inspect(cfg.QueueName(topic))
	require.Equal(t, 1, ready, "the message waits in the declared queue")
	require.Zero(t, consumers)

	// The consumer starts later, with the same Config: its own declaration
	// matches (the broker would refuse other arguments) and it receives the
	// message with the producer's headers as metadata.
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := msgtest.Receive(t, msgs, wait)
	require.Equal(t, `{"order":7}`, string(got.Payload))
	require.Equal(t, "order-7", got.Metadata.Get(delivery.IdempotencyKey))
	require.Equal(t, "customer-7", got.Metadata.Get(delivery.PartitionKey))
	require.Equal(t, topic, got.Metadata.Get(delivery.Topic))
	require.Equal(t, "1", got.Metadata.Get(delivery.Attempts))
	require.NotEmpty(t, got.UUID)
	ackSent(t, got)

	// The queue has the declared arguments: a declaration with another
	// delivery limit is refused.
	other := cfg
	other.DeliveryLimit = 8
	err = amqp.Declare(ctx, other, topic)
	require.ErrorIs(t, err, amqp.ErrDeclare)
	var aerr *amqp091.Error
	require.ErrorAs(t, err, &aerr)
	require.Equal(t, amqp091.PreconditionFailed, aerr.Code)
	require.Contains(t, aerr.Reason, "x-delivery-limit")
	require.Contains(t, err.Error(), topic)

	// Without the declaration: our publisher fails with ErrUnroutable
	// (declaring the exchange on its way), a plain client's publish is
	// confirmed, and both messages are gone: the queue declared afterwards
	// is empty.
	late := uniqueName("undeclared")
	a.track(cfg, late)
	pub := newPublisher(t, cfg)
	require.ErrorIs(t, pub.Publish(late, message.NewMessage(watermill.NewUUID(), []byte(`{"order":8}`))), amqp.ErrUnroutable)
	foreignPublish(a, cfg, late, "order-8", `{"order":8}`) // confirmed, and dropped
	require.NoError(t, amqp.Declare(ctx, cfg, late))
	ready, _ = a.inspect(cfg.QueueName(late))
	require.Zero(t, ready, "what was published before the declaration is lost")
	foreignPublish(a, cfg, late, "order-9", `{"order":9}`)
	require.NoError(t, pub.Publish(late, message.NewMessage(watermill.NewUUID(), []byte(`{"order":10}`))))
	ready, _ = a.inspect(cfg.QueueName(late))
	require.Equal(t, 2, ready, "what is published after it is kept")
}

// TestDeclareSeveralTopics declares two topics in one call, without a
// consumer group: the queues are named after the topics.
func TestDeclareSeveralTopics(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	one, two := uniqueName("one"), uniqueName("two")
	a.track(cfg, one)
	a.track(cfg, two)
	require.NoError(t, amqp.Declare(context.Background(), cfg, one, two))
	for _, topic := range []string{one, two} {
		require.Equal(t, topic, cfg.QueueName(topic))
		foreignPublish(a, cfg, topic, "k", "{}")
		ready, _ := a.inspect(topic)
		require.Equal(t, 1, ready, topic)
	}
}

func TestDeclareErrors(t *testing.T) {
	ctx := context.Background()
	cfg := amqp.Config{URL: "amqp://user:s3cret@127.0.0.1:1/"}

	require.ErrorIs(t, amqp.Declare(ctx, amqp.Config{}, "t"), amqp.ErrInvalidConfig)
	require.ErrorIs(t, amqp.Declare(ctx, cfg), amqp.ErrInvalidTopic)
	require.ErrorIs(t, amqp.Declare(ctx, cfg, "ok", ""), amqp.ErrInvalidTopic)
	long := cfg
	long.ConsumerGroup = strings.Repeat("g", 200)
	err := amqp.Declare(ctx, long, strings.Repeat("t", 60))
	require.ErrorIs(t, err, amqp.ErrInvalidTopic)
	require.Contains(t, err.Error(), "queue name")

	err = amqp.Declare(ctx, cfg, "t")
	require.ErrorIs(t, err, amqp.ErrConnect)
	require.Contains(t, err.Error(), "user:xxxxx@127.0.0.1:1")
	requireNoSecret(t, err)

	// A cancelled context: nothing is dialled.
	newAdmin(t) // skips when the broker is down
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	err = amqp.Declare(cancelled, testConfig(), uniqueName("never"))
	require.ErrorIs(t, err, context.Canceled)

	// A wrong password is refused by the broker, and not shown.
	u, err := url.Parse(testURL())
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), "s3cret")
	err = amqp.Declare(ctx, amqp.Config{URL: u.String()}, uniqueName("never"))
	require.ErrorIs(t, err, amqp.ErrConnect)
	requireNoSecret(t, err)
}

// TestSingleActiveConsumerIsTheQueues: a queue declared with
// SingleActiveConsumer delivers every message to one subscription of its
// group while another stands by, and a config without it is refused on that queue,
// the error naming the argument, as every fixed queue argument is.
func TestSingleActiveConsumerIsTheQueues(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.ConsumerGroup = "ledger"
	cfg.SingleActiveConsumer = true
	topic := uniqueName("sac")
	a.track(cfg, topic)
	ctx := context.Background()
	require.NoError(t, amqp.Declare(ctx, cfg, topic))

	plain := cfg
	plain.SingleActiveConsumer = false
	err := amqp.Declare(ctx, plain, topic)
	require.ErrorIs(t, err, amqp.ErrDeclare)
	require.Contains(t, err.Error(), "x-single-active-consumer")

	// Subscribe returns before its consumer registers: whichever
	// registers first is the active one.
	first, err := newSubscriber(t, a, cfg, topic).Subscribe(ctx, topic)
	require.NoError(t, err)
	second, err := newSubscriber(t, a, cfg, topic).Subscribe(ctx, topic)
	require.NoError(t, err)
	pub := newPublisher(t, cfg)
	for i := range 4 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d", i))))
	}
	got := map[string]int{}
	timeout := time.After(wait)
	for range 4 {
		select {
		case msg := <-first:
			got["first"]++
			ackSent(t, msg)
		case msg := <-second:
			got["second"]++
			ackSent(t, msg)
		case <-timeout:
			t.Fatalf("received %v of 4", got)
		}
	}
	select {
	case <-first:
		got["first"]++
	case <-second:
		got["second"]++
	case <-time.After(300 * time.Millisecond):
	}
	require.Len(t, got, 1, "one subscription received every message, the other stood by: %v", got)
}
