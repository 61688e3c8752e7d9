package adapters_test

import (
	"context"
	"fmt"
	"hash/crc32"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters/kafka/embedded"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/internal/testing/proctest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	// batchMaxMessages is the consumers' Batch.MaxMessages.
	batchMaxMessages = 16
	// batchKeys is how many keys the crash test publishes, batchKills how
	// often it SIGKILLs the consumer before it lets one finish.
	batchKeys  = 480 // a multiple of batchKills+1
	batchKills = 4
)

// batchConsumer is a consumer process of the batch crash test: the
// standard stack with the PostgreSQL inbox in batch mode around a handler
// that inserts one effect row per key, with its process id, in the
// batch's transaction, then works a little. Subscriptions router handlers
// consume the topic as one consumer, so that a broker that hands a
// subscription one message at a time (RabbitMQ) still has deliveries to
// batch. Its database connections carry App as their application name,
// for the parent to see its open transactions.
type batchConsumer struct {
	proctest.Stack
	App           string
	Subscriptions int
	MaxAttempts   int
	// Bulk writes the effects of a batch with one multi-row INSERT
	// through middleware.BatchHandler.
	Bulk bool
}

var batchRole = proctest.NewRole("batch", func(cfg batchConsumer, term <-chan os.Signal) error {
	c := &proctest.Consumer{
		Stack: cfg.Stack, MaxConns: 12, Verbose: true, StrictClose: true, Subscriptions: cfg.Subscriptions,
		Pool: func(pc *pgxpool.Config) { pc.ConnConfig.RuntimeParams["application_name"] = cfg.App },
		Poison: &middleware.PoisonConfig{Topic: "dlq", MaxAttempts: cfg.MaxAttempts,
			InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond},
		Inbox: middleware.InboxConfig{Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: batchMaxMessages, Linger: 5 * time.Millisecond, Parallel: 2}}},
	}
	effects := cfg.Table("effects")
	pid := os.Getpid()
	if cfg.Bulk {
		return c.Run(term, middleware.BatchHandler(func(ctx context.Context, msgs []*message.Message) error {
			keys := make([]string, len(msgs))
			for i, msg := range msgs {
				keys[i] = middleware.IdempotencyKey(msg.Context())
			}
			if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, pid) SELECT unnest($1::text[]), $2`, keys, pid); err != nil {
				return err
			}
			select {
			case <-time.After(time.Duration(10+crc32.ChecksumIEEE([]byte(keys[0]))%21) * time.Millisecond):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}))
	}
	return c.Run(term, func(msg *message.Message) error {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if _, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (key, pid) VALUES ($1, $2)`, key, pid); err != nil {
			return err
		}
		select {
		case <-time.After(time.Duration(10+crc32.ChecksumIEEE([]byte(key))%21) * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
})

// TestBatchCrashProcesses: on RabbitMQ (16 subscriptions of one queue),
// NATS JetStream (one subscription holding two batches' worth, 32
// messages; on the machine's server and on an embedded one) and Kafka
// (one key-parallel subscription), 480 keys consumed by a process
// whose PostgreSQL inbox commits up to 16 deliveries in one transaction,
// SIGKILLed four times mid-stream, each time while it holds a batch's
// transaction open with writes in it, and restarted at once. The poison
// middleware allows one attempt more than there are kills: a kill counts
// at most one attempt of each key it finds in flight. In the end every key
// is applied exactly once with one attempt recorded, no start count is
// left behind, nothing is dead-lettered, and the broker holds nothing
// unacknowledged.
func TestBatchCrashProcesses(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		subscriptions int
		broker        func(t *testing.T) broker
	}{
		{"amqp", 16, func(t *testing.T) broker {
			b := amqpBroker(t)
			b.url += "?prefetch=4"
			return b
		}},
		{"nats", 1, func(t *testing.T) broker {
			b := natsBroker(t)
			b.url = withParams(b.url, fmt.Sprintf("max_in_flight=%d", 2*batchMaxMessages))
			return b
		}},
		{"nats_embedded", 1, func(t *testing.T) broker {
			b := natsEmbeddedBroker(t)
			b.url = withParams(b.url, fmt.Sprintf("max_in_flight=%d", 2*batchMaxMessages))
			return b
		}},
		{"kafka", 1, func(t *testing.T) broker {
			// A killed member leaves its group a session timeout later:
			// a short one keeps the test short.
			cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 4, GroupMinSessionTimeout: time.Second})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, cluster.Close()) })
			return kafkaRow(cluster.Addrs(), "kafka", "session_timeout=2s")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			runBatchCrash(t, c.broker(t), c.subscriptions, false)
		})
	}
}

