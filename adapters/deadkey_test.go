package adapters_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

const (
	deadKeys        = 200
	deadMaxAttempts = 2
	// deadBeforeFix is how many keys are dead-lettered before the handler
	// is fixed.
	deadBeforeFix = 50
)

// deadCopies is how many times key k is published: 2 or 3, each copy with
// its own UUID and the same idempotency key.
func deadCopies(k int) int { return 2 + k%2 }

// TestDeadKeyStaysDead: on RabbitMQ and NATS, 200 keys published 2 or 3
// times each (a producer that retries: new UUIDs, one idempotency key),
// and a handler
// that fails every attempt until it is fixed, after at least 50 keys went
// to the dead-letter queue (MaxAttempts 2). Every key ends either applied
// exactly once and not dead-lettered, or dead-lettered exactly once with no
// effect and its key recorded dead — never both, never neither — and
// every other copy of a dead key, before or after the fix, is acked
// without running and counted in the key's dead_copies. (JetStream drops
// the retries at publish, by their Nats-Msg-Id, so on NATS no copy
// arrives.) A replay of one dead letter reopens its key and applies it
// once.
func TestDeadKeyStaysDead(t *testing.T) {
	t.Parallel()
	for _, b := range []broker{amqpBroker(t), natsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runDeadKey(t, b)
		})
	}
}

