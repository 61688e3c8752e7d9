package main

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestReopenRunsTheCorrectedCopyOnce: a consumer (the PostgreSQL inbox,
// the poison middleware, the dead-letter table) dead-letters an order
// whose data its handler rejects. "oncemill dlq reopen ID" lets the
// producer's corrected copy, a new message with a new payload under the
// same key, run once: its effect is committed once in the database; a
// copy after it, corrected or the old one, is dropped as a duplicate.
// Reopening again, or an entry with no key, is refused in one line.
func TestReopenRunsTheCorrectedCopyOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	_, err := f.pool.Exec(ctx, `CREATE TABLE `+effects+` (key text NOT NULL, payload text NOT NULL)`)
	require.NoError(t, err)
	applied := func() (rows [][2]string) {
		r, err := f.pool.Query(ctx, `SELECT key, payload FROM `+effects+` ORDER BY key`)
		require.NoError(t, err)
		for r.Next() {
			var k, p string
			require.NoError(t, r.Scan(&k, &p))
			rows = append(rows, [2]string{k, p})
		}
		require.NoError(t, r.Err())
		return rows
	}

	store, err := postgres.New(f.pool, postgres.Config{Schema: f.schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge"})
	require.NoError(t, err)
	deadLetters, err := dlq.NewPublisher(f.pool, sqlschema.Config{Schema: f.schema})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: deadLetters, Topic: "dead-letters", MaxAttempts: 3})
	require.NoError(t, err)
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 16}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	var calls atomic.Int32
	router.AddConsumerHandler("charge", "orders", broker, func(msg *message.Message) error {
		calls.Add(1)
		var order struct{ Amount string }
		if err := json.Unmarshal(msg.Payload, &order); err != nil || order.Amount == "" {
			return middleware.Permanent(errors.New("the order has no amount"))
		}
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+effects+` (key, payload) VALUES ($1, $2)`,
			middleware.IdempotencyKey(msg.Context()), string(msg.Payload))
		return err
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
	send := func(payload string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		m.Metadata.Set(delivery.IdempotencyKey, "order-7")
		require.NoError(t, broker.Publish("orders", m))
		return m
	}

	bad := send(`{"order":"7"}`)
	require.Eventually(t, func() bool { return len(f.ids(t)) == 1 }, 30*time.Second, 10*time.Millisecond, "the rejected order is dead-lettered")
	id := strconv.FormatInt(f.ids(t)[0], 10)

	r := f.dlq(t, "reopen", id)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, `reopened consumer "charge" key "order-7" and deleted entry `+id+
		": the next copy of the key runs once, whatever its payload; the copies after it are duplicates\n", r.stdout)
	require.Empty(t, f.ids(t), "the entry is gone")

	corrected := send(`{"order":"7","amount":"12.50"}`)
	require.NotEqual(t, bad.UUID, corrected.UUID)
	require.Eventually(t, func() bool { return len(applied()) == 1 }, 30*time.Second, 10*time.Millisecond, "the corrected copy runs")
	require.Equal(t, [][2]string{{"order-7", `{"order":"7","amount":"12.50"}`}}, applied())

	before := calls.Load()
	send(`{"order":"7","amount":"99.00"}`)
	require.NoError(t, broker.Publish("orders", bad.Copy()))
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, [][2]string{{"order-7", `{"order":"7","amount":"12.50"}`}}, applied(), "the copies after it are duplicates")
	require.Equal(t, before, calls.Load(), "a duplicate does not run the handler")
	require.Empty(t, f.ids(t), "and is no dead letter")

	r = f.dlq(t, "reopen", id)
	require.Equal(t, exitFailure, r.code)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, "nothing reopened: dlq: no such entry: "+id)

	noKey := dead("orders", "charge", "no key")
	noKey.Metadata.Set(delivery.DeadKey, "")
	ids := f.seedEntries(t, noKey)
	r = f.dlq(t, "reopen", strconv.FormatInt(ids[0], 10))
	require.Equal(t, exitFailure, r.code)
	require.Contains(t, r.stderr, "has no consumer or key")
	require.Equal(t, ids, f.ids(t), "a refused entry stays")

	r = f.dlq(t, "reopen")
	require.Equal(t, exitUsage, r.code)
	require.Contains(t, r.stderr, "missing ID: reopen takes one entry ID")
}

