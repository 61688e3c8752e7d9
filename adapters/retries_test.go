package adapters_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
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
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// retryDB is a migrated schema with an effects table that records, in
// insertion order, each applied message's key, ordering key and sequence.
type retryDB struct {
	pool    *pgxpool.Pool
	schema  string
	store   *postgres.Store
	effects string
}

func newRetryDB(t *testing.T) retryDB {
	pool := pgtest.Pool(t, 32)
	schema := pgtest.Schema(t, pool)
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	effects := `"` + schema + `".effects`
	_, err = pool.Exec(context.Background(), `CREATE TABLE `+effects+
		` (id bigserial PRIMARY KEY, consumer text NOT NULL, key text NOT NULL, account text NOT NULL, seq int NOT NULL)`)
	require.NoError(t, err)
	return retryDB{pool: pool, schema: schema, store: store, effects: effects}
}

// retryConsumer is one consumer process: the broker's subscription merged
// with the retry subscriber, the poison middleware parking in the
// PostgreSQL table beside the inbox, dead letters in the dead-letter
// table.
type retryConsumer struct {
	poison *middleware.Poison
	inbox  *middleware.Inbox
	stop   func()
}

func startRetryConsumer(t *testing.T, b broker, db retryDB, topic, group, consumer string, cfg middleware.PoisonConfig,
	h message.HandlerFunc) retryConsumer {
	t.Helper()
	schema := sqlschema.Config{Schema: db.schema}
	parked, err := retry.NewStore(db.pool, schema)
	require.NoError(t, err)
	subscriber, err := parked.Subscriber(retry.SubscriberConfig{Consumer: consumer, PollInterval: 100 * time.Millisecond})
	require.NoError(t, err)
	dead, err := dlq.NewPublisher(db.pool, schema)
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: db.store, Consumer: consumer})
	require.NoError(t, err)
	cfg.Publisher, cfg.Retries, cfg.Inbox = dead, parked, inbox
	poison, err := middleware.NewPoison(cfg)
	require.NoError(t, err)

	ps := b.open(t, group)
	merged := &adapters.PubSub{Publisher: ps.Publisher, Subscriber: retry.Merge(ps.Subscriber, subscriber), Scheme: ps.Scheme}
	r := startRouter(t, merged, topic, "", consumer, h, poison.Middleware, inbox.Middleware)
	return retryConsumer{poison: poison, inbox: inbox, stop: func() {
		require.NoError(t, r.close())
		closeQuietly(t, merged)
	}}
}

// publishAccounts publishes perAccount messages to each of accounts
// ordering keys, in sequence order per key.
func publishAccounts(t *testing.T, pub message.Publisher, topic string, accounts, perAccount int, account func(int) string) {
	t.Helper()
	for seq := range perAccount {
		for a := range accounts {
			msg := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(seq)))
			msg.Metadata.Set(delivery.IdempotencyKey, fmt.Sprintf("%s-%d", account(a), seq))
			msg.Metadata.Set(delivery.PartitionKey, account(a))
			require.NoError(t, pub.Publish(topic, msg))
		}
	}
}

// applyHandler writes the effect of a message in the inbox's transaction.
func applyHandler(db retryDB, consumer string) func(msg *message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		seq, err := strconv.Atoi(string(msg.Payload))
		if err != nil {
			return middleware.Permanent(err)
		}
		_, err = postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+db.effects+` (consumer, key, account, seq) VALUES ($1, $2, $3, $4)`,
			consumer, middleware.IdempotencyKey(ctx), msg.Metadata.Get(delivery.PartitionKey), seq)
		return err
	}
}

// checkApplied asserts that every key was applied once, and, where the
// broker orders a key's messages, in sequence order per account.
func checkApplied(t *testing.T, db retryDB, consumer string, want int, ordered bool) {
	t.Helper()
	ctx := context.Background()
	var n, distinct int
	require.NoError(t, db.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT key) FROM `+db.effects+` WHERE consumer = $1`,
		consumer).Scan(&n, &distinct))
	require.Equal(t, want, n, "effects")
	require.Equal(t, want, distinct, "each key applied once")
	if !ordered {
		return
	}
	var outOfOrder int
	require.NoError(t, db.pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY account ORDER BY id) AS prev
		FROM `+db.effects+` WHERE consumer = $1) s WHERE prev IS NOT NULL AND seq < prev`, consumer).Scan(&outOfOrder))
	require.Zero(t, outOfOrder, "each account's messages applied in order")
}

