package middleware_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup/postgres"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestParkedUnderOneConsumerName: Poison given a consumer name of its own
// (PoisonConfig.Consumer, as Poison.Subscriber's error suggests) in front
// of an inbox that scopes keys under another: a failing message is parked
// under Poison's name, the one its retry subscriber hands back and its
// key's later messages look under, so that it comes back and applies, the
// next message of its key after it; the two names differing is said
// once, at Error.
func TestParkedUnderOneConsumerName(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 8)
	schema := pgtest.Schema(t, pool)
	cfg := sqlschema.Config{Schema: schema}
	store, err := postgres.New(pool, postgres.Config{Schema: schema})
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "ledger-inbox", Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	dead, err := dlq.NewPublisher(pool, cfg)
	require.NoError(t, err)
	parked, err := retry.NewStore(pool, cfg)
	require.NoError(t, err)
	logs := watermill.NewCaptureLogger()
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Consumer: "ledger", Publisher: dead, Retries: parked,
		MaxAttempts: 1, Delays: []time.Duration{100 * time.Millisecond}, Logger: logs})
	require.NoError(t, err)

	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { require.NoError(t, gc.Close()) })
	sub, err := poison.Subscriber(gc)
	require.NoError(t, err)
	var (
		mu      sync.Mutex
		failed  bool
		applied []string
	)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	router.AddConsumerHandler("ledger", "payments", sub, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if string(msg.Payload) == "a-1" && !failed {
			failed = true
			return errors.New("ledger busy")
		}
		applied = append(applied, string(msg.Payload))
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	publish := func(payload string) {
		msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
		msg.Metadata.Set(dlv.PartitionKey, "acct-a")
		require.NoError(t, gc.Publish("payments", msg))
	}
	publish("a-1")
	require.Eventually(t, func() bool { return poison.Stats().Parked == 1 }, 10*time.Second, 5*time.Millisecond)
	publish("a-2")
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(applied) == 2
	}, 20*time.Second, 10*time.Millisecond, "the parked message came back to its handler, and the next of its key after it")
	mu.Lock()
	require.Equal(t, []string{"a-1", "a-2"}, applied)
	mu.Unlock()
	require.Eventually(t, func() bool {
		rows, err := parked.List(context.Background(), retry.Filter{All: true})
		require.NoError(t, err)
		return len(rows) == 0
	}, 10*time.Second, 10*time.Millisecond, "nothing left parked once the acks are written")
	said := 0
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if m.Msg == "The inbox and the poison middleware name the consumer differently" {
			said++
		}
	}
	require.Equal(t, 1, said, "the two names said once")
}

// TestClassifyPanicIsNotTheProcessDying: a Classify that panics on an
// error is recovered; the failure is decided by DefaultClassify (counted,
// retried, dead-lettered at MaxAttempts with its own error), never taken
// for a process that died.
func TestClassifyPanicIsNotTheProcessDying(t *testing.T) {
	t.Parallel()
	b := postgresBackend(t, 4)
	sink := &deadSink{}
	logs := watermill.NewCaptureLogger()
	inbox := newInbox(t, middleware.InboxConfig{TxStore: b.store, Consumer: "charge", Logger: watermill.NopLogger{}})
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: sink, Topic: "dlq", MaxAttempts: 3,
		InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond, Logger: logs,
		Classify: func(err error) middleware.Decision {
			var nilMap map[string]middleware.Decision
			nilMap["x"] = middleware.Retry // a bug in the classifier
			return middleware.Retry
		}})
	require.NoError(t, err)
	var runs int
	_, err = poison.Middleware(inbox.Middleware(func(*message.Message) ([]*message.Message, error) {
		runs++
		return nil, errors.New("ledger refuses")
	}))(hookMsg("order-9"))
	require.NoError(t, err, "dead-lettered and acked")
	require.Equal(t, 3, runs, "retried by the default policy")
	require.Len(t, sink.msgs, 1)
	require.Equal(t, "ledger refuses", sink.msgs[0].Metadata.Get(dlv.DeadError), "its own error, not a crash loop")
	require.Equal(t, "3", sink.msgs[0].Metadata.Get(dlv.DeadAttempts))
	panics := 0
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if m.Msg == "PoisonConfig.Classify panicked: the failure is decided by DefaultClassify" {
			panics++
		}
	}
	require.Equal(t, 3, panics)
}