// TestBatchHandlerCrashProcesses is TestBatchCrashProcesses with the
// effects of each batch written by one multi-row INSERT of a
// middleware.BatchHandler, on RabbitMQ and Kafka: four SIGKILLs with a
// batch open, then every key applied exactly once, nothing dead-lettered,
// nothing left on the broker.
func TestBatchHandlerCrashProcesses(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		subscriptions int
		broker        func(t *testing.T) broker
	}{
		{"amqp", 16, func(t *testing.T) broker {
			b := amqpBroker(t)
			b.url += "?prefetch=4"
			return b
		}},
		{"kafka", 1, func(t *testing.T) broker {
			cluster, err := embedded.Start(embedded.Config{DefaultPartitions: 4, GroupMinSessionTimeout: time.Second})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, cluster.Close()) })
			return kafkaRow(cluster.Addrs(), "kafka", "session_timeout=2s")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			runBatchCrash(t, c.broker(t), c.subscriptions, true)
		})
	}
}

func runBatchCrash(t *testing.T, b broker, subscriptions int, bulk bool) {
	id := pgtest.Name(t)
	topic, group, producer := processTopic(t, b, id, "ledger_", "ledger_")
	db := newProcessDB(t)
	db.Exec(t, `ALTER TABLE {S}.effects ADD COLUMN pid integer NOT NULL, ADD COLUMN tx xid8 NOT NULL DEFAULT pg_current_xact_id()`)
	cfg := batchConsumer{
		Stack: db.Stack(b.url, group, topic, "ledger"),
		App:   id, Subscriptions: subscriptions, MaxAttempts: batchKills + 1, Bulk: bulk,
	}

	// The first consumer subscribes before anything is published, so that
	// RabbitMQ has its queue.
	c := batchRole.Start(t, cfg)
	// The keys go out in batchKills+1 chunks, the next one just before
	// each kill is aimed, so that work is always left for the kill to cut,
	// however fast or slow the machine (with every key published at once,
	// a loaded machine overshot each kill's mark and the last ones found
	// nothing open).
	chunk := batchKeys / (batchKills + 1)
	publish := func(n int) {
		for k := n * chunk; k < (n+1)*chunk; k++ {
			key := fmt.Sprintf("entry-%d", k)
			msg := message.NewMessage(watermill.NewUUID(), []byte(key))
			msg.Metadata.Set(delivery.IdempotencyKey, key)
			msg.Metadata.Set(delivery.PartitionKey, key)
			require.NoError(t, producer.Publisher.Publish(topic, msg))
		}
	}
	publish(0)

	effects := func() int { return db.Count(t, `SELECT count(*) FROM {S}.effects`) }
	type kill struct{ effects, openTx, dead int }
	var kills []kill
	for k := 1; k <= batchKills; k++ {
		want := (k-1)*chunk + chunk/2
		require.Eventually(t, func() bool { return effects() >= want }, time.Minute, 5*time.Millisecond,
			"kill %d: fewer than %d effects; output:\n%s", k, want, c.Out.String())
		publish(k)
		// A transaction of the consumer that wrote (a batch's claim, its
		// effects) and has not ended.
		var open int
		require.Eventually(t, func() bool {
			open = db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND backend_xid IS NOT NULL`, cfg.App)
			return open > 0
		}, time.Minute, time.Millisecond, "kill %d: no batch open", k)
		c.Kill()
		kills = append(kills, kill{effects: effects(), openTx: open, dead: db.Count(t, `SELECT count(*) FROM {S}.dlq`)})
		require.Less(t, kills[len(kills)-1].effects, batchKeys, "kill %d came after the end", k)
		c = batchRole.Start(t, cfg)
	}
	require.Eventually(t, func() bool { return effects() >= batchKeys }, time.Minute, 10*time.Millisecond,
		"the last consumer applies the rest; output:\n%s", c.Out.String())
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 50*time.Millisecond,
		"everything acknowledged")
	stats := c.Stop(t, restartShutdownBound)

	require.Equal(t, batchKeys, effects(), "exactly one effect per key")
	require.Equal(t, batchKeys, db.Count(t, `SELECT count(DISTINCT key) FROM {S}.effects`))
	require.Equal(t, batchKeys, db.Count(t, `SELECT count(*) FROM {S}.inbox WHERE consumer = 'ledger' AND status = 'done'`))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.inbox i LEFT JOIN {S}.inbox_failures f USING (consumer, key) WHERE COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) <> 1 OR f.last_error IS NOT NULL OR i.status <> 'done'`),
		"no failure recorded")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.inbox_starts`), "no start count left behind")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM {S}.dlq`), "nothing dead-lettered")
	require.Zero(t, stats.Poison.DeadLettered)
	require.Zero(t, stats.Inbox.CrashLooped)
	require.Zero(t, stats.Inbox.Failed)
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	// The transaction that wrote each effect: deliveries did share them.
	largest := db.Count(t, `SELECT max(n) FROM (SELECT count(*) AS n FROM {S}.effects GROUP BY tx) AS per_tx`)
	require.Greater(t, largest, 1, "effects committed together")
	txs := db.Count(t, `SELECT count(DISTINCT tx) FROM {S}.effects`)
	byProcess := db.Count(t, `SELECT count(DISTINCT pid) FROM {S}.effects`)
	t.Logf("batch crash on %s: %d keys, %d SIGKILLs with a batch open (effects, open transactions, dead letters at each: %+v); "+
		"effects applied by %d processes in %d transactions (the largest held %d); the last consumer: %d applied, %d duplicates, %d nacked for the infrastructure; "+
		"%d effects, 0 dead letters, 0 left on the broker",
		b.name, batchKeys, len(kills), kills, byProcess, txs, largest, stats.Inbox.Applied, stats.Inbox.Duplicates, stats.Inbox.Infrastructure,
		effects())
}