// TestReplayToConsumerWithoutSubscriber: a replay to a consumer whose
// replay subscriber never announced itself, or stopped, is refused before
// anything is requested, naming the consumer and the replay to the topic.
func TestReplayToConsumerWithoutSubscriber(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ids := f.seed(t, dead("orders", "ship", "no address"))
	id := strconv.FormatInt(ids[0], 10)

	r := f.dlq(t, "replay", id, "--to-consumer")
	require.Equal(t, exitFailure, r.code)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, `nothing requested: dlq: no replay subscriber seen for consumer "ship" ever; the request would wait in the table until one runs`)
	require.Contains(t, r.stderr, "use --broker URL (or BROKER_URL) to replay to the topic instead")
	require.Equal(t, 0, f.requested(t), "nothing requested")

	stopped := f.announce(t, "ship", 50*time.Millisecond)
	stopped()
	time.Sleep(200 * time.Millisecond) // more than three beats
	r = f.dlq(t, "replay", id, "--to-consumer")
	require.Equal(t, exitFailure, r.code)
	require.Regexp(t, `no replay subscriber seen for consumer "ship" since 20\d\d-`, r.stderr)
	require.Equal(t, 0, f.requested(t), "nothing requested")
}

// TestShowReplayedFrom: an entry of a replay that died again names the
// entry it came from; a replay of a permanent failure is warned about
// before it is sent.
func TestShowReplayedFrom(t *testing.T) {
	t.Parallel()
	f := setup(t)
	m := dead("orders", "charge", "card declined")
	m.Metadata.Set(dlq.ReplayedFrom, "41")
	m.Metadata.Set(delivery.DeadPermanent, "true")
	ids := f.seed(t, m)
	id := strconv.FormatInt(ids[0], 10)
	r := f.dlq(t, "show", id)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Regexp(t, `(?m)^Replayed from: +#41$`, r.stdout)

	broker := pgBroker(t, f.pool, "orders")
	msgs := subscribe(t, broker, "orders")
	r = f.dlq(t, "replay", id, "--broker", broker)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "warning: entry "+id+" cannot succeed as it is: its error is permanent: its replay fails the same way unless the handler changed; "+
		"for corrected data, reopen the key and have the producer send the message again\n", r.stderr)
	got := receive(t, msgs, 1)[m.UUID]
	require.NotNil(t, got, "replayed all the same")
	require.Equal(t, id, got.Metadata.Get(dlq.ReplayedFrom), "the replay names its entry")
}

// requested counts the entries whose replay to their consumer was
// requested.
func (f fixture) requested(t *testing.T) (n int) {
	t.Helper()
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{f.schema, "dlq"}.Sanitize()+
		` WHERE replay_requested_at IS NOT NULL`).Scan(&n))
	return n
}

// announce runs a replay subscriber of consumer, beating every beat,
// until the returned function (or the test's end) stops it. It subscribes
// to a topic of its own, with no entries: what a test wants of it is the
// announcement, not a delivery.
func (f fixture) announce(t *testing.T, consumer string, beat time.Duration) (stop func()) {
	t.Helper()
	r, err := dlq.NewReplaySubscriber(f.pool, sqlschema.Config{Schema: f.schema},
		dlq.ReplaySubscriberConfig{Consumer: consumer, BeatEvery: beat, PollInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	_, err = r.Subscribe(context.Background(), "announce-only")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		s, err := dlq.NewStore(f.pool, sqlschema.Config{Schema: f.schema})
		require.NoError(t, err)
		p, ok, err := s.Replayer(context.Background(), consumer)
		require.NoError(t, err)
		return ok && p.Alive
	}, 30*time.Second, 10*time.Millisecond, "the replay subscriber announced itself")
	stop = func() { require.NoError(t, r.Close()) }
	t.Cleanup(stop)
	return stop
}
