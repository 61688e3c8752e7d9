package sqs_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// trackedSubscriber registers every topic it is asked about, so that the
// queues the universal suite creates are deleted afterwards.
type trackedSubscriber struct {
	*sqs.Subscriber
	admin *admin
}

func (s trackedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.admin.trackTopic(topic)
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s trackedSubscriber) SubscribeInitialize(topic string) error {
	s.admin.trackTopic(topic)
	return s.Subscriber.SubscribeInitialize(topic)
}

// trackedPublisher registers the queues it may create.
type trackedPublisher struct {
	*sqs.Publisher
	admin *admin
}

func (p trackedPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.admin.trackTopic(topic)
	return p.Publisher.Publish(topic, msgs...)
}

// TestPubSub runs Watermill's universal Pub/Sub suite against the SQS
// emulator, on standard queues.
//
// Features:
//   - ConsumerGroups false: a topic is one queue and every subscriber of it
//     competes for its messages; fanning out to groups would need SNS.
//   - ExactlyOnceDelivery false: delivery is at least once (a message whose
//     deletion fails, or whose subscriber dies, comes again).
//   - GuaranteedOrder and GuaranteedOrderWithSingleSubscriber false:
//     standard queues are best-effort ordered, and a nacked or expired
//     message goes back behind the others. (FIFO queues keep the order per
//     message group; TestFIFOOrderWithinGroup covers them, the suite's
//     order test publishes without group keys.)
//   - Persistent true: the queue keeps messages until they are deleted.
//   - NewSubscriberReceivesOldMessages false: an acked message is deleted.
//   - RequireSingleInstance false: any number of instances share a queue.
//   - ForceShort false: the full-size variants (5,000 and 10,000 messages)
//     take about 40s with the race detector on two cores; -short runs the
//     suite's small variants in a few seconds.
//   - No RestartServiceCommand: the emulator keeps its queues in memory and
//     is shared with every other package's tests; restarting it would lose
//     them.
//
// NackBackoff is zero here because the suite expects a nacked message back
// at once (it nacks the same messages again and again and waits 15s at
// most); the default backoff is tested by TestNackRedeliversWithAttempts.
func TestPubSub(t *testing.T) {
	a := newAdmin(t)

	// TestPublishSubscribeInOrder would leave a subscriber open (its
	// `defer require.NoError(t, sub.Close())` runs at once); it is skipped
	// here, but close everything again at the end anyway (Close is
	// idempotent), before the admin deletes the queues.
	closers := msgtest.NewClosers(t)

	constructor := func(t *testing.T) (message.Publisher, message.Subscriber) {
		pub, err := sqs.NewPublisher(sqs.PublisherConfig{Config: testConfig()})
		require.NoError(t, err)
		cfg := testSubscriberConfig()
		cfg.NackBackoff = func(int) time.Duration { return 0 }
		// TestMessageCtx closes the subscriber while its message is
		// unacked and wants the message's context cancelled within its
		// timeout: Close cancels it when the drain ends.
		cfg.DrainTimeout = time.Second
		sub, err := sqs.NewSubscriber(cfg)
		require.NoError(t, err)
		closers.Add(sub.Close, pub.Close)
		return trackedPublisher{pub, a}, trackedSubscriber{sub, a}
	}
	tests.TestPubSub(
		t,
		tests.Features{
			ConsumerGroups:                      false,
			ExactlyOnceDelivery:                 false,
			GuaranteedOrder:                     false,
			GuaranteedOrderWithSingleSubscriber: false,
			Persistent:                          true,
			NewSubscriberReceivesOldMessages:    false,
			RequireSingleInstance:               false,
			GenerateTopicFunc: func(tctx tests.TestContext) string {
				return "oncemill-test-suite-" + string(tctx.TestID)
			},
		},
		constructor,
		func(t *testing.T, _ string) (message.Publisher, message.Subscriber) { return constructor(t) },
	)
}
