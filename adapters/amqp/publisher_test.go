package amqp_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
)

// TestPublishUnroutableNamesGroup: a publisher configured with a consumer
// group names that group in the fix, and quotes a topic the shell would
// split.
func TestPublishUnroutableNamesGroup(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.ConsumerGroup = "billing"
	topic := uniqueName("unroutable group") + "'s"
	a.track(cfg, topic)
	pub := newPublisher(t, cfg)

	err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("lost")))
	require.ErrorIs(t, err, amqp.ErrUnroutable)
	quoted := "'" + strings.ReplaceAll(topic, "'", `'\''`) + "'"
	require.Contains(t, err.Error(), "oncemill amqp declare --topic "+quoted+" --group billing (or amqp.Declare")
}

// TestPublishUnroutable publishes to a topic whose fanout exchange has no
// queue bound: RabbitMQ confirms such a message although it dropped it, so
// the publisher must report the broker's basic.return as ErrUnroutable.
// Once a queue is bound, the same publisher delivers to it.
func TestPublishUnroutable(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	topic := uniqueName("unroutable")
	a.track(cfg, topic)
	pub := newPublisher(t, cfg)

	lost := message.NewMessage(watermill.NewUUID(), []byte("lost"))
	err := pub.Publish(topic, lost)
	require.ErrorIs(t, err, amqp.ErrUnroutable)
	require.Contains(t, err.Error(), lost.UUID)
	require.Contains(t, err.Error(), fmt.Sprintf("exchange %q", cfg.ExchangeName(topic)))
	require.Contains(t, err.Error(), fmt.Sprintf("topic %q", topic))
	require.Contains(t, err.Error(), "312 NO_ROUTE", "the broker's reply code and text")
	require.Contains(t, err.Error(), "declare each consumer group's queue before publishing: oncemill amqp declare --topic "+topic+" --group GROUP",
		"the error names the command that fixes it, with the topic filled in")

	// A batch stops at its first message.
	err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a")), message.NewMessage(watermill.NewUUID(), []byte("b")))
	require.ErrorIs(t, err, amqp.ErrUnroutable)

	// Bind the queue: the same publisher, on the same channels, delivers.
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	ready, _ := a.inspect(cfg.QueueName(topic))
	require.Zero(t, ready, "nothing of the unroutable publishes reached the queue")
	sent := publishText(t, pub, topic, "kept", "kept too")
	ready, _ = a.inspect(cfg.QueueName(topic))
	require.Equal(t, 2, ready)

	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for _, want := range sent {
		got := msgtest.Receive(t, msgs, wait)
		require.Equal(t, want.UUID, got.UUID)
		require.Equal(t, string(want.Payload), string(got.Payload))
		ackSent(t, got)
	}
}

// TestPublishUnroutableConcurrent publishes from many goroutines at once,
// over fewer channels than goroutines, to a bound and an unbound topic: each
// call gets its own outcome (a return is never taken for another message's),
// and the bound queue receives exactly the messages whose Publish succeeded.
func TestPublishUnroutableConcurrent(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.PublishChannels = 3
	bound, unbound := uniqueName("bound"), uniqueName("unbound")
	a.track(cfg, unbound)
	sub := newSubscriber(t, a, cfg, bound)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(bound))
	pub := newPublisher(t, cfg)

	const workers, each = 8, 25
	errs := make([][]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				topic := bound
				if (w+i)%2 == 1 {
					topic = unbound
				}
				errs[w] = append(errs[w], pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(topic))))
			}
		}()
	}
	wg.Wait()

	delivered := 0
	for w := range workers {
		for i, err := range errs[w] {
			if (w+i)%2 == 1 {
				require.ErrorIs(t, err, amqp.ErrUnroutable, "worker %d, publish %d to the unbound topic", w, i)
			} else {
				require.NoError(t, err, "worker %d, publish %d to the bound topic", w, i)
				delivered++
			}
		}
	}
	require.Equal(t, workers*each/2, delivered)
	ready, _ := a.inspect(cfg.QueueName(bound))
	require.Equal(t, delivered, ready, "every confirmed publish is in the queue, and only those")
}

// TestPublishContextAndClose checks that a cancelled message context fails
// its Publish without spoiling the channel for the next call, and that
// Publish fails with ErrClosed after Close.
func TestPublishContextAndClose(t *testing.T) {
	a := newAdmin(t)
	cfg := testConfig()
	cfg.PublishChannels = 1
	topic := uniqueName("ctx")
	sub := newSubscriber(t, a, cfg, topic)
	require.NoError(t, sub.(message.SubscribeInitializer).SubscribeInitialize(topic))
	pub, err := amqp.NewPublisher(cfg, testLogger())
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := message.NewMessage(watermill.NewUUID(), []byte("cancelled"))
	msg.SetContext(ctx)
	require.ErrorIs(t, pub.Publish(topic, msg), context.Canceled)

	publishText(t, pub, topic, "after")
	ready, _ := a.inspect(cfg.QueueName(topic))
	require.Equal(t, 1, ready)

	require.NoError(t, pub.Close())
	require.NoError(t, pub.Close(), "Close is idempotent")
	require.ErrorIs(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), amqp.ErrClosed)
}
