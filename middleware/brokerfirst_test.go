package middleware_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/msgtest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// counted is a keyed message that carries the broker's count of its
// deliveries, as an adapter of a broker that counts them stamps it.
func counted(key string, attempts int) *message.Message {
	msg := keyed(key)
	msg.Metadata.Set(dlv.Attempts, strconv.Itoa(attempts))
	return msg
}

// TestBrokerFirstDeliverySkipsAttemptRecord: on the PostgreSQL store, a
// new key whose delivery the broker counts as its first (Attempts 1)
// costs one statement fewer than a delivery without a broker count, the
// attempt record, and no record of the attempt exists while its handler
// runs; a redelivery (Attempts 2) is recorded as every delivery is
// without a count. A producer's duplicate of a done key, a first delivery
// too, does not run the handler and gets the stored result back, in three
// round trips (BEGIN, claim, ROLLBACK) where a start answers it in one. Under a
// poison limit of 1 even a first delivery is recorded.
func TestBrokerFirstDeliverySkipsAttemptRecord(t *testing.T) {
	t.Parallel()
	pool, schema, tr := tracedPool(t)
	reader := pgtest.Pool(t, 2)
	ctx := context.Background()
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE "`+schema+`".effects (key text PRIMARY KEY)`)
	require.NoError(t, err)
	// Statements counted one by one (PipelineNever); the default's
	// pipelined round trips: TestPipelineAutoFollowsDuplicates.
	inbox := newInbox(t, middleware.InboxConfig{TxStore: store, Consumer: "ship", Tuning: middleware.InboxTuning{Pipeline: middleware.PipelineNever}})
	var (
		runs atomic.Int32
		// startsSeen is the key's count of started attempts that another
		// connection read while the handler ran.
		startsSeen atomic.Int32
	)
	handler := func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		ctx := msg.Context()
		key := middleware.IdempotencyKey(ctx)
		var n int32
		err := reader.QueryRow(ctx, `SELECT COALESCE(sum(started), 0) FROM "`+schema+`".inbox_starts WHERE consumer = 'ship' AND key = $1`, key).Scan(&n)
		if err != nil {
			return nil, err
		}
		startsSeen.Store(n)
		_, err = postgres.Tx(ctx).Exec(ctx, `INSERT INTO "`+schema+`".effects VALUES ($1)`, key)
		return []*message.Message{message.NewMessage("shipped-"+key, nil)}, err
	}
	h := inbox.Middleware(handler)
	total := func(m map[string]int) (n int) {
		for _, v := range m {
			n += v
		}
		return n
	}

	// Baseline: a delivery without a broker count.
	tr.reset()
	_, err = h(keyed("plain-1"))
	require.NoError(t, err)
	plain := tr.reset()
	require.Equal(t, int32(1), startsSeen.Load(), "without a broker count the attempt is recorded before the handler runs")

	// A broker's first delivery of a new key: one statement fewer.
	_, err = h(counted("first-1", 1))
	require.NoError(t, err)
	first := tr.reset()
	require.Equal(t, total(plain)-1, total(first), "one round trip fewer: plain %v, first delivery %v", plain, first)
	require.Equal(t, plain["with"]-1, first["with"], "the statement left out is the attempt record")
	require.Equal(t, int32(0), startsSeen.Load(), "no attempt record while the handler runs")

	// A redelivery is recorded as before.
	_, err = h(counted("again-1", 2))
	require.NoError(t, err)
	require.Equal(t, plain, tr.reset(), "a redelivery costs what a delivery without a count does")
	require.Equal(t, int32(1), startsSeen.Load(), "a redelivery's attempt is recorded")

	// A producer's duplicate, a first delivery of its own: not run, the
	// stored result returned.
	out, err := h(counted("first-1", 1))
	require.NoError(t, err)
	require.Len(t, out, 1)
	require.Equal(t, "shipped-first-1", out[0].UUID, "the stored result is returned")
	require.Equal(t, int32(3), runs.Load(), "the duplicate did not run the handler")
	require.Equal(t, int64(1), inbox.Stats().Duplicates)
	dup := tr.reset()
	require.Equal(t, 1, dup["rollback"], "the duplicate's claim is rolled back: %v", dup)
	require.Zero(t, dup["commit"])
	require.Equal(t, 3, total(dup), "BEGIN, claim, ROLLBACK: %v", dup)

	// Under a poison limit of 1 a first delivery is recorded: a cut of it
	// counted all the same would dead-letter a healthy message.
	p, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: nopPublisher{}, Topic: deadTopic, MaxAttempts: 1, Consumer: "ship"})
	require.NoError(t, err)
	_, err = p.Middleware(h)(counted("limit-1", 1))
	require.NoError(t, err)
	require.Equal(t, int32(1), startsSeen.Load(), "a first delivery under MaxAttempts 1 is recorded")
	require.Equal(t, plain, tr.reset())
}

// nopPublisher accepts everything and keeps nothing.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestBrokerCountStopsCrashLoopAtTheSameHorizon: a message whose
// deliveries kill the process, with MaxAttempts 3 and a broker that counts
// deliveries. Its first delivery left no record (a broker-counted first
// delivery), the next two left their starts, as deliveries that died do;
// the fourth delivery (Attempts 4) is dead-lettered without running, as
// when every start is recorded, and the dead letter says 3 attempts; so
// is a redelivery that a RabbitMQ classic queue only flags as one. A
// message whose first two deliveries died runs on its third.
func TestBrokerCountStopsCrashLoopAtTheSameHorizon(t *testing.T) {
	t.Parallel()
	txBackends(t, 4, func(t *testing.T, b txBackend) {
		killer := dedup.Key{Consumer: "charge", Key: "order-oom"}
		for range 2 { // deliveries 2 and 3 died; delivery 1 left nothing
			_, err := b.store.InboxStart(context.Background(), killer, time.Hour)
			require.NoError(t, err)
		}
		rig := startPoisonRig(t, b, middleware.PoisonConfig{MaxAttempts: 3}, func(int32, *message.Message) error { return nil })
		msg := delivery(killer.Key, "charge "+killer.Key)
		msg.Metadata.Set(dlv.Attempts, "4")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, msg))
		dead := msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), middleware.ErrCrashLoop.Error())
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
		require.Equal(t, int32(0), rig.calls.Load(), "the handler never ran")
		require.Equal(t, "dead", b.status(t, killer.Consumer, killer.Key))
		require.Equal(t, int64(1), rig.inbox.Stats().CrashLooped)

		// A RabbitMQ classic queue counts nothing: the adapter stamps
		// Attempts 1 on a first delivery and only the redelivered flag on
		// the others. The same deaths stop the message at the same
		// delivery.
		classic := dedup.Key{Consumer: "charge", Key: "order-oom-classic"}
		for range 2 {
			_, err := b.store.InboxStart(context.Background(), classic, time.Hour)
			require.NoError(t, err)
		}
		msg = delivery(classic.Key, "charge "+classic.Key)
		msg.Metadata.Set(dlv.Redelivered, "true")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, msg))
		dead = msgtest.Receive(t, rig.dead, 30*time.Second)
		dead.Ack()
		require.Equal(t, classic.Key, dead.Metadata.Get(dlv.IdempotencyKey))
		require.Equal(t, "3", dead.Metadata.Get(dlv.DeadAttempts))
		require.Contains(t, dead.Metadata.Get(dlv.DeadError), middleware.ErrCrashLoop.Error())
		require.Equal(t, int32(0), rig.calls.Load(), "the handler never ran")
		require.Equal(t, int64(2), rig.inbox.Stats().CrashLooped)

		survivor := dedup.Key{Consumer: "charge", Key: "order-ok"}
		_, err := b.store.InboxStart(context.Background(), survivor, time.Hour) // delivery 2 died
		require.NoError(t, err)
		msg = delivery(survivor.Key, "charge "+survivor.Key)
		msg.Metadata.Set(dlv.Attempts, "3")
		require.NoError(t, rig.pubSub.Publish(poisonTopic, msg))
		require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 5*time.Millisecond)
		require.Equal(t, "done", b.status(t, survivor.Consumer, survivor.Key))
		msgtest.Nothing(t, rig.dead, 200*time.Millisecond)
	})
}

// countingBroker stands for a broker that counts the deliveries of each
// message it was given (RabbitMQ quorum, SQS, JetStream) over a
// persistent GoChannel: every message published through it is a new
// broker message, and Middleware, first in the router's chain, stamps
// delivery.Attempts on each delivery of it, 1 on the first, one more on
// each redelivery after a nack.
type countingBroker struct {
	*gochannel.GoChannel
	mu     sync.Mutex
	counts map[string]int
}

const brokerMessageID = "test_broker_message_id"

func (b *countingBroker) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		m.Metadata.Set(brokerMessageID, watermill.NewUUID())
	}
	return b.GoChannel.Publish(topic, msgs...)
}

func (b *countingBroker) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		b.mu.Lock()
		id := msg.Metadata.Get(brokerMessageID)
		b.counts[id]++
		n := b.counts[id]
		b.mu.Unlock()
		msg.Metadata.Set(dlv.Attempts, strconv.Itoa(n))
		return h(msg)
	}
}

// TestReplayOnBrokerFirstDeliveryReopensDeadKey: with a broker that counts
// deliveries, a key dead-lettered after MaxAttempts 2, then replayed from
// the dead-letter table. The replay is a new broker message: its first
// delivery is not recorded, so it meets the dead key at the claim in the
// handler's transaction, not at a start, and still reopens it with its
// grant: the handler runs and applies the effect once; it is not acked as
// a copy of the dead key. A producer's copy of the dead key, also a first
// delivery, is acked as a dead copy without running.
func TestReplayOnBrokerFirstDeliveryReopensDeadKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	cfg := sqlschema.Config{Schema: schema}
	table, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	entries, err := dlq.NewStore(pool, cfg)
	require.NoError(t, err)
	b := postgresBackendIn(t, pool, schema)
	inbox := newInbox(t, middleware.InboxConfig{Consumer: "charge", TxStore: b.store})
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher: table, Topic: deadTopic, MaxAttempts: 2, Consumer: "charge",
		InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond,
	})
	require.NoError(t, err)

	logger := watermill.NopLogger{}
	broker := &countingBroker{GoChannel: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64, Persistent: true}, logger), counts: map[string]int{}}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	require.NoError(t, err)
	router.AddMiddleware(broker.Middleware, poison.Middleware, inbox.Middleware)
	var (
		broken atomic.Bool
		calls  atomic.Int32
	)
	broken.Store(true)
	router.AddConsumerHandler("charge", poisonTopic, broker.GoChannel, func(msg *message.Message) error {
		calls.Add(1)
		if broken.Load() {
			return errors.New("ledger unreachable through a bug")
		}
		return b.effect(msg.Context(), middleware.IdempotencyKey(msg.Context()))
	})
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, broker.Close())
	})

	require.NoError(t, broker.Publish(poisonTopic, delivery("pay-1", "charge pay-1")))
	var list []dlq.Entry
	require.Eventually(t, func() bool {
		list, err = entries.List(ctx, dlq.Filter{Consumer: "charge"})
		require.NoError(t, err)
		return len(list) == 1 && b.status(t, "charge", "pay-1") == "dead"
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int32(2), calls.Load(), "dead-lettered after MaxAttempts runs")
	require.Equal(t, "2", list[0].Metadata[dlv.DeadAttempts])
	broken.Store(false)

	// A producer's copy of the dead key: acked without running.
	require.NoError(t, broker.Publish(poisonTopic, delivery("pay-1", "charge pay-1")))
	require.Eventually(t, func() bool { return inbox.Stats().DeadCopies == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int32(2), calls.Load())

	n, err := entries.Replay(ctx, broker, dlq.Filter{IDs: []int64{list[0].ID}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Eventually(t, func() bool { return b.effects(t) == 1 }, 30*time.Second, 10*time.Millisecond,
		"the replay reopens the dead key and runs")
	require.Equal(t, "done", b.status(t, "charge", "pay-1"))
	require.Equal(t, int32(3), calls.Load(), "the replay ran the handler once")
	require.Equal(t, int64(1), inbox.Stats().DeadCopies, "the replay was not taken for a copy of the dead key")
	require.Equal(t, 1, b.effects(t))
}
