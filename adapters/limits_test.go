package adapters_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/amqptest"
	"github.com/oncemill/oncemill/internal/testing/brokertest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// limitRow is a broker whose queue or consumer of a test's topic lets the
// broker deliver a message three times (RabbitMQ: returned three times,
// four deliveries), set up as a user would: in the URL, or on the queue
// by hand before the consumer starts.
type limitRow struct {
	name string
	// deliveries is how many times the broker delivers a message at
	// most.
	deliveries int
	// setup puts the limit in place for topic and group and returns the
	// URL a consumer opens.
	setup func(t *testing.T, topic, group string) string
	// cleanup, when set, deletes the topic's broker objects.
	cleanup func(t *testing.T, topic, group string)
}

// limitRows are RabbitMQ's quorum queue with delivery_limit=3 in the URL
// and one declared by hand with x-delivery-limit 3, an SQS queue whose
// redrive policy has maxReceiveCount 3, and a JetStream consumer with
// max_deliver=3.
func limitRows(t *testing.T) []limitRow {
	amqpURL := amqptest.URL()
	amqp := amqpBroker(t)
	sqsQueues := brokertest.NewSQS(t, sqsEndpoint())
	sqsURL := "sqs://test:test@us-east-1?create=true&endpoint=" + sqsEndpoint()
	nats := natsBroker(t)
	return []limitRow{
		{name: "amqp_delivery_limit", deliveries: 4,
			setup:   func(*testing.T, string, string) string { return amqpURL + "?delivery_limit=3" },
			cleanup: func(t *testing.T, topic, group string) { amqp.cleanup(t, topic, group) }},
		{name: "amqp_declared_by_hand", deliveries: 4,
			setup: func(t *testing.T, topic, group string) string {
				brokertest.DeclareAMQPQueue(t, amqpURL, topic, group, amqp091.Table{"x-delivery-limit": int64(3)})
				return amqpURL
			},
			cleanup: func(t *testing.T, topic, group string) { amqp.cleanup(t, topic, group) }},
		{name: "sqs_redrive", deliveries: 3,
			setup: func(t *testing.T, topic, _ string) string {
				sqsQueues.CreateQueueWithRedrive(t, topic, 3)
				return sqsURL
			}},
		{name: "nats_max_deliver", deliveries: 3,
			setup:   func(*testing.T, string, string) string { return nats.url + "&max_deliver=3" },
			cleanup: func(t *testing.T, topic, group string) { nats.cleanup(t, topic, group) }},
	}
}

// limitDB is the consumer's database: the inbox, the retries and the
// dead-letter table, with an effects table that records each applied
// key and the broker's count of the delivery that applied it.
type limitDB struct {
	pool    *pgxpool.Pool
	schema  string
	effects string
}

func newLimitDB(t *testing.T, pool *pgxpool.Pool) limitDB {
	schema := pgtest.Schema(t, pool)
	effects := `"` + schema + `".effects`
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+effects+` (key text PRIMARY KEY, delivery int NOT NULL)`)
	require.NoError(t, err)
	return limitDB{pool: pool, schema: schema, effects: effects}
}

