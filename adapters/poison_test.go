package adapters_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	poisonMaxAttempts = 3
	poisonGood        = 100
	// poisonTimeout is the Timeout middleware's deadline in the
	// "deadline" mode: generous, so that a good message never hits it.
	poisonTimeout = 2 * time.Second
)

// poisonMode is one way for the poison message's handler to fail.
type poisonMode struct {
	name string
	// fail is what the handler does for the poison message.
	fail func(msg *message.Message) ([]*message.Message, error)
	// timeout, when set, puts Watermill's Timeout middleware with this
	// deadline between the poison middleware and the inbox.
	timeout time.Duration
	// errContains are what the dead letter's error must say.
	errContains []string
}

var poisonModes = []poisonMode{
	{
		name: "error",
		fail: func(msg *message.Message) ([]*message.Message, error) {
			return nil, fmt.Errorf("ledger rejects account %q", string(msg.Payload))
		},
		errContains: []string{"ledger rejects"},
	},
	{
		name: "panic",
		fail: func(msg *message.Message) ([]*message.Message, error) {
			panic(fmt.Sprintf("ledger crashed on account %q", string(msg.Payload)))
		},
		errContains: []string{middleware.ErrPanicked.Error(), "ledger crashed on account"},
	},
	{
		name: "deadline",
		fail: func(msg *message.Message) ([]*message.Message, error) {
			<-msg.Context().Done()
			return nil, fmt.Errorf("ledger did not answer: %w", msg.Context().Err())
		},
		timeout:     poisonTimeout,
		errContains: []string{"ledger did not answer", context.DeadlineExceeded.Error()},
	},
}

// TestPoisonOnBrokers: on Kafka, RabbitMQ, SQS and NATS, one message that always
// fails, followed in the same partition (same partition key) by 100 good
// ones, for each way a handler fails: it returns an error, it panics, or
// it overruns the deadline that Watermill's Timeout middleware (between
// the poison middleware and the inbox) sets. The consumer restarts after
// the first failed attempt. The poison message is dead-lettered exactly
// once, after exactly MaxAttempts handler runs counted durably across the
// restart (the inbox store's count), its effect is never committed and its
// key is recorded dead; the 100 good ones are applied once each, and the
// broker holds nothing unacknowledged at the end. GoChannel, which keeps
// no offsets but redelivers everything to a new subscriber, runs the panic
// case too.
func TestPoisonOnBrokers(t *testing.T) {
	t.Parallel()
	pool, store, effects := effectsDB(t, 32)

	brokers := []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t), natsBroker(t)}
	for _, mode := range poisonModes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			for _, b := range brokers {
				t.Run(b.name, func(t *testing.T) {
					t.Parallel()
					runPoison(t, b, mode, pool, store, effects)
				})
			}
			if mode.name == "panic" {
				b := goChannelBroker(t)
				t.Run(b.name, func(t *testing.T) {
					t.Parallel()
					runPoison(t, b, mode, pool, store, effects)
				})
			}
		})
	}
}

