package middleware_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestEmptyIdempotencyKeyIsDeadLetteredAtOnce: a message whose
// idempotency_key metadata is present but empty, through Poison
// (MaxAttempts 3, the dlq table) and the PostgreSQL transactional inbox on
// a router, is dead-lettered on its first delivery, as a permanent key
// error that says the key is empty, without running the handler and
// without an inbox record; it does not fall back to the UUID. The healthy
// message published behind it is applied once.
func TestEmptyIdempotencyKeyIsDeadLetteredAtOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	b := postgresBackendIn(t, pool, schema)
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	dead, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "payments.dlq", MaxAttempts: 3,
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store})

	// Publish returns once the router acked the message: the one behind
	// is sent only after the one before was settled.
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	var (
		mu         sync.Mutex
		deliveries = map[string]int{} // by message UUID
		calls      atomic.Int32
	)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			mu.Lock()
			deliveries[msg.UUID]++
			mu.Unlock()
			return h(msg)
		}
	}, poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		calls.Add(1)
		return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, pubSub.Close())
	})
	publish := func(msg *message.Message) {
		t.Helper()
		published := make(chan error, 1)
		go func() { published <- pubSub.Publish("payments", msg) }()
		select {
		case err := <-published:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Fatalf("message %s was never acked", msg.UUID)
		}
	}

	empty := message.NewMessage(watermill.NewUUID(), []byte("charge ?"))
	empty.Metadata.Set(dlv.IdempotencyKey, "")
	good := delivery("order-good", "charge good")
	publish(empty)
	publish(good)

	mu.Lock()
	require.Equal(t, map[string]int{empty.UUID: 1, good.UUID: 1}, deliveries,
		"the empty-key message was settled on its first delivery, before the good one came")
	mu.Unlock()
	entries, err := dead.List(ctx, dlq.Filter{})
	require.NoError(t, err)
	require.Len(t, entries, 1, "exactly one dead letter")
	e := entries[0]
	require.Equal(t, empty.UUID, e.UUID)
	require.True(t, e.Permanent, "a key error is permanent")
	require.Contains(t, e.Error, middleware.ErrEmptyKey.Error())
	require.Contains(t, e.Error, `"idempotency_key" is present but empty`)
	require.Equal(t, 1, e.Attempts, "dead-lettered at its first attempt, not after MaxAttempts")
	require.Empty(t, e.Key, "no key was derived: not the UUID")
	require.Equal(t, "charge", e.Consumer)
	require.Equal(t, "payments", e.Topic)
	require.Equal(t, []byte("charge ?"), e.Payload)
	k, ok := e.Metadata[dlv.IdempotencyKey]
	require.True(t, ok, "the copy keeps the empty field, for the operator to see")
	require.Empty(t, k)

	require.Equal(t, int32(1), calls.Load(), "the handler ran for the good message only")
	require.Equal(t, 1, b.effects(t), "one effect: the good message's")
	require.Equal(t, "done", b.status(t, "charge", "order-good"))
	require.Equal(t, -1, b.attempts(t, "charge", empty.UUID), "no record under the UUID")
	var records int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".inbox`).Scan(&records))
	require.Equal(t, 1, records, "the good key's record only")
	require.Equal(t, middleware.PoisonStats{DeadLettered: 1}, poison.Stats())
	require.Equal(t, middleware.InboxStats{Applied: 1}, inbox.Stats())
}