func (db limitDB) count(t *testing.T, q string, args ...any) (n int) {
	t.Helper()
	require.NoError(t, db.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// startLimitConsumer runs the README's consumer: the inbox, Poison with
// parked retries and the dead-letter table, subscribed through
// Poison.Subscriber, on the broker at url; h decides each attempt before
// its effect is written.
func startLimitConsumer(t *testing.T, db limitDB, url, topic, group string, policy middleware.PoisonConfig, parking bool,
	h func(msg *message.Message) error) func() {
	t.Helper()
	schema := sqlschema.Config{Schema: db.schema}
	store, err := postgres.New(db.pool, postgres.Config{Schema: db.schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge", Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	dead, err := dlq.NewPublisher(db.pool, schema)
	require.NoError(t, err)
	policy.Inbox, policy.Publisher = inbox, dead
	if parking {
		policy.Retries, err = retry.NewStore(db.pool, schema)
		require.NoError(t, err)
	}
	poison, err := middleware.NewPoison(policy)
	require.NoError(t, err)
	ps, err := adapters.Open(context.Background(), url, adapters.Options{ConsumerGroup: group})
	require.NoError(t, err)
	sub, err := poison.Subscriber(ps.Subscriber)
	require.NoError(t, err)
	apply := func(msg *message.Message) error {
		if err := h(msg); err != nil {
			return err
		}
		n, _ := delivery.AttemptsOf(msg)
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+db.effects+` (key, delivery) VALUES ($1, $2)`,
			middleware.IdempotencyKey(msg.Context()), n)
		return err
	}
	r := startRouter(t, &adapters.PubSub{Publisher: ps.Publisher, Subscriber: sub, Scheme: ps.Scheme}, topic, "", "charge",
		func(msg *message.Message) ([]*message.Message, error) { return nil, apply(msg) }, poison.Middleware, inbox.Middleware)
	return func() {
		require.NoError(t, r.close())
		require.NoError(t, ps.Close())
	}
}

func publishKeys(t *testing.T, url, topic string, n int) {
	t.Helper()
	ps, err := adapters.Open(context.Background(), url, adapters.Options{ConsumerGroup: "producer"})
	require.NoError(t, err)
	defer closeQuietly(t, ps)
	for i := range n {
		msg := message.NewMessage(watermill.NewUUID(), []byte("charge"))
		msg.Metadata.Set(delivery.IdempotencyKey, "order-"+strconv.Itoa(i))
		require.NoError(t, ps.Publisher.Publish(topic, msg))
	}
}

// TestOutagesSpendNoBrokerDelivery: on a RabbitMQ quorum queue with
// delivery_limit=3 (in the URL, and declared by hand before the consumer
// starts), an SQS queue whose redrive policy moves a message after 3
// receives and a JetStream consumer with max_deliver=3, a consumer whose
// payment API says it is unavailable for a minute, and separately one
// whose database (the inbox, the retries, the dead-letter table) is down
// for a minute: the deliveries wait in the consumer, unacked, instead of
// being nacked, so that none is dropped or moved aside by the broker.
// Every key is applied once after the outage, by a delivery the broker
// counted at most twice, and nothing is dead-lettered.
func TestOutagesSpendNoBrokerDelivery(t *testing.T) {
	t.Parallel()
	down := outage()
	const keys = 10
	for _, row := range limitRows(t) {
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			t.Run("dependency_unavailable", func(t *testing.T) {
				t.Parallel()
				db := newLimitDB(t, pgtest.Pool(t, 16))
				id := pgtest.Name(t)
				topic, group := "lim_"+id, "g_"+id
				url := row.setup(t, topic, group)
				if row.cleanup != nil {
					t.Cleanup(func() { row.cleanup(t, topic, group) })
				}
				var refused atomic.Int64
				backAt := time.Now().Add(down)
				stop := startLimitConsumer(t, db, url, topic, group, middleware.PoisonConfig{AcceptDeliveryLimit: true}, true,
					func(*message.Message) error {
						if time.Now().Before(backAt) {
							refused.Add(1)
							return middleware.Unavailable(errors.New("payment API: connection refused"))
						}
						return nil
					})
				defer stop()
				publishKeys(t, url, topic, keys)
				require.Eventually(t, func() bool { return db.count(t, `SELECT count(*) FROM `+db.effects) == keys },
					down+time.Minute, 100*time.Millisecond, "every key applied once the API is back")
				checkLimitOutcome(t, db, keys)
				require.Positive(t, refused.Load())
			})
			t.Run("database_down", func(t *testing.T) {
				t.Parallel()
				srv := pgtest.StartServer(t)
				pool, err := pgxpool.New(context.Background(), srv.URL())
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				db := newLimitDB(t, pool)
				require.NoError(t, sqlschema.Migrate(context.Background(), pool, sqlschema.Config{Schema: db.schema}))
				id := pgtest.Name(t)
				topic, group := "lim_"+id, "g_"+id
				url := row.setup(t, topic, group)
				if row.cleanup != nil {
					t.Cleanup(func() { row.cleanup(t, topic, group) })
				}
				stop := startLimitConsumer(t, db, url, topic, group, middleware.PoisonConfig{AcceptDeliveryLimit: true}, true,
					func(*message.Message) error { return nil })
				defer stop()
				srv.Stop()
				publishKeys(t, url, topic, keys)
				time.Sleep(down) // the database stays down for the outage, whatever the consumer does
				srv.Start()
				require.Eventually(t, func() bool { return db.count(t, `SELECT count(*) FROM `+db.effects) == keys },
					time.Minute, 100*time.Millisecond, "every key applied once the database is back")
				checkLimitOutcome(t, db, keys)
			})
		})
	}
}

// checkLimitOutcome asserts that every key was applied once, by a
// delivery the broker counted at most twice, and nothing dead-lettered or
// left parked.
func checkLimitOutcome(t *testing.T, db limitDB, keys int) {
	t.Helper()
	require.Equal(t, keys, db.count(t, `SELECT count(DISTINCT key) FROM `+db.effects))
	require.LessOrEqual(t, db.count(t, `SELECT max(delivery) FROM `+db.effects), 2,
		"at most one redelivery per message during the outage, by the broker's own count")
	require.Zero(t, db.count(t, `SELECT count(*) FROM "`+db.schema+`".dlq`), "no healthy message dead-lettered")
	require.Zero(t, db.count(t, `SELECT count(*) FROM "`+db.schema+`".retries`), "nothing left parked")
}

// TestFailingMessageEndsInOurDLQAtTheBrokerLimit: on the same queues, a
// message that always fails with a plain error, retried by redelivery
// (InProcessRetries: NoInProcessRetries) under a policy of 10 attempts,
// which the broker's limit cuts short: its last delivery is dead-lettered
// in the dead-letter table, with the broker's limit as the reason and the
// broker's count as its attempts, never dropped or moved aside by the
// broker; a healthy message beside it is applied.
func TestFailingMessageEndsInOurDLQAtTheBrokerLimit(t *testing.T) {
	t.Parallel()
	for _, row := range limitRows(t) {
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			db := newLimitDB(t, pgtest.Pool(t, 8))
			id := pgtest.Name(t)
			topic, group := "lim_"+id, "g_"+id
			url := row.setup(t, topic, group)
			if row.cleanup != nil {
				t.Cleanup(func() { row.cleanup(t, topic, group) })
			}
			var runs atomic.Int64
			stop := startLimitConsumer(t, db, url, topic, group, middleware.PoisonConfig{
				MaxAttempts: 10, InProcessRetries: middleware.NoInProcessRetries, AcceptDeliveryLimit: true,
				InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
			}, false, func(msg *message.Message) error {
				if middleware.IdempotencyKey(msg.Context()) == "order-0" {
					runs.Add(1)
					return errors.New("ledger refuses order-0")
				}
				return nil
			})
			defer stop()
			publishKeys(t, url, topic, 2)
			reason, attempts := db.deadLetter(t, "order-0")
			require.Contains(t, reason, "the broker's delivery limit is reached")
			require.Contains(t, reason, fmt.Sprintf("(%d deliveries", row.deliveries))
			require.Contains(t, reason, "ledger refuses order-0")
			require.Equal(t, row.deliveries, attempts, "dead-lettered at the broker's last delivery")
			require.Equal(t, int64(row.deliveries), runs.Load(), "one run per delivery")
			require.Eventually(t, func() bool { return db.count(t, `SELECT count(*) FROM `+db.effects) == 1 }, time.Minute,
				50*time.Millisecond, "the healthy message applied")
		})
	}
}

