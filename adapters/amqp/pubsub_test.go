package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// trackedSubscriber records every topic it is asked about, so that the
// queues and exchanges the universal suite creates are deleted afterwards.
type trackedSubscriber struct {
	message.Subscriber
	admin *admin
	cfg   amqp.Config
}

func (s trackedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.admin.track(s.cfg, topic)
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s trackedSubscriber) SubscribeInitialize(topic string) error {
	s.admin.track(s.cfg, topic)
	return s.Subscriber.(message.SubscribeInitializer).SubscribeInitialize(topic)
}

// trackedPublisher records the exchanges it declares.
type trackedPublisher struct {
	message.Publisher
	admin *admin
	cfg   amqp.Config
}

func (p trackedPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.admin.trackExchange(p.cfg.ExchangeName(topic))
	return p.Publisher.Publish(topic, msgs...)
}

// TestPubSub runs Watermill's universal Pub/Sub suite against RabbitMQ.
//
// Features:
//   - ConsumerGroups: each group has its own queue bound to the topic's
//     fanout exchange, so each group gets every message.
//   - ExactlyOnceDelivery false: delivery is at least once; a message not
//     acked before a connection drops is delivered again.
//   - GuaranteedOrder and GuaranteedOrderWithSingleSubscriber, with a
//     prefetch of one only: a queue is FIFO and such a subscription hands
//     out one message at a time, so order holds for one consumer without
//     redeliveries (the suite's order test uses one subscriber and no
//     nacks); with a larger prefetch, messages without a common ordering
//     key are handled at once, and competing consumers or a requeued
//     message reorder.
//   - Persistent: durable exchanges and quorum queues, persistent messages.
//   - NewSubscriberReceivesOldMessages false: a queue hands each message to
//     one consumer and forgets it once acked.
//   - No RestartServiceCommand: restarting the shared broker would break
//     every other package's tests running against it.
func TestPubSub(t *testing.T) {
	for _, prefetch := range []int{1, 16} {
		t.Run(fmt.Sprintf("prefetch_%d", prefetch), func(t *testing.T) { testPubSub(t, prefetch) })
	}
}

func testPubSub(t *testing.T, prefetch int) {
	a := newAdmin(t)

	// The suite closes what it creates, except in TestPublishSubscribeInOrder:
	// its `defer require.NoError(t, sub.Close())` closes the multiplied
	// subscriber before Subscribe creates the real one, which then stays
	// open. Close everything again when the suite ends (Close is
	// idempotent), before the admin deletes the queues.
	closers := msgtest.NewClosers(t)

	constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		cfg := testConfig()
		cfg.ConsumerGroup = group
		cfg.Prefetch = prefetch
		// TestMessageCtx closes the subscriber while its message is
		// unacked and wants the message's context cancelled within its
		// timeout: Close cancels it when the drain ends.
		cfg.DrainTimeout = time.Second
		pub, err := amqp.NewPublisher(cfg, testLogger())
		require.NoError(t, err)
		sub, err := amqp.NewSubscriber(cfg, testLogger())
		require.NoError(t, err)
		closers.Add(sub.Close, pub.Close)
		return trackedPublisher{pub, a, cfg}, trackedSubscriber{sub, a, cfg}
	}
	tests.TestPubSub(
		t,
		tests.Features{
			ConsumerGroups:                      true,
			ExactlyOnceDelivery:                 false,
			GuaranteedOrder:                     prefetch == 1,
			GuaranteedOrderWithSingleSubscriber: prefetch == 1,
			Persistent:                          true,
			GenerateTopicFunc: func(tctx tests.TestContext) string {
				return "oncemill-test-suite-" + string(tctx.TestID)
			},
		},
		func(t *testing.T) (message.Publisher, message.Subscriber) { return constructor(t, "") },
		constructor,
	)
}