// batchSizes records the size of every batch a PostgreSQL store claims.
type batchSizes struct {
	*postgres.Store
	mu      sync.Mutex
	largest int
}

func (s *batchSizes) InboxBeginClaimBatch(ctx context.Context, consumer string, keys []string, window time.Duration) (dedup.InboxTx, []dedup.Claim, error) {
	s.mu.Lock()
	s.largest = max(s.largest, len(keys))
	s.mu.Unlock()
	return s.Store.InboxBeginClaimBatch(ctx, consumer, keys, window)
}

// TestBatchKeepsPerKeyOrder: eight accounts, versions 1 to 25 of each
// published in order, each version its own idempotency key and the
// account its partition key, consumed from Kafka by the key-parallel
// subscriber through the inbox in batch mode (16 a batch, 4 batches at
// once). Deliveries of different accounts share transactions, and each
// account's versions are applied once each, in the order they were
// published.
func TestBatchKeepsPerKeyOrder(t *testing.T) {
	t.Parallel()
	const accounts, versions = 8, 25
	ctx := context.Background()
	b := kafkaBroker(t)
	id := pgtest.Name(t)
	topic, group := "accounts_"+id, "ledger_"+id
	pool := pgtest.Pool(t, 12)
	schema := pgtest.Schema(t, pool)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+q+`.effects (seq bigserial PRIMARY KEY, account text NOT NULL, version int NOT NULL)`)
	require.NoError(t, err)
	pg, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	store := &batchSizes{Store: pg}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "ledger",
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 16, Parallel: 4, Linger: 5 * time.Millisecond}}})
	require.NoError(t, err)

	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	for v := 1; v <= versions; v++ {
		for a := range accounts {
			msg := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, "%d", v))
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("acct-%d/v%d", a, v))
			msg.Metadata.Set(delivery.PartitionKey, fmt.Sprintf("acct-%d", a))
			require.NoError(t, producer.Publisher.Publish(topic, msg))
		}
	}

	consumer := b.open(t, group)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	effects := q + ".effects"
	router.AddNoPublisherHandler("ledger", topic, consumer.Subscriber, func(msg *message.Message) error {
		ctx := msg.Context()
		account := msg.Metadata.Get(delivery.PartitionKey)
		// Some work in the transaction, so that versions of other
		// accounts queue behind it.
		time.Sleep(time.Duration(1+crc32.ChecksumIEEE([]byte(middleware.IdempotencyKey(ctx)))%5) * time.Millisecond)
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (account, version) VALUES ($1, $2::int)`, account, string(msg.Payload))
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	count := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return count() >= accounts*versions }, time.Minute, 10*time.Millisecond)
	require.NoError(t, router.Close())
	require.NoError(t, <-done)
	closeQuietly(t, consumer)

	applied := brokertest.RequireAppliedInOrder(t, pool, `SELECT account, version FROM `+effects+` ORDER BY seq`, accounts, versions)
	require.Equal(t, accounts*versions, count())
	store.mu.Lock()
	largest := store.largest
	store.mu.Unlock()
	require.Greater(t, largest, 1, "deliveries of different accounts shared transactions")
	require.Equal(t, int64(accounts*versions), inbox.Stats().Applied)
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	accountsSeen := slices.Sorted(maps.Keys(applied))
	t.Logf("per-key order: %d versions of each of %s applied in order, largest batch %d", versions, strings.Join(accountsSeen, ", "), largest)
}
