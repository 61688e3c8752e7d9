package sqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlstore"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/middleware"
)

// TestBatchHandlerOnDatabaseSQL: a middleware.BatchHandler under a
// router, behind Poison and an inbox on this store (no group commit: it
// gets one message a call), writes through sqlstore.Tx(ctx) with a
// multi-row INSERT built for the dialect. Every order is published twice;
// a BatchErrors fails the poison order. Each good order is applied once,
// the poison order dead-lettered after three attempts with no effect.
func TestBatchHandlerOnDatabaseSQL(t *testing.T) {
	t.Parallel()
	each(t, 8, func(t *testing.T, b backend) {
		const topic, deadTopic, orders = "orders", "orders.dead", 10
		pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, watermill.NopLogger{})
		dead, err := pubSub.Subscribe(context.Background(), deadTopic)
		require.NoError(t, err)
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: pubSub, Topic: deadTopic, MaxAttempts: 3,
			InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
		})
		require.NoError(t, err)
		inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: b.store})
		require.NoError(t, err)
		bulk := middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
			var values []string
			var args []any
			for i, msg := range msgs {
				if string(msg.Payload) == "order-poison" {
					return middleware.BatchErrors{msg.UUID: errors.New("card declined")}
				}
				values = append(values, "("+b.ph(i+1)+")")
				args = append(args, middleware.IdempotencyKey(msg.Context()))
			}
			_, err := sqlstore.Tx(ctx).ExecContext(ctx, `INSERT INTO `+b.table("effects")+` (k) VALUES `+strings.Join(values, ", "), args...)
			return err
		})
		router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
		require.NoError(t, err)
		router.AddMiddleware(poison.Middleware, inbox.Middleware)
		router.AddConsumerHandler("charge", topic, pubSub, bulk)
		done := make(chan error, 1)
		go func() { done <- router.Run(context.Background()) }()
		<-router.Running()
		t.Cleanup(func() {
			require.NoError(t, router.Close())
			require.NoError(t, <-done)
			require.NoError(t, pubSub.Close())
		})

		keys := []string{"order-poison"}
		for i := range orders {
			keys = append(keys, fmt.Sprintf("order-%d", i))
		}
		for range 2 {
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
		msgtest.WaitFor(t, "the duplicates answered", func() bool { return inbox.Stats().Duplicates == orders })
		for _, k := range keys[1:] {
			require.Equal(t, 1, b.effects(t, k), k)
		}
		require.Zero(t, b.effects(t, "order-poison"))
		// The dead letter is published before the key is marked dead in
		// the store: wait for the mark.
		msgtest.WaitFor(t, "the poison key marked dead", func() bool {
			r, _ := b.row(t, dedup.Key{Consumer: "charge", Key: "order-poison"})
			return r.status == "dead"
		})
		r, _ := b.row(t, dedup.Key{Consumer: "charge", Key: "order-poison"})
		require.Equal(t, "dead", r.status)
		require.Equal(t, "card declined", r.lastErr.String)
		require.Equal(t, int64(orders), inbox.Stats().Applied)
	})
}
