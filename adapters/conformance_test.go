package adapters_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/crash"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	conformanceKeys   = 300
	conformanceCopies = 3
	// crashAfter is the completed delivery after which the first consumer
	// dies between commit and ack.
	crashAfter = 120
)

// broker is one row of the conformance table.
type broker struct {
	name string
	// url opens the broker with adapters.Open, from this process or a
	// child one; empty for a broker only this process can reach.
	url string
	// open opens a fresh connection to the broker, as a new process
	// would, consuming as group.
	open func(t *testing.T, group string) *adapters.PubSub
	// pending reports how many messages of topic are not yet acknowledged
	// by group; called after the group's consumers have closed.
	pending func(t *testing.T, topic, group string) int
	// cleanup, when set, deletes what the broker keeps for topic and its
	// groups once the test ends.
	cleanup func(t *testing.T, topic string, groups ...string)
	// dropsRetries is set for a broker that drops a message published
	// again with the same idempotency key within its deduplication window
	// (JetStream, by Nats-Msg-Id): the copies never reach the consumer.
	dropsRetries bool
	// topicSuffix ends the topics a test names on this row: ".fifo" for
	// an SQS FIFO queue.
	topicSuffix string
}

// chargeHandler is the one handler value every broker runs: it writes the
// effect through the inbox's transaction and produces one event.
func chargeHandler(effects string) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if _, err := postgres.Tx(ctx).Exec(ctx,
			`INSERT INTO `+effects+` (consumer, key) VALUES ($1, $2)`,
			message.HandlerNameFromCtx(ctx), key); err != nil {
			return nil, err
		}
		charged := message.NewMessage(watermill.NewUUID(), []byte(key))
		charged.Metadata.Set(delivery.IdempotencyKey, "charged/"+key)
		return []*message.Message{charged}, nil
	}
}

// effectsDB is a pool of maxConns connections on a fresh schema, the
// inbox store on it, and the name of an effects table (consumer, key) the
// handlers write.
func effectsDB(t *testing.T, maxConns int32) (*pgxpool.Pool, *postgres.Store, string) {
	t.Helper()
	pool := pgtest.Pool(t, maxConns)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	effects := `"` + schema + `".effects`
	_, err = pool.Exec(context.Background(), `CREATE TABLE `+effects+` (consumer text NOT NULL, key text NOT NULL)`)
	require.NoError(t, err)
	return pool, store, effects
}

// TestConformance runs the same handler, wrapped in the PostgreSQL inbox,
// over every broker: 300 keys each published 3 times; the first consumer
// crashes after a commit and before its ack; a new consumer in the same
// group takes over. Exactly 300 effects, nothing left unacknowledged, and
// 300 distinct produced UUIDs.
func TestConformance(t *testing.T) {
	t.Parallel()
	pool, store, effects := effectsDB(t, 24)
	handler := chargeHandler(effects)

	for _, b := range brokers(t) {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runConformance(t, b, store, pool, effects, handler)
		})
	}
}

func runConformance(t *testing.T, b broker, store *postgres.Store, pool *pgxpool.Pool, effects string, handler message.HandlerFunc) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topicIn, topicOut := "orders_"+id, "charged_"+id
	group, outGroup := "billing_"+id, "audit_"+id
	consumer := "charge_" + b.name
	if b.cleanup != nil {
		t.Cleanup(func() {
			b.cleanup(t, topicIn, group)
			b.cleanup(t, topicOut, outGroup)
		})
	}

	// A reader of the produced events, subscribed before anything is
	// published so that every broker keeps them for it.
	reader := b.open(t, outGroup)
	defer closeQuietly(t, reader)
	produced := collect(t, reader.Subscriber, topicOut)

	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer})
	require.NoError(t, err)

	// The first consumer subscribes before the producer publishes, so
	// that brokers without retention (GoChannel) deliver to it.
	first := b.open(t, group)
	crasher := crash.NewAfterCommit(crashAfter)
	routerA := startRouter(t, first, topicIn, topicOut, consumer, handler, crasher.Middleware, inbox.Middleware)

	for c := 0; c < conformanceCopies; c++ {
		for k := 0; k < conformanceKeys; k++ {
			msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(k)))
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("order-%d", k))
			require.NoError(t, producer.Publisher.Publish(topicIn, msg))
		}
	}

	select {
	case <-crasher.Crashed():
	case <-time.After(2 * time.Minute):
		t.Fatal("the first consumer never reached its crash point")
	}
	// The process dies: its router and its connection go away with the
	// crashed delivery unacknowledged.
	require.NoError(t, routerA.close())
	require.NoError(t, first.Close())

	second := b.open(t, group)
	var lastDelivery atomic.Int64 // unix nanoseconds
	seen := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			lastDelivery.Store(time.Now().UnixNano())
			return h(msg)
		}
	}
	routerB := startRouter(t, second, topicIn, topicOut, consumer, handler, seen, inbox.Middleware)

	countEffects := func() (rows, keys int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM `+effects+` WHERE consumer = $1`, consumer).Scan(&rows, &keys))
		return rows, keys
	}
	require.Eventually(t, func() bool {
		rows, _ := countEffects()
		return rows >= conformanceKeys && produced.distinct() >= conformanceKeys
	}, 3*time.Minute, 50*time.Millisecond, "effects or produced messages missing")
	// Let the second consumer drain what is left (duplicates only) until
	// the broker holds nothing ready and no delivery came for a while
	// (messages prefetched by a client are invisible to some brokers),
	// then stop it and count what the broker still holds.
	require.Eventually(t, func() bool {
		return b.pending(t, topicIn, group) == 0 && time.Since(time.Unix(0, lastDelivery.Load())) > 3*time.Second
	}, 3*time.Minute, 100*time.Millisecond, "messages left unacknowledged")
	require.NoError(t, routerB.close())
	require.NoError(t, second.Close())

	rows, keys := countEffects()
	require.Equal(t, conformanceKeys, rows, "exactly one effect per key")
	require.Equal(t, conformanceKeys, keys)
	require.Equal(t, 0, b.pending(t, topicIn, group), "every delivery acknowledged in the end")
	require.Equal(t, conformanceKeys, produced.distinct(), "one produced message per key, always the same UUID")
	require.Positive(t, inbox.Stats().Duplicates)
}

// router is a running router and the way to stop it.
type router struct {
	r    *message.Router
	done chan error
	stop context.CancelFunc
}

func (r router) close() error {
	r.stop()
	return <-r.done
}

func startRouter(t *testing.T, ps *adapters.PubSub, topicIn, topicOut, name string, h message.HandlerFunc, mws ...message.HandlerMiddleware) router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(mws...)
	r.AddHandler(name, topicIn, ps.Subscriber, topicOut, ps.Publisher, h)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		cancel()
		t.Fatalf("router stopped at start: %v", err)
	}
	return router{r: r, done: done, stop: cancel}
}

// produced collects the UUIDs of messages on a topic.
type producedSet struct {
	mu    sync.Mutex
	uuids map[string]int
	total atomic.Int64
}

func (p *producedSet) distinct() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.uuids)
}

func collect(t *testing.T, sub message.Subscriber, topic string) *producedSet {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	p := &producedSet{uuids: map[string]int{}}
	go func() {
		for m := range msgs {
			p.mu.Lock()
			p.uuids[m.UUID]++
			p.mu.Unlock()
			p.total.Add(1)
			m.Ack()
		}
	}()
	return p
}

func closeQuietly(t *testing.T, ps *adapters.PubSub) {
	t.Helper()
	if err := ps.Close(); err != nil {
		t.Logf("close %s: %v", ps.Scheme, err)
	}
}