func runDeadKey(t *testing.T, b broker) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, group := "refunds_"+id, "ledger_"+id
	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	if b.cleanup != nil {
		t.Cleanup(func() { b.cleanup(t, topic, group) })
	}

	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	q := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+q+`.effects (key text NOT NULL);
CREATE TABLE `+q+`.flags (fixed boolean NOT NULL);
INSERT INTO `+q+`.flags VALUES (false)`)
	require.NoError(t, err)
	count := func(query string, args ...any) (n int) {
		require.NoError(t, pool.QueryRow(ctx, query, args...).Scan(&n))
		return n
	}
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	dlqPub, err := dlq.NewPublisher(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)
	dlqStore, err := dlq.NewStore(pool, sqlschema.Config{Schema: schema})
	require.NoError(t, err)

	const consumer = "refunds"
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: dlqPub, Topic: "refunds_dlq", MaxAttempts: deadMaxAttempts,
		InitialBackoff: 5 * time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)
	var (
		runs    atomic.Int64
		shipped atomic.Bool
	)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		runs.Add(1)
		tx := postgres.Tx(ctx)
		var fixed bool
		if err := tx.QueryRow(ctx, `SELECT fixed FROM `+q+`.flags`).Scan(&fixed); err != nil {
			return nil, err
		}
		if !fixed && poison.Stats().DeadLettered >= deadBeforeFix {
			// The fix ships once deadBeforeFix keys are dead: the keys
			// in flight and those still on the broker are applied.
			// Decided here, not by the test's polling, so that a
			// consumer that fails its keys faster than the producer
			// publishes still has keys left to apply. Kept in the
			// process, not written through the pool: every connection
			// may be a handler's transaction, and a handler that waited
			// for another would wait for ever.
			shipped.Store(true)
		}
		if !fixed && !shipped.Load() {
			return nil, fmt.Errorf("refund service closed for maintenance")
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+q+`.effects (key) VALUES ($1)`, middleware.IdempotencyKey(ctx))
		return nil, err
	}
	// acked counts deliveries the router acks: every copy is acked once,
	// applied, dead-lettered, a duplicate or a dead copy.
	var acked atomic.Int64
	acking := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			if err == nil {
				acked.Add(1)
			}
			return produced, err
		}
	}

	// The consumer subscribes first, so that RabbitMQ has its queue.
	sub := b.open(t, group)
	r := startRouter(t, sub, topic, "", consumer, handler, acking, poison.Middleware, inbox.Middleware)
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			require.NoError(t, r.close())
			require.NoError(t, sub.Close())
		}
	}
	defer stop()

	// delivered is what the consumer receives: every copy, or one per key
	// where the broker drops retries at publish.
	published, delivered := 0, 0
	for c := range 3 {
		for k := range deadKeys {
			if c >= deadCopies(k) {
				continue
			}
			msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(k)))
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("refund-%d", k))
			require.NoError(t, producer.Publisher.Publish(topic, msg))
			published++
			if c == 0 || !b.dropsRetries {
				delivered++
			}
		}
	}

	dlqEntries := func() int { return count(`SELECT count(*) FROM ` + q + `.dlq`) }
	require.Eventually(t, func() bool { return dlqEntries() >= deadBeforeFix }, 2*time.Minute, 10*time.Millisecond,
		"keys dead-lettered while the handler fails")
	_, err = pool.Exec(ctx, `UPDATE `+q+`.flags SET fixed = true`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return acked.Load() >= int64(delivered) }, 2*time.Minute, 20*time.Millisecond,
		"every copy acked")

	type outcome struct {
		effects, entries, deadCopies int
		status                       string
	}
	rows, err := pool.Query(ctx, `SELECT k.key,
	(SELECT count(*) FROM `+q+`.effects e WHERE e.key = k.key),
	(SELECT count(*) FROM `+q+`.dlq d WHERE d.key = k.key AND d.consumer = $1),
	coalesce(f.dead_copies, CASE WHEN i.key IS NULL THEN -1 ELSE 0 END), coalesce(i.status, '')
FROM (SELECT 'refund-' || n AS key FROM generate_series(0, $2 - 1) n) k
LEFT JOIN `+q+`.inbox i ON i.consumer = $1 AND i.key = k.key
LEFT JOIN `+q+`.inbox_failures f ON f.consumer = i.consumer AND f.key = i.key`, consumer, deadKeys)
	require.NoError(t, err)
	outcomes := map[string]outcome{}
	for rows.Next() {
		var key string
		var o outcome
		require.NoError(t, rows.Scan(&key, &o.effects, &o.entries, &o.deadCopies, &o.status))
		outcomes[key] = o
	}
	require.NoError(t, rows.Err())
	require.Len(t, outcomes, deadKeys)

	var applied, dead, copiesOfDead int
	var deadKey string
	for k := range deadKeys {
		key := fmt.Sprintf("refund-%d", k)
		o := outcomes[key]
		switch {
		case o.effects == 1 && o.entries == 0:
			applied++
			require.Equal(t, "done", o.status, "key %s applied", key)
			require.Zero(t, o.deadCopies, "key %s applied", key)
		case o.effects == 0 && o.entries == 1:
			dead++
			deadKey = key
			require.Equal(t, "dead", o.status, "key %s dead-lettered", key)
			copies := deadCopies(k) - 1
			if b.dropsRetries {
				copies = 0
			}
			require.Equal(t, copies, o.deadCopies, "key %s: every other copy acked as a dead copy", key)
			copiesOfDead += o.deadCopies
		default:
			t.Fatalf("key %s: %d effects and %d dead letters (inbox status %q): want exactly one of them", key, o.effects, o.entries, o.status)
		}
	}
	require.GreaterOrEqual(t, dead, deadBeforeFix)
	require.Positive(t, applied, "keys attempted before the fix but not dead are applied after it")
	require.Equal(t, dead, dlqEntries(), "no other dead letters")
	require.Equal(t, int64(dead), poison.Stats().DeadLettered)
	require.Equal(t, int64(copiesOfDead), inbox.Stats().DeadCopies)
	require.Equal(t, copiesOfDead, count(`SELECT coalesce(sum(dead_copies), 0)::int FROM `+q+`.inbox_failures`))
	require.Equal(t, int64(applied), inbox.Stats().Applied)

	// A replay of one dead letter reopens its key: applied once.
	entries, err := dlqStore.List(ctx, dlq.Filter{Consumer: consumer})
	require.NoError(t, err)
	var replayID int64
	for _, e := range entries {
		if e.Key == deadKey {
			replayID = e.ID
			require.Equal(t, deadMaxAttempts, e.Attempts)
			require.Contains(t, e.Error, "closed for maintenance")
		}
	}
	require.NotZero(t, replayID)
	n, err := dlqStore.Replay(ctx, producer.Publisher, dlq.Filter{IDs: []int64{replayID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Eventually(t, func() bool { return acked.Load() >= int64(delivered)+1 }, time.Minute, 20*time.Millisecond,
		"the replay acked")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 50*time.Millisecond,
		"nothing ready on the broker")
	stop()
	require.Equal(t, 1, count(`SELECT count(*) FROM `+q+`.effects WHERE key = $1`, deadKey), "the replayed key applied once")
	require.Equal(t, "done", func() (s string) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT status FROM `+q+`.inbox WHERE consumer = $1 AND key = $2`, consumer, deadKey).Scan(&s))
		return s
	}())
	require.Equal(t, dead-1, dlqEntries(), "the replayed entry left the dead-letter table")
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker")
	t.Logf("dead keys on %s: %d copies of %d keys published, %d delivered, %d handler runs; %d keys applied, %d dead-lettered, %d copies of dead keys acked without running",
		b.name, published, deadKeys, delivered, runs.Load(), applied, dead, copiesOfDead)
}
