package adapters_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/pgtest"
	"github.com/oncemill/oncemill/middleware"
)

const (
	poisonMaxAttempts = 3
	poisonGood        = 100
)

// TestPoisonOnBrokers: on Kafka, RabbitMQ and SQS, one message that always
// fails, followed in the same partition (same partition key) by 100 good
// ones. The consumer restarts after the first failed attempt. The poison
// message is dead-lettered after exactly MaxAttempts attempts, counted
// durably across the restart (the broker's count, or on Kafka the inbox
// store's), the 100 good ones are applied once each, and the broker holds
// nothing unacknowledged at the end.
func TestPoisonOnBrokers(t *testing.T) {
	t.Parallel()
	pool, store, effects := effectsDB(t, 16)

	for _, b := range []broker{kafkaBroker(t), amqpBroker(t), sqsBroker(t)} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			runPoison(t, b, pool, store, effects)
		})
	}
}

func runPoison(t *testing.T, b broker, pool *pgxpool.Pool, store *postgres.Store, effects string) {
	ctx := context.Background()
	id := pgtest.Name(t)
	topic, dlqTopic := "pay_"+id, "pay_dlq_"+id
	group, dlqGroup := "ledger_"+id, "ops_"+id
	consumer := "ledger_" + b.name
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

	var poisonCalls, goodCalls atomic.Int32
	attempted := make(chan struct{}, 16)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		if key == "poison" {
			poisonCalls.Add(1)
			attempted <- struct{}{}
			return nil, fmt.Errorf("ledger rejects account %q", string(msg.Payload))
		}
		goodCalls.Add(1)
		_, err := postgres.Tx(ctx).Exec(ctx, `INSERT INTO `+effects+` (consumer, key) VALUES ($1, $2)`, consumer, key)
		return nil, err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: consumer})
	require.NoError(t, err)

	// process starts a consumer as a new process would: its own broker
	// connection and a fresh poison middleware (no memory of attempts).
	process := func() (router, *middleware.Poison, func()) {
		ps := b.open(t, group)
		poison, err := middleware.NewPoison(middleware.PoisonConfig{
			Publisher: ps.Publisher, Topic: dlqTopic, MaxAttempts: poisonMaxAttempts,
			InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
		})
		require.NoError(t, err)
		r := startRouter(t, ps, topic, "", consumer, handler, poison.Middleware, inbox.Middleware)
		return r, poison, func() {
			require.NoError(t, r.close())
			require.NoError(t, ps.Close())
		}
	}

	_, _, stopA := process()
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
	case <-attempted:
	case <-time.After(time.Minute):
		t.Fatal("the poison message was never attempted")
	}
	stopA() // restart between attempts

	_, poisonB, stopB := process()
	defer stopB()
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
	require.Contains(t, got.Metadata.Get(delivery.DeadError), "ledger rejects")
	require.Equal(t, strconv.Itoa(poisonMaxAttempts), got.Metadata.Get(delivery.DeadAttempts))
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
	require.Equal(t, int32(poisonMaxAttempts), poisonCalls.Load(), "exactly MaxAttempts attempts across the restart")
	require.Equal(t, int64(1), poisonB.Stats().DeadLettered)
	select {
	case extra := <-dead:
		t.Fatalf("dead-lettered twice: %s", extra.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	require.Equal(t, poisonGood, countEffects())
}
