package middleware_test

import (
	"context"
	"maps"
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

	r := runChargeRouter(t, ctx, b, poison.Middleware, inbox.Middleware)
	publish := func(msg *message.Message) {
		t.Helper()
		if !r.publish(t, msg, time.Minute) {
			t.Fatalf("message %s was never acked", msg.UUID)
		}
	}

	empty := message.NewMessage(watermill.NewUUID(), []byte("charge ?"))
	empty.Metadata.Set(dlv.IdempotencyKey, "")
	good := delivery("order-good", "charge good")
	publish(empty)
	publish(good)

	require.Equal(t, map[string]int{empty.UUID: 1, good.UUID: 1}, r.deliveries(),
		"the empty-key message was settled on its first delivery, before the good one came")
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

	require.Equal(t, int32(1), r.calls.Load(), "the handler ran for the good message only")
	require.Equal(t, 1, b.effects(t), "one effect: the good message's")
	require.Equal(t, "done", b.status(t, "charge", "order-good"))
	require.Equal(t, -1, b.attempts(t, "charge", empty.UUID), "no record under the UUID")
	var records int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".inbox`).Scan(&records))
	require.Equal(t, 1, records, "the good key's record only")
	require.Equal(t, middleware.PoisonStats{DeadLettered: 1}, poison.Stats())
	require.Equal(t, middleware.InboxStats{Applied: 1}, inbox.Stats())
}

// chargeRouter is a router on a GoChannel whose Publish returns once the
// router acked the message, so that the message behind is sent only after
// the one before was settled; its handler "charge" writes the key's effect
// behind the given middlewares, and it counts deliveries by UUID.
type chargeRouter struct {
	pubSub *gochannel.GoChannel
	calls  atomic.Int32 // handler runs

	mu    sync.Mutex
	count map[string]int // deliveries by message UUID
}

// runChargeRouter runs a chargeRouter until the test ends.
func runChargeRouter(t *testing.T, ctx context.Context, b txBackend, mw ...message.HandlerMiddleware) *chargeRouter {
	t.Helper()
	logger := watermill.NopLogger{}
	r := &chargeRouter{
		pubSub: gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger),
		count:  map[string]int{},
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(append([]message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			r.mu.Lock()
			r.count[msg.UUID]++
			r.mu.Unlock()
			return h(msg)
		}
	}}, mw...)...)
	router.AddConsumerHandler("charge", "payments", r.pubSub, func(msg *message.Message) error {
		r.calls.Add(1)
		return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, r.pubSub.Close())
	})
	return r
}

// publish publishes msg to "payments" and reports whether the router
// acked it within timeout.
func (r *chargeRouter) publish(t *testing.T, msg *message.Message, timeout time.Duration) bool {
	t.Helper()
	published := make(chan error, 1)
	go func() { published <- r.pubSub.Publish("payments", msg) }()
	select {
	case err := <-published:
		require.NoError(t, err)
		return true
	case <-time.After(timeout):
		return false
	}
}

// deliveries returns the deliveries so far, by message UUID.
func (r *chargeRouter) deliveries() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return maps.Clone(r.count)
}
