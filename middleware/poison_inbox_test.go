package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/memory"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestPoisonFromInbox: a poison middleware made from its inbox files a
// dead letter under the inbox's consumer and key even when the message
// never reached the inbox (its adapter could not decode it), so that the
// entry names the consumer its replay must reach; giving the consumer or
// the key twice is refused, naming both fields.
func TestPoisonFromInbox(t *testing.T) {
	t.Parallel()
	inbox := newInbox(t, middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "billing", Key: middleware.KeyFromJSON("orderId")})
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 8, Persistent: true}, watermill.NopLogger{})
	ctx, cancel := context.WithCancel(context.Background())
	dead, err := pubSub.Subscribe(ctx, deadTopic)
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: pubSub, Topic: deadTopic})
	require.NoError(t, err)

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("charge", poisonTopic, pubSub, func(*message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, pubSub.Close())
	})

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"o-7"}`))
	msg.Metadata.Set(dlv.DecodeError, "record header 3 is not valid UTF-8")
	require.NoError(t, pubSub.Publish(poisonTopic, msg))
	got := msgtest.Receive(t, dead, 30*time.Second)
	got.Ack()
	require.Equal(t, "billing", got.Metadata.Get(dlv.DeadConsumer), "the inbox's consumer, not the handler's name")
	require.Equal(t, "o-7", got.Metadata.Get(dlv.DeadKey), "the inbox's key function")

	for field, cfg := range map[string]middleware.PoisonConfig{
		"Consumer": {Inbox: inbox, Publisher: pubSub, Topic: deadTopic, Consumer: "billing"},
		"Key":      {Inbox: inbox, Publisher: pubSub, Topic: deadTopic, Key: middleware.DefaultKey},
	} {
		_, err := middleware.NewPoison(cfg)
		require.ErrorContains(t, err, "PoisonConfig."+field, field)
		require.ErrorContains(t, err, "InboxConfig."+field, field)
	}
}
