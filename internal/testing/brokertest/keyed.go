package brokertest

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

// PublishKeyed publishes versions 1 to perKey of each of keys keys
// ("key-00", ...), interleaved, each with its key as partition key and its
// own idempotency key, the version as payload.
func PublishKeyed(t testing.TB, pub message.Publisher, topic string, keys, perKey int) {
	t.Helper()
	var msgs []*message.Message
	for v := 1; v <= perKey; v++ {
		for k := range keys {
			key := fmt.Sprintf("key-%02d", k)
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d", v))
			msg.Metadata.Set(delivery.PartitionKey, key)
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("%s/v%d", key, v))
			msgs = append(msgs, msg)
		}
	}
	require.NoError(t, pub.Publish(topic, msgs...))
}

// InOrder is 1 to n.
func InOrder(n int) []int {
	want := make([]int, n)
	for i := range want {
		want[i] = i + 1
	}
	return want
}

// RequireAppliedInOrder reads the (key, version) rows query returns, in
// the order they were applied, and checks that each of keys keys has its
// versions 1 to perKey once each, in order. It returns each key's
// versions.
func RequireAppliedInOrder(t testing.TB, pool *pgxpool.Pool, query string, keys, perKey int) map[string][]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), query)
	require.NoError(t, err)
	applied := map[string][]int{}
	for rows.Next() {
		var key string
		var version int
		require.NoError(t, rows.Scan(&key, &version))
		applied[key] = append(applied[key], version)
	}
	require.NoError(t, rows.Err())
	require.Len(t, applied, keys)
	for key, got := range applied {
		require.Equal(t, InOrder(perKey), got, "%s: each version once, in the order published", key)
	}
	return applied
}

// RunRouter runs a router with mw and handler on topic until done says
// so, then closes it and sub.
func RunRouter(t testing.TB, sub message.Subscriber, topic string, logger watermill.LoggerAdapter, mw []message.HandlerMiddleware, handler message.NoPublishHandlerFunc, done func() bool) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(mw...)
	router.AddConsumerHandler("ordered", topic, sub, handler)
	errs := make(chan error, 1)
	go func() { errs <- router.Run(context.Background()) }()
	<-router.Running()
	require.Eventually(t, done, time.Minute, 10*time.Millisecond)
	require.NoError(t, router.Close())
	require.NoError(t, <-errs)
	require.NoError(t, sub.Close())
}

// KeyedRun is what a handler of PublishKeyed's messages observed.
type KeyedRun struct {
	// Order is each key's versions in the order they were handled.
	Order map[string][]int
	// MaxRunning is the most handler calls that ran at once.
	MaxRunning int
}

// ConsumeKeyed consumes the keys × perKey messages PublishKeyed published
// to topic from sub, through a router whose handler works a little, and
// returns what it observed, having checked that each message was handled
// once, never two of a key at once, and messages of different keys at
// once, at most limit. The caller checks the order its broker promises.
func ConsumeKeyed(t testing.TB, sub message.Subscriber, topic string, logger watermill.LoggerAdapter, keys, perKey, limit int) KeyedRun {
	t.Helper()
	var (
		mu                         sync.Mutex
		run                        = KeyedRun{Order: map[string][]int{}}
		running, overlaps, handled int
		perKeyNow                  = map[string]int{}
	)
	RunRouter(t, sub, topic, logger, nil, func(msg *message.Message) error {
		key := delivery.PartitionKeyOf(msg)
		v, _ := strconv.Atoi(string(msg.Payload)) // 0, out of order, if not a version
		mu.Lock()
		running++
		run.MaxRunning = max(run.MaxRunning, running)
		perKeyNow[key]++
		if perKeyNow[key] > 1 {
			overlaps++
		}
		run.Order[key] = append(run.Order[key], v)
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		mu.Lock()
		running--
		perKeyNow[key]--
		handled++
		mu.Unlock()
		return nil
	}, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return handled >= keys*perKey
	})
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, keys*perKey, handled, "each message handled once")
	require.Zero(t, overlaps, "messages handled while another of their key ran")
	require.Len(t, run.Order, keys)
	require.LessOrEqual(t, run.MaxRunning, limit)
	require.Greater(t, run.MaxRunning, 1, "messages of different keys handled at once")
	return run
}

// ConsumeBatches consumes the keys × perKey messages PublishKeyed
// published to topic from sub, through the PostgreSQL inbox in batch mode
// (batch) around a middleware.BatchHandler that inserts a batch's effects
// with one statement and works a little, and checks that each message was
// applied once, each key's versions in the order published, in batches
// of more than one message (fewer calls than messages). It returns the
// batch sizes.
func ConsumeBatches(t testing.TB, sub message.Subscriber, topic string, logger watermill.LoggerAdapter, keys, perKey int, batch middleware.BatchConfig) []int {
	t.Helper()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+effects+` (seq bigserial PRIMARY KEY, key text NOT NULL, version int NOT NULL)`)
	require.NoError(t, err)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "ledger", Tuning: middleware.InboxTuning{Batch: batch}})
	require.NoError(t, err)

	var (
		mu    sync.Mutex
		sizes []int
	)
	count := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n))
		return n
	}
	messages := keys * perKey
	RunRouter(t, sub, topic, logger, []message.HandlerMiddleware{inbox.Middleware}, middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
		mu.Lock()
		sizes = append(sizes, len(msgs))
		mu.Unlock()
		ks := make([]string, len(msgs))
		vs := make([]string, len(msgs))
		for i, msg := range msgs {
			ks[i], vs[i] = delivery.PartitionKeyOf(msg), string(msg.Payload)
		}
		// Some work, so that deliveries queue up behind the batch.
		time.Sleep(5 * time.Millisecond)
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, version) SELECT unnest($1::text[]), unnest($2::text[])::int`, ks, vs)
		return err
	}), func() bool { return count() >= messages })

	RequireAppliedInOrder(t, pool, `SELECT key, version FROM `+effects+` ORDER BY seq`, keys, perKey)
	require.Equal(t, int64(messages), inbox.Stats().Applied)
	mu.Lock()
	defer mu.Unlock()
	largest, total := 0, 0
	for _, n := range sizes {
		largest = max(largest, n)
		total += n
	}
	require.Equal(t, messages, total, "every message in one call")
	require.Greater(t, largest, 1, "batches of more than one message")
	require.Less(t, len(sizes), messages, "fewer calls than messages")
	return slices.Clone(sizes)
}
