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
		` (id bigserial PRIMARY KEY, consumer text NOT NULL, key text NOT NULL, account text NOT NULL, seq int NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return retryDB{pool: pool, schema: schema, store: store, effects: effects}
}

// retryConsumer is one consumer process, wired as the README's: the
// broker's subscription through Poison.Subscriber (which merges the retry
// subscriber in, at its defaults), the poison middleware parking in the
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
	dead, err := dlq.NewPublisher(db.pool, schema)
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: db.store, Consumer: consumer})
	require.NoError(t, err)
	cfg.Publisher, cfg.Retries, cfg.Inbox = dead, parked, inbox
	poison, err := middleware.NewPoison(cfg)
	require.NoError(t, err)

	ps := b.open(t, group)
	sub, err := poison.Subscriber(ps.Subscriber)
	require.NoError(t, err)
	merged := &adapters.PubSub{Publisher: ps.Publisher, Subscriber: sub, Scheme: ps.Scheme}
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
// through failures: each hands a key's messages out one at a time, and
// the immediate attempts run in process, holding the key, until the
// message succeeds, is parked (its key's later messages park behind it)
// or is dead-lettered.
//
// An SQS standard queue is not one of them: SQS hands its messages out in
// no particular order (the emulator as the service), so that a key's order
// needs a FIFO queue, whose message group is the key (adapters/sqs): the
// sqs_fifo row.
var orderedBrokers = map[string]bool{"kafka": true, "amqp": true, "sqs_fifo": true, "nats": true}

// outage is how long the payment API is down in TestDependencyDownOnBrokers:
// a minute, as the users meet it; ONCEMILL_OUTAGE shortens it for
// a quick run by hand.
func outage() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("ONCEMILL_OUTAGE")); err == nil {
		return d
	}
	return time.Minute
}

// TestDependencyDownOnBrokers: on Kafka, RabbitMQ, SQS (a standard and a
// FIFO queue) and NATS, a consumer at the default policy (PoisonConfig
// with Retries and nothing else set) whose payment API answers every call with a plain error for a minute,
// as an HTTP client returns a 503: 20 accounts, 3 messages each, published
// as the outage begins. No healthy message is dead-lettered; once the API
// is back every key is applied once, each account's messages in order
// where the broker orders them, and nothing is left parked.
func TestDependencyDownOnBrokers(t *testing.T) {
	t.Parallel()
	db := newRetryDB(t)
	down := outage()
	for _, b := range []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), sqsFIFOBroker(t), natsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			const accounts, perAccount = 20, 3
			id := pgtest.Name(t)
			topic, group, consumer := "pay_"+id+b.topicSuffix, "ledger_"+id, "ledger_"+b.name
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
			// From the handler's first success to the last message
			// applied: the parked ones are brought forward, not left to
			// their delayed slots (5 s, 15 s, 30 s …).
			var recovery float64
			require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT extract(epoch FROM max(applied_at) - min(applied_at))
				FROM `+db.effects+` WHERE consumer = $1`, consumer).Scan(&recovery))
			require.LessOrEqual(t, recovery, 5.0, "the last parked message applied within 5 s of the first success")
			st := c.poison.Stats()
			require.Zero(t, st.DeadLettered)
			if b.name == "kafka" || b.name == "nats" {
				// Where the consumer takes several messages at once. SQS
				// hides a nacked message for a backoff of its own (the
				// adapter's NackBackoff, 1 s doubling), and RabbitMQ's
				// consumer takes its queue one message at a time, each
				// attempt after its backoff: there the immediate attempts
				// alone may span the outage.
				require.Positive(t, st.Parked, "the messages waited parked, off the consumer")
			}
			t.Logf("%s: API down %s; %d handler calls, %d refused; %d parked, %d parked behind their account, %d brought forward; "+
				"0 dead letters; %d keys applied once, in order: %v; all applied %.1f s after the first success", b.name, down,
				calls.Load(), refused.Load(), st.Parked, st.ParkedBehind, st.BroughtForward, accounts*perAccount,
				orderedBrokers[b.name], recovery)
		})
	}
}

