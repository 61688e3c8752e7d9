package middleware_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/redistest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// turnGate is the outermost router middleware of a test that hands out
// deliveries one at a time: a delivery waits for a turn before it runs,
// and its outcome is sent on ended once the chain behind it has returned.
// Between two turns no delivery runs, so the test can stop or start a
// service without one being caught half way.
type turnGate struct {
	turns chan struct{}
	ended chan error
}

func newTurnGate() *turnGate {
	return &turnGate{turns: make(chan struct{}), ended: make(chan error, 1)}
}

func (g *turnGate) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		select {
		case <-g.turns:
		case <-msg.Context().Done():
			return nil, msg.Context().Err()
		}
		out, err := h(msg)
		g.ended <- err
		return out, err
	}
}

// deliver lets one delivery run and returns how it ended: nil when the
// router acks it.
func (g *turnGate) deliver(t *testing.T) error {
	t.Helper()
	select {
	case g.turns <- struct{}{}:
	case <-time.After(time.Minute):
		t.Fatal("no delivery came to take its turn")
	}
	select {
	case err := <-g.ended:
		return err
	case <-time.After(time.Minute):
		t.Fatal("the delivery did not end")
		return nil
	}
}

// TestRedisLeaseStoreDownFailClosedIsNotPoison: with the lease store's
// Redis down under FailClosed (its default), Poison (MaxAttempts 2, the
// dlq table on PostgreSQL, OutageHold 100 ms) in front of a lease-mode
// inbox holds every delivery of a healthy message as the
// infrastructure's fault, then nacks it once: delivered five times, it is
// never dead-lettered, its handler never runs, and Poison counts each
// wait in Stats().Infrastructure, none toward its attempts. Once Redis is back, the next delivery runs the handler once
// and its effect, a row in PostgreSQL, is written once; a producer's
// retry of the key is a duplicate, and the DLQ stays empty.
func TestRedisLeaseStoreDownFailClosedIsNotPoison(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := redistest.StartServer(t)
	client := srv.Client(t)
	store, err := redis.New(redis.Config{Client: client}) // FailClosed, the default
	require.NoError(t, err)

	pool := pgtest.Pool(t, 4)
	schema := pgtest.Schema(t, pool)
	q := `"` + schema + `"`
	_, err = pool.Exec(ctx, `CREATE TABLE `+q+`.effects (key text NOT NULL, uuid text NOT NULL)`)
	require.NoError(t, err)
	effects := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+q+`.effects`).Scan(&n))
		return n
	}
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	dead, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	deadLetters := func() []dlq.Entry {
		entries, err := dead.List(ctx, dlq.Filter{})
		require.NoError(t, err)
		return entries
	}

	// A short hold: each delivery waits through the outage in process
	// for 100 ms, then is nacked once.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "payments.dlq", MaxAttempts: 2,
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, OutageHold: 100 * time.Millisecond,
	})
	require.NoError(t, err)
	inbox := newInbox(t, middleware.InboxConfig{LeaseStore: store})

	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	gate := newTurnGate()
	router.AddMiddleware(gate.middleware, poison.Middleware, inbox.Middleware)
	var calls atomic.Int32
	router.AddConsumerHandler("charge", "payments", pubSub, func(msg *message.Message) error {
		calls.Add(1)
		_, err := pool.Exec(msg.Context(), `INSERT INTO `+q+`.effects (key, uuid) VALUES ($1, $2)`,
			middleware.IdempotencyKey(msg.Context()), msg.UUID)
		return err
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

	srv.Stop()
	require.NoError(t, pubSub.Publish("payments", delivery("pay-1", "charge 1")))
	const outageDeliveries = 5 // more than MaxAttempts
	for i := range outageDeliveries {
		err := gate.deliver(t)
		require.Error(t, err, "delivery %d is nacked while Redis is down", i+1)
		require.ErrorIs(t, err, redis.ErrUnavailable, "delivery %d", i+1)
		require.True(t, middleware.IsInfrastructure(err), "delivery %d: %v", i+1, err)
	}
	held := poison.Stats()
	require.GreaterOrEqual(t, held.Infrastructure, int64(outageDeliveries), "every delivery was tried again in process while held")
	held.Infrastructure = 0
	require.Equal(t, middleware.PoisonStats{}, held,
		"every delivery was the infrastructure's fault: none retried as an attempt, none dead-lettered")
	require.Zero(t, calls.Load(), "the handler never ran")
	require.Zero(t, effects())
	require.Empty(t, deadLetters(), "a healthy message is never dead-lettered for an outage")

	// Back with no delivery running: the next one finds Redis up.
	srv.Start()
	msgtest.WaitFor(t, "the Redis client to reconnect", func() bool { return client.Ping(ctx).Err() == nil })
	require.NoError(t, gate.deliver(t), "the delivery after the outage is applied and acked")
	require.Equal(t, int32(1), calls.Load(), "the handler ran once")
	require.Equal(t, 1, effects(), "the effect was written once")

	// A producer's retry of the key, with a UUID of its own.
	require.NoError(t, pubSub.Publish("payments", delivery("pay-1", "charge 1")))
	require.NoError(t, gate.deliver(t), "the retry is acked as a duplicate")
	require.Equal(t, int32(1), calls.Load(), "a duplicate does not run the handler")
	require.Equal(t, 1, effects())
	is := inbox.Stats()
	require.Equal(t, int64(1), is.Applied)
	require.Equal(t, int64(1), is.Duplicates)
	require.Zero(t, is.Failed, "no attempt failed")
	after := poison.Stats()
	after.Infrastructure = 0
	require.Equal(t, middleware.PoisonStats{}, after)
	require.Empty(t, deadLetters())
	var key string
	require.NoError(t, pool.QueryRow(ctx, `SELECT key FROM `+q+`.effects`).Scan(&key))
	require.Equal(t, "pay-1", key, "the handler ran under the message's key")
}