// TestFailingMessageOutlivesTheBrokerLimitParked: the same failing
// message under a policy that parks (10 attempts, then two delayed ones):
// at the broker's last delivery it is parked instead of nacked, and goes
// on off the broker, handed back by the retry subscriber, until the
// policy's horizon, past the broker's limit: then it is dead-lettered
// with its own error, after 12 attempts.
func TestFailingMessageOutlivesTheBrokerLimitParked(t *testing.T) {
	t.Parallel()
	for _, row := range limitRows(t) {
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			db := newLimitDB(t, pgtest.Pool(t, 8))
			id := pgtest.Name(t)
			topic, group := "lim_"+id, "g_"+id
			url := row.setup(t, topic, group)
			if row.cleanup != nil {
				t.Cleanup(func() { row.cleanup(t, topic, group) })
			}
			stop := startLimitConsumer(t, db, url, topic, group, middleware.PoisonConfig{
				MaxAttempts: 10, InProcessRetries: middleware.NoInProcessRetries, AcceptDeliveryLimit: true,
				InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
				Delays: []time.Duration{100 * time.Millisecond, 100 * time.Millisecond},
			}, true, func(msg *message.Message) error {
				if middleware.IdempotencyKey(msg.Context()) == "order-0" {
					return errors.New("ledger refuses order-0")
				}
				return nil
			})
			defer stop()
			publishKeys(t, url, topic, 2)
			reason, attempts := db.deadLetter(t, "order-0")
			require.Equal(t, "ledger refuses order-0", reason)
			require.Equal(t, 12, attempts, "the policy's horizon, past the broker's limit")
			require.Greater(t, attempts, row.deliveries)
			require.Eventually(t, func() bool { return db.count(t, `SELECT count(*) FROM `+db.effects) == 1 }, time.Minute,
				50*time.Millisecond, "the healthy message applied")
			require.Zero(t, db.count(t, `SELECT count(*) FROM "`+db.schema+`".retries`), "nothing left parked")
		})
	}
}

