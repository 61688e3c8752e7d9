package tracing_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/tracing"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestParkedMessageStaysInTheTrace: on PostgreSQL, a message whose attempt
// fails is parked for a delayed retry (PoisonConfig.Retries) and handed
// back by the retry subscriber; the attempt that applies it, after the
// wait, is a span of the producer's trace, the producer's child as the
// failed attempt's was: the trace goes on across the wait.
func TestParkedMessageStaysInTheTrace(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	hooks := []observe.Hook{r.tracer(t)}
	pool := pgtest.Pool(t, 8)
	schema := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	store, err := postgres.New(pool, postgres.Config{Schema: schema.Schema})
	require.NoError(t, err)
	table, err := dlq.NewPublisher(pool, schema)
	require.NoError(t, err)
	parked, err := retry.NewStore(pool, schema)
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "billing", Hooks: hooks})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: table, Retries: parked, MaxAttempts: 1,
		Delays: []time.Duration{300 * time.Millisecond}, Hooks: hooks})
	require.NoError(t, err)
	broker := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	sub, err := poison.Subscriber(broker)
	require.NoError(t, err)

	var runs atomic.Int32
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("billing", replayTopic, sub, func(msg *message.Message) error {
		if runs.Add(1) == 1 {
			return errors.New("ledger busy")
		}
		return nil
	}).AddMiddleware(poison.Middleware, inbox.Middleware)
	routed := make(chan error, 1)
	go func() { routed <- router.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-routed)
		require.NoError(t, broker.Close())
	})
	<-router.Running()

	_, prod, msg := producer(t, r)
	prod.End()
	trace0, parent := prod.SpanContext().TraceID(), prod.SpanContext().SpanID()
	require.NoError(t, broker.Publish(replayTopic, msg))

	failed := waitSpan(t, r, func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "failed"
	})
	applied := waitSpan(t, r, func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "applied"
	})
	require.Equal(t, trace0, failed.SpanContext().TraceID())
	require.Equal(t, trace0, applied.SpanContext().TraceID(), "the attempt after the wait is in the producer's trace")
	require.Equal(t, parent, applied.Parent().SpanID(), "the producer's child, as the failed attempt")
	require.True(t, applied.Parent().IsRemote(), "its parent came from the parked message's metadata")
	require.GreaterOrEqual(t, applied.StartTime().Sub(failed.EndTime()), 300*time.Millisecond, "it ran after the wait")
	require.Equal(t, int64(1), poison.Stats().Parked)
}