func deadLetters(t *testing.T, db retryDB, consumer string) (n int) {
	t.Helper()
	require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+db.schema+`".dlq WHERE consumer = $1`,
		consumer).Scan(&n))
	return n
}

func parkedRows(t *testing.T, db retryDB, consumer string) (n int) {
	t.Helper()
	require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+db.schema+`".retries WHERE consumer = $1`,
		consumer).Scan(&n))
	return n
}

// orderedBrokers are the rows whose broker keeps a key's messages in order
// through the immediate attempts too: Kafka hands a key to one goroutine
// at a time.
var orderedBrokers = map[string]bool{"kafka": true}

// outage is how long the payment API is down in TestDependencyDownOnBrokers:
// a minute, as the users meet it; ONCEMILL_OUTAGE shortens it for
// a quick run by hand.
func outage() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("ONCEMILL_OUTAGE")); err == nil {
		return d
	}
	return time.Minute
}

// TestDependencyDownOnBrokers: on Kafka, RabbitMQ, SQS and NATS, a consumer
// at the default policy (PoisonConfig with Retries and nothing else set)
// whose payment API answers every call with a plain error for a minute,
// as an HTTP client returns a 503: 20 accounts, 3 messages each, published
// as the outage begins. No healthy message is dead-lettered; once the API
// is back every key is applied once, each account's messages in order
// where the broker orders them, and nothing is left parked.
func TestDependencyDownOnBrokers(t *testing.T) {
	t.Parallel()
	db := newRetryDB(t)
	down := outage()
	for _, b := range []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), natsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			const accounts, perAccount = 20, 3
			id := pgtest.Name(t)
			topic, group, consumer := "pay_"+id, "ledger_"+id, "ledger_"+b.name
			if b.cleanup != nil {
				t.Cleanup(func() { b.cleanup(t, topic, group) })
			}
			var calls, refused atomic.Int64
			backAt := time.Now().Add(down)
			apply := applyHandler(db, consumer)
			h := func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				if time.Now().Before(backAt) {
					refused.Add(1)
					return nil, errors.New("payment API: 503 Service Unavailable")
				}
				return nil, apply(msg)
			}
			c := startRetryConsumer(t, b, db, topic, group, consumer, middleware.PoisonConfig{}, h)
			defer c.stop()
			producer := b.open(t, "producer_"+id)
			defer closeQuietly(t, producer)
			publishAccounts(t, producer.Publisher, topic, accounts, perAccount, func(a int) string { return fmt.Sprintf("acct-%d", a) })

			require.Eventually(t, func() bool {
				var n int
				require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.effects+` WHERE consumer = $1`,
					consumer).Scan(&n))
				return n == accounts*perAccount
			}, down+3*time.Minute, 200*time.Millisecond, "every key applied once the API is back")
			require.Zero(t, deadLetters(t, db, consumer), "no healthy message dead-lettered")
			require.Eventually(t, func() bool { return parkedRows(t, db, consumer) == 0 }, 30*time.Second, 100*time.Millisecond,
				"nothing left parked")
			checkApplied(t, db, consumer, accounts*perAccount, orderedBrokers[b.name])
			st := c.poison.Stats()
			require.Zero(t, st.DeadLettered)
			require.Positive(t, st.Parked, "the messages waited parked, off the consumer")
			t.Logf("%s: API down %s; %d handler calls, %d refused; %d parked, %d parked behind their account; 0 dead letters; "+
				"%d keys applied once, in order: %v", b.name, down, calls.Load(), refused.Load(), st.Parked, st.ParkedBehind,
				accounts*perAccount, orderedBrokers[b.name])
		})
	}
}
