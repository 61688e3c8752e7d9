package redis_test

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/middleware"
)

// A payment handler behind a lease-mode inbox on Redis: each key is charged
// once, however often the broker delivers it, as long as Redis remembers
// it. The handler also passes the key to the payment provider, whose own
// idempotency covers what Redis may forget (see the package
// documentation).
//
// It needs a running Redis and runs until cancelled, so it is compiled but
// not run.
func Example() {
	rdb := goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close() // the store does not own the client

	store, err := redis.New(redis.Config{Client: rdb, Prefix: "payments:"})
	if err != nil {
		panic(err)
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		LeaseStore: store,
		Consumer:   "payments",
	})
	if err != nil {
		panic(err)
	}

	// Any Watermill subscriber will do; the GoChannel keeps the example
	// self-contained.
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(inbox.Middleware)
	chargeCard := func(ctx context.Context, idempotencyKey string, order []byte) error {
		fmt.Printf("charging %s with Idempotency-Key %s\n", order, idempotencyKey)
		return nil
	}
	router.AddConsumerHandler("charge", "orders.placed", pubSub, func(msg *message.Message) error {
		return chargeCard(msg.Context(), middleware.IdempotencyKey(msg.Context()), msg.Payload)
	})
	if err := router.Run(context.Background()); err != nil {
		panic(err)
	}
}
