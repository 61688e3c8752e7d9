package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
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
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// deliveryCounter is a subscriber that stamps each delivery with the
// broker's count of it, as a RabbitMQ quorum queue or SQS does: 1 on the
// first, one more on each redelivery after a nack.
type deliveryCounter struct {
	message.Subscriber
	mu    sync.Mutex
	count map[string]int
}

func (b *deliveryCounter) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := b.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range in {
			b.mu.Lock()
			b.count[msg.UUID]++
			msg.Metadata.Set(dlv.Attempts, strconv.Itoa(b.count[msg.UUID]))
			b.mu.Unlock()
			select {
			case out <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// TestAlwaysFailingRunsTheHorizonOnce: a message that always fails, on a
// broker that counts its deliveries, under MaxAttempts 2 and three delays
// (horizon 5), with the inbox counting attempts: the handler runs exactly
// 5 times, each delay is waited once and in turn (never the first twice),
// and the dead letter, the inbox's record and the parked row agree on the
// count at every step. Both with the immediate attempts in process (the
// default) and nacked for redelivery.
func TestAlwaysFailingRunsTheHorizonOnce(t *testing.T) {
	t.Parallel()
	delays := []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond}
	for _, tc := range []struct {
		name      string
		inProcess int
	}{{"in_process", 0}, {"redelivered", middleware.NoInProcessRetries}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := pgtest.Pool(t, 8)
			schema := pgtest.Schema(t, pool)
			cfg := sqlschema.Config{Schema: schema}
			store, err := postgres.New(pool, postgres.Config{Schema: schema})
			require.NoError(t, err)
			inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "ledger", Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			dead, err := dlq.NewPublisher(pool, cfg)
			require.NoError(t, err)
			parked, err := retry.NewStore(pool, cfg)
			require.NoError(t, err)
			poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dead, Retries: parked,
				MaxAttempts: 2, Delays: delays, InProcessRetries: tc.inProcess, InitialBackoff: time.Millisecond,
				MaxBackoff: time.Millisecond, Logger: watermill.NopLogger{}})
			require.NoError(t, err)

			gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
			t.Cleanup(func() { require.NoError(t, gc.Close()) })
			sub, err := poison.Subscriber(&deliveryCounter{Subscriber: gc, count: map[string]int{}})
			require.NoError(t, err)
			var (
				mu     sync.Mutex
				runs   int
				seen   []int           // the attempts a handed-back message says failed before it
				waited []time.Duration // the delay of the park that handed each back
			)
			router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			require.NoError(t, err)
			router.AddMiddleware(poison.Middleware, inbox.Middleware)
			router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
				mu.Lock()
				defer mu.Unlock()
				runs++
				n, _ := strconv.Atoi(msg.Metadata.Get(dlv.RetryAttempts))
				seen = append(seen, n)
				if id := msg.Metadata.Get(dlv.RetryID); id != "" {
					var ms float64
					require.NoError(t, pool.QueryRow(msg.Context(), `SELECT extract(epoch FROM due_at - last_failed_at) * 1000
						FROM "`+schema+`".retries WHERE id = $1`, id).Scan(&ms))
					waited = append(waited, time.Duration(ms*float64(time.Millisecond)).Round(time.Millisecond))
				}
				return errors.New("ledger refuses")
			})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- router.Run(ctx) }()
			<-router.Running()
			t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			msg.Metadata.Set(dlv.IdempotencyKey, "order-1")
			require.NoError(t, gc.Publish("payments", msg))

			var attempts int
			var reason string
			require.Eventually(t, func() bool {
				err := pool.QueryRow(context.Background(), `SELECT attempts, error FROM "`+schema+`".dlq`).Scan(&attempts, &reason)
				return err == nil
			}, 30*time.Second, 20*time.Millisecond, "dead-lettered")
			mu.Lock()
			defer mu.Unlock()
			t.Logf("runs %d, attempts seen %v, delays %v, dead letter attempts %d", runs, seen, waited, attempts)
			require.Equal(t, 5, runs, "MaxAttempts 2 + 3 delays: five runs, not one more")
			require.Equal(t, 5, attempts, "the dead letter counts the five")
			require.Equal(t, "ledger refuses", reason)
			var inboxAttempts int
			require.NoError(t, pool.QueryRow(context.Background(), `SELECT attempts FROM "`+schema+`".inbox_failures WHERE key = 'order-1'`).
				Scan(&inboxAttempts))
			require.Equal(t, 5, inboxAttempts, "the inbox counts the same five")
			// The parked message is handed back after each delay in turn,
			// never the first twice, saying how many attempts failed before
			// it: 2, 3, 4.
			require.Equal(t, []int{0, 0, 2, 3, 4}, seen)
			require.Equal(t, delays, waited)
		})
	}
}