func runPoison(t *testing.T, b broker, mode poisonMode, pool *pgxpool.Pool, store *postgres.Store, effects string) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, dlqTopic := "pay_"+id, "pay_dlq_"+id
	group, dlqGroup := "ledger_"+id, "ops_"+id
	consumer := "ledger_" + mode.name + "_" + b.name
	if b.cleanup != nil {
		t.Cleanup(func() {
			b.cleanup(t, topic, group)
			b.cleanup(t, dlqTopic, dlqGroup)
		})
	}

	dlqReader := b.open(t, dlqGroup)
	defer closeQuietly(t, dlqReader)
	deadCtx, stopDead := context.WithCancel(ctx)
	defer stopDead()
	dead, err := dlqReader.Subscriber.Subscribe(deadCtx, dlqTopic)
	require.NoError(t, err)

	var poisonCalls, goodCalls, poisonDeliveries atomic.Int32
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if key == "poison" {
			poisonCalls.Add(1)
			return mode.fail(msg)
		}
		goodCalls.Add(1)
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (consumer, key) VALUES ($1, $2)`, consumer, key)
		return nil, err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer})
	require.NoError(t, err)

	// recorded reports each failed poison attempt once the inbox has
	// recorded it: a restart that began while the handler was still
	// running would make its attempt one cut short by shutdown, which is
	// rightly not counted.
	recorded := make(chan error, 16)
	afterInbox := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			if err != nil && msg.Metadata.Get(delivery.IdempotencyKey) == "poison" {
				recorded <- err
			}
			return produced, err
		}
	}

	// process starts a consumer as a new process would: its own broker
	// connection and a fresh poison middleware (no memory of attempts).
	process := func(backoff time.Duration) (*middleware.Poison, func()) {
		ps := b.open(t, group)
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: ps.Publisher, Topic: dlqTopic, MaxAttempts: poisonMaxAttempts,
			InitialBackoff: backoff, MaxBackoff: backoff,
		})
		require.NoError(t, err)
		counting := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if msg.Metadata.Get(delivery.IdempotencyKey) == "poison" {
					poisonDeliveries.Add(1)
				}
				return h(msg)
			}
		}
		mws := []message.HandlerMiddleware{counting, poison.Middleware}
		if mode.timeout > 0 {
			mws = append(mws, wmmiddleware.Timeout(mode.timeout))
		}
		mws = append(mws, afterInbox, inbox.Middleware)
		r := startRouter(t, ps, topic, "", consumer, handler, mws...)
		return poison, func() {
			require.NoError(t, r.close())
			require.NoError(t, ps.Close())
		}
	}

	// The first process backs off for long after its failed attempt: the
	// restart, not a redelivery to it, brings the next attempt (a close
	// cuts the backoff short).
	poisonA, stopA := process(time.Minute)
	producer := b.open(t, "producer_"+id)
	defer closeQuietly(t, producer)
	publish := func(key, payload string) {
		msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
		msg.Metadata.Set(delivery.IdempotencyKey, key)
		msg.Metadata.Set(delivery.PartitionKey, "account-42")
		require.NoError(t, producer.Publisher.Publish(topic, msg))
	}
	publish("poison", "acct-42")
	for i := range poisonGood {
		publish(fmt.Sprintf("good-%d", i), "acct-42")
	}

	select {
	case err := <-recorded:
		require.NotErrorIs(t, err, middleware.ErrShutdown)
	case <-time.After(time.Minute):
		t.Fatal("the poison message was never attempted")
	}
	stopA() // restart between attempts
	require.Equal(t, int32(1), poisonCalls.Load(), "one attempt before the restart")

	poisonB, stopB := process(50 * time.Millisecond)
	stoppedB := false
	defer func() {
		if !stoppedB {
			stopB()
		}
	}()
	var got *message.Message
	select {
	case got = <-dead:
		require.True(t, got.Ack())
	case <-time.After(2 * time.Minute):
		t.Fatalf("nothing dead-lettered; poison attempts %d", poisonCalls.Load())
	}

	require.Equal(t, "poison", got.Metadata.Get(delivery.IdempotencyKey), "dead-lettered with: %s", got.Metadata.Get(delivery.DeadError))
	require.Equal(t, "poison", got.Metadata.Get(delivery.DeadKey))
	require.Equal(t, consumer, got.Metadata.Get(delivery.DeadConsumer))
	require.Equal(t, topic, got.Metadata.Get(delivery.DeadTopic))
	require.Equal(t, "acct-42", string(got.Payload))
	for _, s := range mode.errContains {
		require.Contains(t, got.Metadata.Get(delivery.DeadError), s)
	}
	require.Equal(t, strconv.Itoa(poisonMaxAttempts), got.Metadata.Get(delivery.DeadAttempts))
	require.Equal(t, "false", got.Metadata.Get(delivery.DeadPermanent))
	if b.name == "kafka" {
		require.NotEmpty(t, got.Metadata.Get(delivery.DeadPartition))
		require.NotEmpty(t, got.Metadata.Get(delivery.DeadOffset))
	}

	countEffects := func() (n int) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+effects+` WHERE consumer = $1`, consumer).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return countEffects() == poisonGood }, 2*time.Minute, 20*time.Millisecond,
		"the good messages behind the poison one are applied")
	require.Eventually(t, func() bool { return b.pending(t, topic, group) == 0 }, time.Minute, 100*time.Millisecond,
		"everything acknowledged, the poison message included")
	select {
	case extra := <-dead:
		t.Fatalf("dead-lettered twice: %s", extra.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	// RabbitMQ's count leaves out what a running consumer holds unacked:
	// the consumer is stopped (which returns whatever it still held) and
	// the queue read again, and the counters are final.
	stopB()
	stoppedB = true
	require.Equal(t, 0, b.pending(t, topic, group), "nothing left on the broker once the consumer stopped")
	require.Equal(t, int32(poisonMaxAttempts), poisonCalls.Load(), "exactly MaxAttempts handler runs across the restart")
	require.Equal(t, int64(0), poisonA.Stats().DeadLettered)
	require.Equal(t, int64(1), poisonB.Stats().DeadLettered)
	require.Equal(t, int64(poisonMaxAttempts), inbox.Stats().Failed, "only the poison message failed, each time counted")
	require.Zero(t, inbox.Stats().Abandoned, "no attempt was cut short by the restart")
	if mode.name == "panic" {
		require.Equal(t, int64(poisonMaxAttempts), inbox.Stats().Panicked)
	}
	require.Equal(t, poisonGood, countEffects())

	var poisonEffects, distinct int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE key = 'poison'), count(DISTINCT key) FROM `+effects+` WHERE consumer = $1`,
		consumer).Scan(&poisonEffects, &distinct))
	require.Zero(t, poisonEffects, "the poison message's effect never committed")
	require.Equal(t, poisonGood, distinct, "each good message applied once")

	var status, lastError string
	var attempts int
	require.NoError(t, pool.QueryRow(ctx, `SELECT i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END), coalesce(f.last_error, '') FROM `+inboxTable(effects)+
		` i LEFT JOIN `+inboxTable(effects)+`_failures f USING (consumer, key) WHERE consumer = $1 AND key = 'poison'`, consumer).Scan(&status, &attempts, &lastError))
	require.Equal(t, "dead", status, "the poison key is recorded dead")
	require.Equal(t, poisonMaxAttempts, attempts)
	require.Contains(t, lastError, mode.errContains[0])
	t.Logf("poison %s on %s: %d deliveries of the poison message (a restart after the first), %d handler runs, %d attempts recorded, "+
		"1 dead letter, %d effects of it; %d good messages behind it applied once each",
		mode.name, b.name, poisonDeliveries.Load(), poisonCalls.Load(), attempts, poisonEffects, distinct)
}

// inboxTable is the quoted inbox table in the schema of the quoted effects
// table that effectsDB returned.
func inboxTable(effects string) string {
	schema, ok := strings.CutSuffix(effects, ".effects")
	if !ok {
		panic(errors.New("not an effects table: " + effects))
	}
	return schema + ".inbox"
}