// TestFailingKeyOnBrokers: on Kafka, RabbitMQ, SQS (standard and FIFO) and
// NATS, 99 healthy accounts and one whose first message always fails, at a
// policy of 2 attempts in a row, then 2 delayed ones, 10 s and 20 s: the 99
// other accounts flow meanwhile (every one of their messages is applied
// while the failing message still waits for its delayed attempts, neither
// applied nor dead-lettered); the failing message is dead-lettered once,
// after exactly the policy's 4 attempts; its account's later messages wait
// behind it and apply after it, in order where the broker orders keys.
// The others' successes do not bring it forward: it waits out its delays.
//
// The healthy accounts are held to the failing message's horizon, not to
// a speed: a ratio of two runs' times (asserted here before) measured the
// machine's load as much as the consumer, and speed is the benchmarks'.
func TestFailingKeyOnBrokers(t *testing.T) {
	t.Parallel()
	db := newRetryDB(t)
	policy := middleware.PoisonConfig{MaxAttempts: 2, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 10 * time.Millisecond,
		Delays: []time.Duration{10 * time.Second, 20 * time.Second}}
	const horizon = 4
	for _, b := range []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), sqsFIFOBroker(t), natsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			const accounts, perAccount = 100, 5
			id := pgtest.Name(t)
			topic, group, consumer := "pay_"+id+b.topicSuffix, "ledger_"+id, "ledger_"+b.name
			if b.cleanup != nil {
				t.Cleanup(func() { b.cleanup(t, topic, group) })
			}
			apply := applyHandler(db, consumer)
			h := func(msg *message.Message) ([]*message.Message, error) {
				if middleware.IdempotencyKey(msg.Context()) == "acct-0-0" {
					return nil, errors.New("ledger rejects acct-0-0")
				}
				return nil, apply(msg)
			}
			c := startRetryConsumer(t, b, db, topic, group, consumer, policy, h)
			defer c.stop()
			producer := b.open(t, "producer_"+id)
			defer closeQuietly(t, producer)
			start := time.Now()
			// Account 0's messages first, so that its later ones reach
			// the consumer while its first waits, however slow the
			// machine; then the 99 others, interleaved.
			publishAccounts(t, producer.Publisher, topic, 1, perAccount, func(int) string { return "acct-0" })
			publishAccounts(t, producer.Publisher, topic, accounts-1, perAccount, func(a int) string { return fmt.Sprintf("acct-%d", a+1) })
			count := func(where string) (n int) {
				require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.effects+
					` WHERE consumer = $1 AND `+where, consumer).Scan(&n))
				return n
			}
			require.Eventually(t, func() bool { return count(`account <> 'acct-0'`) == (accounts-1)*perAccount }, 3*time.Minute, 10*time.Millisecond)
			took := time.Since(start)
			// The failing message is still waiting: the healthy accounts
			// did not wait for it.
			require.Zero(t, deadLetters(t, db, consumer), "the healthy accounts applied before the failing message's horizon (%s after the first publish)", took)
			require.Zero(t, count(`key = 'acct-0-0'`))

			want := accounts*perAccount - 1
			require.Eventually(t, func() bool { return deadLetters(t, db, consumer) == 1 }, 3*time.Minute, 50*time.Millisecond,
				"the failing message is dead-lettered")
			dead := time.Since(start)
			// Its delayed attempts kept the policy's delays: the others'
			// successes did not bring it forward (an outage's end would).
			require.GreaterOrEqual(t, dead, policy.Delays[0]+policy.Delays[1], "the failing message waited out its delays")
			var attempts int
			require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT attempts FROM "`+db.schema+`".dlq WHERE consumer = $1`,
				consumer).Scan(&attempts))
			require.Equal(t, horizon, attempts, "dead-lettered at the policy's horizon")
			require.Eventually(t, func() bool { return count(`true`) == want }, time.Minute, 50*time.Millisecond,
				"the failing account's later messages apply after its dead letter")
			require.Eventually(t, func() bool { return parkedRows(t, db, consumer) == 0 }, 30*time.Second, 100*time.Millisecond)
			checkApplied(t, db, consumer, want, orderedBrokers[b.name])
			require.Equal(t, 1, deadLetters(t, db, consumer))
			st := c.poison.Stats()
			require.Equal(t, int64(1), st.DeadLettered)
			require.Zero(t, st.BroughtForward, "one failing message is no outage: nothing is brought forward")
			if orderedBrokers[b.name] {
				// Elsewhere the broker hands out the account's next
				// messages during the immediate attempts already.
				require.Equal(t, int64(perAccount-1), st.ParkedBehind, "the failing account's later messages waited behind it")
			}
			t.Logf("%s: 99 healthy accounts × %d messages applied %s after the first publish; the failing message dead-lettered after %d attempts, %s after it",
				b.name, perAccount, took.Round(time.Millisecond), horizon, dead.Round(time.Millisecond))
		})
	}
}

// TestUnavailableOnBrokers: on Kafka, RabbitMQ, SQS (standard and FIFO)
// and NATS, a handler
// whose dependency is down for a minute and says so (middleware.Unavailable):
// no attempt is counted, nothing is parked or dead-lettered, and the
// consumer probes one message at a time: its handler runs at most once
// per backoff period (doubling from 100 ms to 10 s), plus the messages
// that were in flight when the outage began; then every key applies once.
func TestUnavailableOnBrokers(t *testing.T) {
	t.Parallel()
	db := newRetryDB(t)
	down := outage()
	// periods is how many backoff periods of the default policy fit in
	// the outage: the bound on the probes.
	periods := 0
	for d, wait := time.Duration(0), 100*time.Millisecond; d < down; periods++ {
		d += wait
		wait = min(2*wait, 10*time.Second)
	}
	for _, b := range []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), sqsFIFOBroker(t), natsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			const accounts = 20
			id := pgtest.Name(t)
			topic, group, consumer := "pay_"+id+b.topicSuffix, "ledger_"+id, "ledger_"+b.name
			if b.cleanup != nil {
				t.Cleanup(func() { b.cleanup(t, topic, group) })
			}
			var refused atomic.Int64
			backAt := time.Now().Add(down)
			apply := applyHandler(db, consumer)
			h := func(msg *message.Message) ([]*message.Message, error) {
				if time.Now().Before(backAt) {
					refused.Add(1)
					return nil, middleware.Unavailable(errors.New("payment API: connection refused"))
				}
				return nil, apply(msg)
			}
			c := startRetryConsumer(t, b, db, topic, group, consumer, middleware.PoisonConfig{}, h)
			defer c.stop()
			producer := b.open(t, "producer_"+id)
			defer closeQuietly(t, producer)
			publishAccounts(t, producer.Publisher, topic, accounts, 1, func(a int) string { return fmt.Sprintf("acct-%d", a) })
			require.Eventually(t, func() bool {
				var n int
				require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+db.effects+` WHERE consumer = $1`,
					consumer).Scan(&n))
				return n == accounts
			}, down+2*time.Minute, 100*time.Millisecond, "every key applied once the API is back")
			checkApplied(t, db, consumer, accounts, false)
			st := c.poison.Stats()
			require.Zero(t, deadLetters(t, db, consumer))
			require.Zero(t, st.Parked, "an outage parks nothing")
			require.Zero(t, c.inbox.Stats().Failed, "no attempt counted")
			var counted int
			require.NoError(t, db.pool.QueryRow(context.Background(), `SELECT count(*) FROM "`+db.schema+`".inbox i LEFT JOIN "`+db.schema+
				`".inbox_failures f USING (consumer, key) WHERE consumer = $1 AND COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END) <> 1`, consumer).Scan(&counted))
			require.Zero(t, counted, "the store counted one attempt per key, the one that applied it")
			require.LessOrEqual(t, refused.Load(), int64(periods+accounts),
				"at most one probe per backoff period, plus the messages in flight when it began")
			t.Logf("%s: dependency down %s: %d handler runs refused (bound: %d backoff periods + %d in flight), %d waited for the probe; "+
				"0 counted, 0 parked, 0 dead letters; %d keys applied once", b.name, down, refused.Load(), periods, accounts,
				st.Paused, accounts)
		})
	}
}