// TestLowDeliveryLimitRefusedAtStart: a RabbitMQ queue declared by hand
// with x-delivery-limit 3, and an SQS queue whose redrive policy moves a
// message after 3 receives, under the default policy (5 attempts, 6
// delayed ones: 12 deliveries for a message that kills its consumer):
// the consumer does not start, and says which queue, its limit and how to
// raise it.
func TestLowDeliveryLimitRefusedAtStart(t *testing.T) {
	t.Parallel()
	for _, row := range limitRows(t) {
		if row.name != "amqp_declared_by_hand" && row.name != "sqs_redrive" && row.name != "nats_max_deliver" {
			continue
		}
		t.Run(row.name, func(t *testing.T) {
			t.Parallel()
			db := newLimitDB(t, pgtest.Pool(t, 4))
			id := pgtest.Name(t)
			topic, group := "lim_"+id, "g_"+id
			url := row.setup(t, topic, group)
			if row.cleanup != nil {
				t.Cleanup(func() { row.cleanup(t, topic, group) })
			}
			schema := sqlschema.Config{Schema: db.schema}
			store, err := postgres.New(db.pool, postgres.Config{Schema: db.schema})
			require.NoError(t, err)
			inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge", Logger: watermill.NopLogger{}})
			require.NoError(t, err)
			dead, err := dlq.NewPublisher(db.pool, schema)
			require.NoError(t, err)
			parked, err := retry.NewStore(db.pool, schema)
			require.NoError(t, err)
			poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dead, Retries: parked})
			require.NoError(t, err)
			require.Equal(t, 12, poison.DeliveriesNeeded())
			ps, err := adapters.Open(context.Background(), url, adapters.Options{ConsumerGroup: group})
			require.NoError(t, err)
			defer closeQuietly(t, ps)
			sub, err := poison.Subscriber(ps.Subscriber)
			require.NoError(t, err)
			_, err = sub.Subscribe(context.Background(), topic)
			require.ErrorIs(t, err, middleware.ErrLowDeliveryLimit)
			require.ErrorContains(t, err, topic, "names the queue or consumer")
			require.ErrorContains(t, err, fmt.Sprintf("delivers a message %d times at most", row.deliveries))
			require.ErrorContains(t, err, "the poison policy needs 12")
			require.ErrorContains(t, err, "raise")
			require.ErrorContains(t, err, "PoisonConfig.AcceptDeliveryLimit")
		})
	}
}

// deadLetter waits for key's one row in the dead-letter table and returns
// its error and attempts.
func (db limitDB) deadLetter(t *testing.T, key string) (reason string, attempts int) {
	t.Helper()
	require.Eventually(t, func() bool {
		return db.count(t, `SELECT count(*) FROM "`+db.schema+`".dlq WHERE key = '`+key+`'`) == 1
	}, 2*time.Minute, 100*time.Millisecond, "the failing message is in our dead-letter table")
	require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT error, attempts FROM "`+db.schema+`".dlq WHERE key = $1`, key).
		Scan(&reason, &attempts))
	return reason, attempts
}
