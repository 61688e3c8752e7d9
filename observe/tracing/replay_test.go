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
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/tracing"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestReplayedDeadLetterStaysInTheTrace: on PostgreSQL, a message that
// fails is dead-lettered by Poison into the dead-letter table (dlq.Publisher,
// in the claim's transaction); the entry keeps the trace context the
// message came with; once the cause is fixed, a replay, to the topic with
// dlq.Store.Replay or to the consumer alone with Store.RequestReplay and a
// dlq.ReplaySubscriber, is applied by the inbox in a span of the original
// trace, a child of the producer's span as the failed attempt's was, and
// the handler runs in it.
func TestReplayedDeadLetterStaysInTheTrace(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		replay func(t *testing.T, rig *replayRig, id int64)
	}{
		{"StoreReplay", func(t *testing.T, rig *replayRig, id int64) {
			n, err := rig.store.Replay(context.Background(), rig.broker, dlq.Filter{IDs: []int64{id}}, nil)
			require.NoError(t, err)
			require.Equal(t, 1, n, "entries replayed to the topic")
		}},
		{"RequestReplay", func(t *testing.T, rig *replayRig, id int64) {
			n, err := rig.store.RequestReplay(context.Background(), dlq.Filter{IDs: []int64{id}})
			require.NoError(t, err)
			require.Equal(t, 1, n, "entries marked for their consumer")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rig := startReplayRig(t)
			ctx := context.Background()

			_, prod, msg := producer(t, rig.r)
			prod.End()
			trace0, parent := prod.SpanContext().TraceID(), prod.SpanContext().SpanID()
			rig.failing.Store(true)
			require.NoError(t, rig.broker.Publish(replayTopic, msg))

			failed := waitSpan(t, rig.r, func(s sdktrace.ReadOnlySpan) bool {
				return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "failed"
			})
			require.Equal(t, trace0, failed.SpanContext().TraceID())
			require.Equal(t, parent, failed.Parent().SpanID(), "the failed attempt is the producer's child")
			require.Equal(t, codes.Error, failed.Status().Code)

			var entries []dlq.Entry
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				var err error
				entries, err = rig.store.List(ctx, dlq.Filter{All: true})
				require.NoError(c, err)
				require.Len(c, entries, 1)
			}, 30*time.Second, 10*time.Millisecond, "the dead letter is in the table")
			e := entries[0]
			require.Equal(t, msg.UUID, e.UUID)
			require.Equal(t, "billing", e.Consumer)
			inEntry := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(e.Metadata)))
			require.Equal(t, trace0, inEntry.TraceID(), "the dead letter keeps the trace")
			require.Equal(t, parent, inEntry.SpanID(), "the dead letter keeps the context the delivery came with")

			// The cause is fixed; the operator replays the entry.
			rig.failing.Store(false)
			tc.replay(t, rig, e.ID)

			applied := waitSpan(t, rig.r, func(s sdktrace.ReadOnlySpan) bool {
				return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "applied"
			})
			require.Equal(t, trace0, applied.SpanContext().TraceID(), "the replay is in the original trace")
			require.Equal(t, parent, applied.Parent().SpanID(), "the replay's inbox span is the producer's child, as the failed attempt's")
			require.True(t, applied.Parent().IsRemote(), "its parent came from the dead letter's metadata")
			require.NotEqual(t, failed.SpanContext().SpanID(), applied.SpanContext().SpanID())
			require.Equal(t, msg.UUID, attrs(applied)["messaging.message.id"].AsString())
			require.Equal(t, codes.Unset, applied.Status().Code)
			select {
			case ran := <-rig.applied:
				require.Equal(t, applied.SpanContext(), ran, "the handler ran in the replay's inbox span")
			case <-time.After(30 * time.Second):
				t.Fatal("the handler did not apply the replay")
			}

			require.EventuallyWithT(t, func(c *assert.CollectT) {
				n, err := rig.store.Count(ctx, dlq.Filter{All: true})
				require.NoError(c, err)
				require.Zero(c, n)
			}, 30*time.Second, 10*time.Millisecond, "the replayed entry is deleted")
			for _, s := range rig.r.sr.Ended() {
				require.Equal(t, trace0, s.SpanContext().TraceID(), "span %q is in the producer's trace", s.Name())
			}
		})
	}
}

const replayTopic = "orders.paid"

// replayRig is a consumer on PostgreSQL: Poison → inbox, dead letters in
// the table, the topic from a GoChannel merged with the consumer's
// requested replays.
type replayRig struct {
	r       recorded
	pool    *pgxpool.Pool
	store   *dlq.Store
	broker  *gochannel.GoChannel
	failing atomic.Bool
	// applied receives the span in the handler's context of every
	// delivery the handler applied.
	applied chan trace.SpanContext
}

func startReplayRig(t *testing.T) *replayRig {
	t.Helper()
	rig := &replayRig{r: newRecorded(t), pool: pgtest.Pool(t, 8), applied: make(chan trace.SpanContext, 4)}
	tr := rig.r.tracer(t)
	hooks := []observe.Hook{tr}
	schema := sqlschema.Config{Schema: pgtest.Schema(t, rig.pool)}
	store, err := postgres.New(rig.pool, postgres.Config{Schema: schema.Schema})
	require.NoError(t, err)
	rig.store, err = dlq.NewStore(rig.pool, schema)
	require.NoError(t, err)
	table, err := dlq.NewPublisher(rig.pool, schema)
	require.NoError(t, err)
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "billing", Hooks: hooks})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Publisher: table, Topic: replayTopic + ".dlq", MaxAttempts: 1, Hooks: hooks})
	require.NoError(t, err)
	replays, err := dlq.NewReplaySubscriber(rig.pool, schema, dlq.ReplaySubscriberConfig{Consumer: "billing", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	rig.broker = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("billing", replayTopic, dlq.WithReplays(rig.broker, replays), func(msg *message.Message) error {
		if rig.failing.Load() {
			return errors.New("ledger rejected the account")
		}
		rig.applied <- trace.SpanContextFromContext(msg.Context())
		return nil
	}).AddMiddleware(poison.Middleware, inbox.Middleware)
	routed := make(chan error, 1)
	go func() { routed <- router.Run(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-routed)
		require.NoError(t, replays.Close())
		require.NoError(t, rig.broker.Close())
	})
	<-router.Running()
	return rig
}
