package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/nats"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

// natsServer is the NATS server with JetStream the tests use,
// ONCEMILL_NATS_URL else nats://127.0.0.1:4222, and a JetStream client
// of it; every stream named by the returned func is deleted when the test
// ends.
func natsServer(t *testing.T) (string, jetstream.JetStream, func(topic string)) {
	t.Helper()
	u := os.Getenv("ONCEMILL_NATS_URL")
	if u == "" {
		u = "nats://127.0.0.1:4222"
	}
	nc, err := natsgo.Connect(u, natsgo.Timeout(5*time.Second))
	if err != nil {
		pgtest.Unavailable(t, "NATS at "+u, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	track := func(topic string) {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := js.DeleteStream(ctx, nats.Config{}.StreamName(topic)); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Errorf("delete the stream of %s: %v", topic, err)
			}
		})
	}
	return u, js, track
}

// TestReplayToNATS: a consumer on NATS JetStream (the PostgreSQL inbox,
// the poison middleware and the dead-letter table) dead-letters a
// message its handler rejects. Once the handler is fixed, "oncemill dlq
// replay --broker nats://…" publishes it to its topic: JetStream does not
// drop the replay as a copy of the original, whose Nats-Msg-Id (the
// idempotency key) is still in the stream's duplicate window; the
// consumer's inbox reopens the dead key for it and applies it once; the
// entry is deleted. A replay to a topic with no stream fails in one line
// that names the stream and keeps the entry.
func TestReplayToNATS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := setup(t)
	server, js, track := natsServer(t)
	topic := "cli.replay." + pgtest.Name(t)
	track(topic)

	effects := pgx.Identifier{f.schema, "effects"}.Sanitize()
	_, err := f.pool.Exec(ctx, `CREATE TABLE `+effects+` (key text NOT NULL)`)
	require.NoError(t, err)
	countEffects := func() (n int) {
		require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*) FROM `+effects).Scan(&n))
		return n
	}
	store, err := postgres.New(f.pool, postgres.Config{Schema: f.schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge"})
	require.NoError(t, err)
	deadLetters, err := dlq.NewPublisher(f.pool, sqlschema.Config{Schema: f.schema})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: deadLetters, Topic: "dead-letters", MaxAttempts: 3})
	require.NoError(t, err)
	var broken atomic.Bool
	broken.Store(true)
	runCtx, stop := context.WithCancel(ctx)
	ps, err := adapters.Open(runCtx, server+"?create=true&group="+pgtest.Name(t), adapters.Options{})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("charge", topic, ps.Subscriber, func(msg *message.Message) error {
		if broken.Load() {
			return middleware.Permanent(errors.New("the ledger rejects it"))
		}
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `INSERT INTO `+effects+` (key) VALUES ($1)`, middleware.IdempotencyKey(msg.Context()))
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
		require.NoError(t, ps.Close())
	})

	const key = "order-7"
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"7"}`))
	msg.Metadata.Set(delivery.IdempotencyKey, key)
	require.NoError(t, ps.Publisher.Publish(topic, msg))
	require.Eventually(t, func() bool { return len(f.ids(t)) == 1 }, 30*time.Second, 10*time.Millisecond, "the rejected message is dead-lettered")
	ids := f.ids(t)
	broken.Store(false)

	// The entry names its JetStream place, and who counted its attempts.
	r := f.dlq(t, "show", strconv.FormatInt(ids[0], 10))
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Regexp(t, `(?m)^JetStream stream: +`+regexp.QuoteMeta(nats.Config{}.StreamName(topic))+`$`, r.stdout)
	require.Regexp(t, `(?m)^JetStream sequence: +[1-9][0-9]*$`, r.stdout)
	require.Regexp(t, `(?m)^Failed attempts: +[1-9][0-9]* \(counted by the inbox\)$`, r.stdout)
	require.NotContains(t, r.stdout, "Kafka")

	stream, err := js.Stream(ctx, nats.Config{}.StreamName(topic))
	require.NoError(t, err)
	streamMsgs := func() int {
		info, err := stream.Info(ctx)
		require.NoError(t, err)
		return int(info.State.Msgs)
	}
	require.Equal(t, 1, streamMsgs())

	r = f.dlq(t, "replay", strconv.FormatInt(ids[0], 10), "--broker", server)
	require.Equal(t, exitOK, r.code, r.stderr)
	require.Equal(t, "replayed 1 entry\n", r.stdout)
	require.Equal(t, "warning: entry "+strconv.FormatInt(ids[0], 10)+" cannot succeed as it is: its error is permanent: "+
		"its replay fails the same way unless the handler changed; for corrected data, reopen the key and have the producer send the message again\n",
		r.stderr, "the permanent failure is named before the replay, which the fixed handler takes")
	require.Empty(t, f.ids(t), "the entry is deleted once published")
	require.Equal(t, 2, streamMsgs(), "the replay is stored beside the original, not dropped as its copy")
	require.Eventually(t, func() bool { return countEffects() == 1 }, 30*time.Second, 10*time.Millisecond, "the replay is applied")
	var status string
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT status FROM `+pgx.Identifier{f.schema, "inbox"}.Sanitize()+` WHERE consumer = 'charge' AND key = $1`, key).Scan(&status))
	require.Equal(t, "done", status)

	// A topic without a stream: the adapter creates none unless told to.
	missing := "cli.replay.missing." + pgtest.Name(t)
	track(missing)
	lost := f.seed(t, dead(missing, "charge", "boom"))
	r = f.dlq(t, "replay", "--all", "--broker", server)
	require.Equal(t, exitFailure, r.code, r.stderr)
	requireOneLine(t, r.stderr)
	require.Contains(t, r.stderr, fmt.Sprintf("oncemill dlq replay: replayed 0 of 1 entries, then: dlq: replay entry %d", lost[0]))
	require.Contains(t, r.stderr, nats.ErrStreamNotFound.Error())
	require.Contains(t, r.stderr, "nats stream add "+nats.Config{}.StreamName(missing))
	require.Equal(t, lost, f.ids(t), "the entry stays")
	require.Equal(t, 1, countEffects(), "nothing else applied")
}
