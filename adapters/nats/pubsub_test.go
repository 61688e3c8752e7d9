package nats_test

import (
	"context"
	"regexp"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/adapters/nats/embedded"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// unsafeName matches what a consumer group of a suite test should not
// have.
var unsafeName = regexp.MustCompile(`[^a-zA-Z0-9_-]`)

// trackedSubscriber registers every topic it is asked about, so that the
// streams the universal suite creates are deleted afterwards.
type trackedSubscriber struct {
	*nats.Subscriber
	admin *admin
}

func (s trackedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.admin.track(topic)
	return s.Subscriber.Subscribe(ctx, topic)
}

func (s trackedSubscriber) SubscribeInitialize(topic string) error {
	s.admin.track(topic)
	return s.Subscriber.SubscribeInitialize(topic)
}

// trackedPublisher registers the streams it may create.
type trackedPublisher struct {
	*nats.Publisher
	admin *admin
}

func (p trackedPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.admin.track(topic)
	return p.Publisher.Publish(topic, msgs...)
}

// TestPubSub runs Watermill's universal Pub/Sub suite against the NATS
// server and against an embedded one of the test's own, each twice: with
// the default one message in flight per subscription, and with 16.
//
// Features:
//   - ConsumerGroups true: a group is a durable consumer; its subscribers
//     compete for the messages, every group gets each of them.
//   - ExactlyOnceDelivery false: delivery is at least once (an ack that
//     does not reach JetStream, or a subscriber that dies, brings the
//     message again).
//   - GuaranteedOrder and GuaranteedOrderWithSingleSubscriber, with one
//     message in flight only: a single subscription receives the stream's
//     order, each message after the previous one's ack; competing
//     subscribers and several messages in flight do not keep it.
//   - Persistent true: the stream keeps the messages.
//   - NewSubscriberReceivesOldMessages false: a new subscriber of a group
//     goes on where the group is.
//   - No RestartServiceCommand: the server is shared with every other
//     package's tests.
//
// NackBackoff is zero here because the suite expects a nacked message back
// at once (it nacks the same messages again and again and waits 15s at
// most); the default backoff is tested by TestNackRedeliversWithAttempts.
// AckWait is short so that a message whose fetch a closing subscriber
// cancelled, which JetStream may have sent just then, comes back within
// the suite's timeouts.
func TestPubSub(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		embedded    bool
		maxInFlight int
	}{
		{"one_in_flight", false, 1},
		{"sixteen_in_flight", false, 16},
		{"embedded_one_in_flight", true, 1},
		{"embedded_sixteen_in_flight", true, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var a *admin
			if tc.embedded {
				srv, err := embedded.Start(embedded.Config{})
				require.NoError(t, err)
				t.Cleanup(func() { require.NoError(t, srv.Close()) })
				a = newAdminOf(t, srv.URL())
			} else {
				a = newAdmin(t)
			}
			closers := msgtest.NewClosers(t)
			constructor := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
				cfg := a.config()
				pub, err := nats.NewPublisher(context.Background(), nats.PublisherConfig{Config: cfg})
				require.NoError(t, err)
				sub, err := nats.NewSubscriber(context.Background(), nats.SubscriberConfig{
					Config:        cfg,
					ConsumerGroup: group,
					AckWait:       5 * time.Second,
					MaxInFlight:   tc.maxInFlight,
					NackBackoff:   func(int) time.Duration { return 0 },
					// TestMessageCtx closes the subscriber while its
					// message is unacked and wants the message's context
					// cancelled within its timeout: the drain's end
					// cancels it.
					DrainTimeout: time.Second,
				})
				require.NoError(t, err)
				closers.Add(sub.Close, pub.Close)
				return trackedPublisher{pub, a}, trackedSubscriber{sub, a}
			}
			ordered := tc.maxInFlight == 1
			tests.TestPubSub(t,
				tests.Features{
					ConsumerGroups:                      true,
					ExactlyOnceDelivery:                 false,
					GuaranteedOrder:                     ordered,
					GuaranteedOrderWithSingleSubscriber: ordered,
					Persistent:                          true,
					NewSubscriberReceivesOldMessages:    false,
				},
				func(t *testing.T) (message.Publisher, message.Subscriber) {
					// One group per suite test: every subscriber of a
					// test is one "service".
					return constructor(t, "suite_"+unsafeName.ReplaceAllString(t.Name(), "_"))
				},
				constructor,
			)
		})
	}
}
