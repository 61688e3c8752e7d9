package middleware_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestDeadLettersOnAStarvedPool: the README's wiring on a pool of 4
// connections (pgxpool's default on 2 cores), the inbox, the dead-letter
// table and Poison sharing it, and 16 messages refused at once with a
// permanent error: each dead letter is written in the claim's transaction
// on the connection that transaction holds, never asking the pool for a
// second one, so that all 16 are dead-lettered, at once and with their
// own reason, each after its one attempt.
func TestDeadLettersOnAStarvedPool(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge", Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	dead, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dead})
	require.NoError(t, err)

	const n = 16
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: n}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	var runs atomic.Int32
	const conns = 4
	full := make(chan struct{})
	router.AddConsumerHandler("charge", "orders", gc, func(msg *message.Message) error {
		if r := runs.Add(1); r == conns {
			close(full)
		} else if r < conns {
			<-full // every connection held by a handler's transaction at once
		}
		return middleware.Permanent(fmt.Errorf("order %s refused", middleware.IdempotencyKey(msg.Context())))
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		msg.Metadata.Set(dlv.IdempotencyKey, fmt.Sprintf("order-%d", i))
		require.NoError(t, gc.Publish("orders", msg))
	}
	count := func(q string) (c int) {
		require.NoError(t, pool.QueryRow(context.Background(), q).Scan(&c))
		return c
	}
	require.Eventually(t, func() bool { return count(`SELECT count(*) FROM "`+schema+`".dlq`) == n }, 30*time.Second,
		50*time.Millisecond, "every message dead-lettered")
	require.Equal(t, n, count(`SELECT count(*) FROM "`+schema+`".dlq WHERE attempts = 1 AND error LIKE 'order order-% refused'`),
		"each with its own reason, after its one attempt")
	require.Equal(t, int32(n), runs.Load(), "each handler ran once")
	st := poison.Stats()
	require.Equal(t, int64(n), st.DeadLettered)
	require.Zero(t, st.DeadLetterFailed, "no dead-letter write waited for a second connection")
}
