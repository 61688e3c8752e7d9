package sqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestInboxEndToEnd runs the store under a Watermill router with the
// poison middleware in front of the inbox, as a service does: every order
// is delivered three times, a flaky order writes its effect and then fails
// its first attempt (rolled back), a poison order always fails. Each good
// order is applied once, the poison order is dead-lettered once with no
// effect and its key is dead.
func TestInboxEndToEnd(t *testing.T) {
	t.Parallel()
	each(t, 8, func(t *testing.T, b backend) {
		const (
			topic     = "orders"
			deadTopic = "orders.dead"
			orders    = 20
			copies    = 3
		)
		pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 256, Persistent: true}, watermill.NopLogger{})
		dead, err := pubSub.Subscribe(context.Background(), deadTopic)
		require.NoError(t, err)
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: pubSub, Topic: deadTopic, MaxAttempts: 3,
			InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
		})
		require.NoError(t, err)
		inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store})
		require.NoError(t, err)

		var (
			mu      sync.Mutex
			flakied = map[string]bool{}
		)
		handler := func(msg *message.Message) error {
			ctx := msg.Context()
			key := string(msg.Payload)
			if err := b.effect(ctx, key); err != nil {
				return err
			}
			switch {
			case key == "order-poison":
				return errors.New("card declined")
			case key == "order-3" || key == "order-7":
				mu.Lock()
				defer mu.Unlock()
				if !flakied[key] {
					flakied[key] = true
					return errors.New("payment API timed out") // the effect rolls back
				}
			}
			return nil
		}
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(poison.Middleware, inbox.Middleware)
		router.AddConsumerHandler("charge", topic, pubSub, handler)
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		t.Cleanup(func() {
			require.NoError(t, router.Close())
			require.NoError(t, <-done)
			require.NoError(t, pubSub.Close())
		})

		keys := []string{"order-poison"}
		for i := 0; i < orders; i++ {
			keys = append(keys, fmt.Sprintf("order-%d", i))
		}
		for c := 0; c < copies; c++ {
			for _, k := range keys {
				msg := message.NewMessage(watermill.NewUUID(), []byte(k))
				msg.Metadata.Set(delivery.IdempotencyKey, k)
				require.NoError(t, pubSub.Publish(topic, msg))
			}
		}

		letter := msgtest.Receive(t, dead, 30*time.Second)
		letter.Ack()
		require.Equal(t, "order-poison", string(letter.Payload))
		require.Equal(t, "3", letter.Metadata.Get(delivery.DeadAttempts))
		msgtest.WaitFor(t, "every order applied", func() bool { return b.effects(t, "") == orders })
		// Every copy has been answered by now: the later copies of the
		// poison order are acked as copies of a dead key.
		msgtest.WaitFor(t, "the poison order's copies", func() bool {
			r, _ := b.row(t, dedup.Key{Consumer: "charge", Key: "order-poison"})
			return r.deadCopies == copies-1
		})
		msgtest.Nothing(t, dead, 100*time.Millisecond)
		for _, k := range keys[1:] {
			require.Equal(t, 1, b.effects(t, k), k)
			r, ok := b.row(t, dedup.Key{Consumer: "charge", Key: k})
			require.True(t, ok, k)
			require.Equal(t, "done", r.status, k)
		}
		require.Zero(t, b.effects(t, "order-poison"))
		r, _ := b.row(t, dedup.Key{Consumer: "charge", Key: "order-poison"})
		require.Equal(t, "dead", r.status)
		require.Equal(t, "card declined", r.lastErr.String)
		require.Equal(t, int64(orders), inbox.Stats().Applied)
	})
}
