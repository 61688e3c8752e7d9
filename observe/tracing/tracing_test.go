package tracing_test

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
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/tracing"
	"github.com/oncemill/oncemill/sqlschema"
)

// recorded is a tracer provider whose spans the test reads back.
type recorded struct {
	tp *sdktrace.TracerProvider
	sr *tracetest.SpanRecorder
}

func newRecorded(t *testing.T, opts ...sdktrace.TracerProviderOption) recorded {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(append([]sdktrace.TracerProviderOption{sdktrace.WithSpanProcessor(sr)}, opts...)...)
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return recorded{tp: tp, sr: sr}
}

func (r recorded) tracer(t *testing.T) *tracing.Tracer {
	t.Helper()
	tr, err := tracing.New(tracing.Config{TracerProvider: r.tp})
	require.NoError(t, err)
	return tr
}

// ended returns the ended span named name; it fails unless exactly one.
func (r recorded) ended(t *testing.T, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	var found []sdktrace.ReadOnlySpan
	for _, s := range r.sr.Ended() {
		if s.Name() == name {
			found = append(found, s)
		}
	}
	require.Len(t, found, 1, "ended spans named %q", name)
	return found[0]
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func eventNames(s sdktrace.ReadOnlySpan) []string {
	var names []string
	for _, e := range s.Events() {
		names = append(names, e.Name)
	}
	return names
}

// producer starts a span standing for the service that wrote the event,
// and returns a message whose metadata carries it, as an OpenTelemetry
// Watermill publisher would have written it.
func producer(t *testing.T, r recorded) (context.Context, trace.Span, *message.Message) {
	t.Helper()
	ctx, span := r.tp.Tracer("test").Start(context.Background(), "checkout", trace.WithSpanKind(trace.SpanKindProducer))
	msg := message.NewMessage(watermill.NewUUID(), []byte("paid"))
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	require.NotEmpty(t, msg.Metadata.Get("traceparent"))
	return ctx, span, msg
}

func TestInboxSpanIsChildOfMetadataContext(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	_, prod, msg := producer(t, r)
	prod.End()

	ctx := tr.StartInboxAttempt(context.Background(), "billing", "orders.paid", msg)
	inCtx := trace.SpanFromContext(ctx)
	require.True(t, inCtx.IsRecording(), "the handler's context holds the inbox span")
	require.Equal(t, prod.SpanContext().TraceID(), inCtx.SpanContext().TraceID())
	tr.OnInboxStep(ctx, observe.StepClaimed)
	tr.OnInboxStep(ctx, observe.StepHandled)
	tr.OnInboxStep(ctx, observe.StepCommitted)
	require.Len(t, r.sr.Ended(), 1, "only the producer's span has ended")
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{
		Consumer: "billing", Topic: "orders.paid", Outcome: observe.Applied,
		Handler: 30 * time.Millisecond, Store: 4 * time.Millisecond,
	})

	s := r.ended(t, "oncemill.inbox billing")
	require.Equal(t, trace.SpanKindConsumer, s.SpanKind())
	require.Equal(t, prod.SpanContext().SpanID(), s.Parent().SpanID())
	require.Equal(t, prod.SpanContext().TraceID(), s.Parent().TraceID())
	require.True(t, s.Parent().IsRemote(), "the parent came from the metadata")
	require.Equal(t, tracing.ScopeName, s.InstrumentationScope().Name)
	a := attrs(s)
	require.Equal(t, "orders.paid", a["messaging.destination.name"].AsString())
	require.Equal(t, msg.UUID, a["messaging.message.id"].AsString())
	require.Equal(t, "process", a["messaging.operation.type"].AsString())
	require.Equal(t, "billing", a[tracing.ConsumerKey].AsString())
	require.Equal(t, "applied", a[tracing.OutcomeKey].AsString())
	require.InDelta(t, 0.030, a[tracing.HandlerDurationKey].AsFloat64(), 1e-9)
	require.InDelta(t, 0.004, a[tracing.StoreDurationKey].AsFloat64(), 1e-9)
	require.Equal(t, []string{"claimed", "handled", "committed"}, eventNames(s))
	require.Equal(t, codes.Unset, s.Status().Code)
}

func TestInboxSpanWithoutContextStartsATrace(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata = nil // a message straight from a decoder may have none
	ctx := tr.StartInboxAttempt(context.Background(), "billing", "", msg)
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Duplicate, Store: time.Millisecond})

	s := r.ended(t, "oncemill.inbox billing")
	require.False(t, s.Parent().IsValid())
	a := attrs(s)
	require.Equal(t, "duplicate", a[tracing.OutcomeKey].AsString())
	_, ok := a["messaging.destination.name"]
	require.False(t, ok, "no topic, no destination attribute")
	_, ok = a[tracing.HandlerDurationKey]
	require.False(t, ok, "the handler did not run")
	require.Equal(t, codes.Unset, s.Status().Code, "a duplicate is no error")
}

func TestUsersSpanIsParentAndNotEnded(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	_, prod, msg := producer(t, r)
	prod.End()

	// A user's own tracing middleware, in front of the inbox, started a
	// span of its own (here in a trace of its own, to tell them apart).
	userCtx, user := r.tp.Tracer("user-middleware").Start(context.Background(), "user.consume", trace.WithNewRoot())
	ctx := tr.StartInboxAttempt(userCtx, "billing", "orders.paid", msg)
	tr.OnInboxStep(ctx, observe.StepClaimed)
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Applied})

	s := r.ended(t, "oncemill.inbox billing")
	require.Equal(t, user.SpanContext().SpanID(), s.Parent().SpanID(), "the span in the context wins over the metadata")
	require.Equal(t, user.SpanContext().TraceID(), s.SpanContext().TraceID())
	require.True(t, user.IsRecording(), "the user's span is the user's to end")

	// Hooks called with only the user's span in the context leave it be.
	tr.OnInboxStep(userCtx, observe.StepHandled)
	tr.OnInboxAttempt(userCtx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Failed, Err: errors.New("boom")})
	require.True(t, user.IsRecording())
	user.End()
	u := r.ended(t, "user.consume")
	require.Empty(t, u.Events())
	require.Equal(t, codes.Unset, u.Status().Code)
	_, ok := attrs(u)[tracing.OutcomeKey]
	require.False(t, ok)
}

func TestTracerEndsOnlyItsOwnSpan(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	first, second := r.tracer(t), r.tracer(t)
	msg := message.NewMessage(watermill.NewUUID(), nil)

	// Both are hooks of one inbox: the second's span is a child of the
	// first's, and each ends its own.
	ctx := first.StartInboxAttempt(context.Background(), "billing", "t", msg)
	ctx = second.StartInboxAttempt(ctx, "billing", "t", msg)
	a := observe.InboxAttempt{Consumer: "billing", Outcome: observe.Applied}
	first.OnInboxAttempt(ctx, a)
	require.Len(t, r.sr.Ended(), 1)
	outer := r.sr.Ended()[0]
	require.False(t, outer.Parent().IsValid(), "the first tracer ended its own, outer span")
	second.OnInboxAttempt(ctx, a)
	require.Len(t, r.sr.Ended(), 2)
	require.Equal(t, outer.SpanContext().SpanID(), r.sr.Ended()[1].Parent().SpanID())
}

func TestFailedOutcomesAreErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		outcome observe.Outcome
		err     error
		isError bool
	}{
		{observe.Failed, errors.New("card declined"), true},
		{observe.Panicked, errors.New("panic: nil map"), true},
		{observe.Unavailable, errors.New("connection refused"), true},
		{observe.CrashLoop, errors.New("crash loop"), true},
		{observe.Rejected, errors.New("no key"), true},
		{observe.Failed, nil, true},
		{observe.Applied, nil, false},
		{observe.Duplicate, nil, false},
		{observe.Dead, nil, false},
		{observe.InFlight, errors.New("held by another delivery"), false},
		{observe.Abandoned, context.Canceled, false},
	} {
		t.Run(string(tc.outcome), func(t *testing.T) {
			t.Parallel()
			r := newRecorded(t)
			tr := r.tracer(t)
			ctx := tr.StartInboxAttempt(context.Background(), "billing", "t", message.NewMessage(watermill.NewUUID(), nil))
			tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: tc.outcome, Err: tc.err})
			s := r.ended(t, "oncemill.inbox billing")
			require.Equal(t, string(tc.outcome), attrs(s)[tracing.OutcomeKey].AsString())
			if !tc.isError {
				require.Equal(t, codes.Unset, s.Status().Code)
				require.Empty(t, s.Events())
				return
			}
			require.Equal(t, codes.Error, s.Status().Code)
			if tc.err == nil {
				require.Equal(t, string(tc.outcome), s.Status().Description)
				return
			}
			require.Equal(t, tc.err.Error(), s.Status().Description)
			require.Equal(t, []string{"exception"}, eventNames(s))
			require.Equal(t, tc.err.Error(), attrsOf(s.Events()[0].Attributes)["exception.message"].AsString())
		})
	}
}

func attrsOf(kvs []attribute.KeyValue) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range kvs {
		m[kv.Key] = kv.Value
	}
	return m
}

func TestOutboxWriteCarriesWritersSpan(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	ctx, span := r.tp.Tracer("test").Start(context.Background(), "checkout")
	defer span.End()

	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set("tenant", "acme")
	tr.OnMessageOut(ctx, observe.OutOutboxWrite, msg)
	require.Equal(t, "acme", msg.Metadata.Get("tenant"), "other metadata stays")
	got := extract(msg)
	require.Equal(t, span.SpanContext().TraceID(), got.TraceID())
	require.Equal(t, span.SpanContext().SpanID(), got.SpanID())

	bare := message.NewMessage(watermill.NewUUID(), nil)
	bare.Metadata = nil
	tr.OnMessageOut(ctx, observe.OutOutboxWrite, bare)
	require.Equal(t, span.SpanContext().SpanID(), extract(bare).SpanID(), "nil metadata is made")

	// Without a span in the context the message keeps what it has.
	none := message.NewMessage(watermill.NewUUID(), nil)
	tr.OnMessageOut(context.Background(), observe.OutOutboxWrite, none)
	require.Empty(t, none.Metadata)
}

func extract(msg *message.Message) trace.SpanContext {
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(msg.Metadata)))
}

func TestRelaySpanLinksProducerToConsumer(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	_, prod, msg := producer(t, r)
	prod.End()

	tr.OnMessageOut(context.Background(), observe.OutRelay, msg)
	relay := r.ended(t, "oncemill.relay")
	require.Equal(t, trace.SpanKindProducer, relay.SpanKind())
	require.Equal(t, prod.SpanContext().SpanID(), relay.Parent().SpanID())
	require.Equal(t, prod.SpanContext().TraceID(), relay.SpanContext().TraceID())
	a := attrs(relay)
	require.Equal(t, msg.UUID, a["messaging.message.id"].AsString())
	require.Equal(t, "send", a["messaging.operation.type"].AsString())
	require.Equal(t, relay.SpanContext().SpanID(), extract(msg).SpanID(), "the message now carries the relay's span")

	ctx := tr.StartInboxAttempt(context.Background(), "billing", "orders.paid", msg)
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Applied})
	in := r.ended(t, "oncemill.inbox billing")
	require.Equal(t, relay.SpanContext().SpanID(), in.Parent().SpanID())
	require.Equal(t, prod.SpanContext().TraceID(), in.SpanContext().TraceID())
}

func TestRelayRowWithoutContextStartsATrace(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	tr.OnMessageOut(context.Background(), observe.OutRelay, msg)
	relay := r.ended(t, "oncemill.relay")
	require.False(t, relay.Parent().IsValid())
	require.Equal(t, relay.SpanContext().SpanID(), extract(msg).SpanID())
}

// TestDeadLetterAndReplayStayInTheTrace drives the hooks by hand for a
// dead letter sent from a context that holds a span (in a service, a
// tracing middleware of the user's in front of Poison): the dead letter
// and its replay continue from that span.
// TestReplayedDeadLetterStaysInTheTrace replays real dead letters.
func TestDeadLetterAndReplayStayInTheTrace(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	_, prod, msg := producer(t, r)
	prod.End()

	ctx := tr.StartInboxAttempt(context.Background(), "billing", "orders.paid", msg)
	attempt := trace.SpanFromContext(ctx).SpanContext()
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Failed, Err: errors.New("declined")})

	// The poison middleware, with a span of its own around the attempt,
	// dead-letters the message.
	pctx, poison := r.tp.Tracer("test").Start(context.Background(), "poison")
	tr.OnDeadLetter(pctx, observe.DeadLetter{Consumer: "billing", Topic: "orders.paid", Reason: observe.ReasonError, Attempts: 5})
	poison.End()
	p := r.ended(t, "poison")
	require.Equal(t, []string{tracing.EventDeadLettered}, eventNames(p))
	ev := attrsOf(p.Events()[0].Attributes)
	require.Equal(t, "error", ev[tracing.ReasonKey].AsString())
	require.Equal(t, int64(5), ev[tracing.AttemptsKey].AsInt64())

	// The dead letter sent from the attempt's context is its child.
	dlq := msg.Copy()
	tr.OnMessageOut(ctx, observe.OutDeadLetter, dlq)
	require.Equal(t, attempt.SpanID(), extract(dlq).SpanID())
	require.Equal(t, prod.SpanContext().TraceID(), extract(dlq).TraceID())

	// A replay rebuilds the message from the dead letter's metadata, and
	// the trace goes on from the failed attempt.
	replay := message.NewMessage(dlq.UUID, dlq.Payload)
	for k, v := range dlq.Metadata {
		replay.Metadata.Set(k, v)
	}
	ctx = tr.StartInboxAttempt(context.Background(), "billing", "orders.paid", replay)
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Applied})
	var retried sdktrace.ReadOnlySpan
	for _, s := range r.sr.Ended() {
		if s.Parent().SpanID() == attempt.SpanID() {
			retried = s
		}
	}
	require.NotNil(t, retried, "the replay's delivery is in the same trace, after the failed attempt")
	require.Equal(t, prod.SpanContext().TraceID(), retried.SpanContext().TraceID())
}

func TestUnsampledSpansPropagateAndRecordNothing(t *testing.T) {
	t.Parallel()
	r := newRecorded(t, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())))
	tr := r.tracer(t)
	msg := message.NewMessage(watermill.NewUUID(), nil)

	tr.OnMessageOut(context.Background(), observe.OutRelay, msg)
	sc := extract(msg)
	require.True(t, sc.IsValid(), "the decision not to sample travels too")
	require.False(t, sc.IsSampled())

	ctx := tr.StartInboxAttempt(context.Background(), "billing", "t", msg)
	require.Equal(t, sc.TraceID(), trace.SpanContextFromContext(ctx).TraceID())
	tr.OnInboxStep(ctx, observe.StepClaimed)
	tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: "billing", Outcome: observe.Failed, Err: errors.New("x")})
	require.Empty(t, r.sr.Started())
	require.Empty(t, r.sr.Ended())
}

func TestDefaultsPropagateTraceContext(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	// No propagator given, and none set globally: W3C Trace Context.
	tr := r.tracer(t)
	ctx, span := r.tp.Tracer("test").Start(context.Background(), "x")
	defer span.End()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	tr.OnMessageOut(ctx, observe.OutOutboxWrite, msg)
	require.Contains(t, msg.Metadata, "traceparent")

	// A propagator given is used, here one that adds baggage.
	tr, err := tracing.New(tracing.Config{TracerProvider: r.tp, Propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})})
	require.NoError(t, err)
	msg = message.NewMessage(watermill.NewUUID(), nil)
	tr.OnMessageOut(ctx, observe.OutOutboxWrite, msg)
	require.Contains(t, msg.Metadata, "traceparent")

	// With everything defaulted (the global no-op provider) nothing is
	// recorded and nothing breaks.
	def, err := tracing.New(tracing.Config{})
	require.NoError(t, err)
	msg = message.NewMessage(watermill.NewUUID(), nil)
	c := def.StartInboxAttempt(context.Background(), "billing", "t", msg)
	def.OnInboxAttempt(c, observe.InboxAttempt{Outcome: observe.Applied})
	def.OnMessageOut(context.Background(), observe.OutRelay, msg)
	require.Empty(t, msg.Metadata)
}

func TestNoAllocationsWhenNotRecording(t *testing.T) {
	tr, err := tracing.New(tracing.Config{TracerProvider: noop.NewTracerProvider()})
	require.NoError(t, err)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	ctx := context.Background()
	a := observe.InboxAttempt{Consumer: "billing", Outcome: observe.Failed, Err: errors.New("x")}
	allocs := testing.AllocsPerRun(100, func() {
		c := tr.StartInboxAttempt(ctx, "billing", "orders", msg)
		tr.OnInboxStep(c, observe.StepClaimed)
		tr.OnInboxAttempt(c, a)
		tr.OnDeadLetter(c, observe.DeadLetter{Reason: observe.ReasonError})
		tr.OnMessageOut(c, observe.OutDeadLetter, msg)
		tr.OnMessageOut(c, observe.OutRelay, msg)
	})
	require.LessOrEqual(t, allocs, 2.0, "at most the two contexts holding no-op spans")
}

func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	const workers, each = 8, 50
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				consumer := []string{"billing", "shipping", "mail"}[i%3]
				msg := message.NewMessage(watermill.NewUUID(), nil)
				tr.OnMessageOut(context.Background(), observe.OutRelay, msg)
				ctx := tr.StartInboxAttempt(context.Background(), consumer, "t", msg)
				tr.OnInboxStep(ctx, observe.StepClaimed)
				tr.OnInboxAttempt(ctx, observe.InboxAttempt{Consumer: consumer, Outcome: observe.Applied})
			}
		}()
	}
	wg.Wait()
	require.Len(t, r.sr.Ended(), 2*workers*each)
	for _, s := range r.sr.Ended() {
		if s.SpanKind() == trace.SpanKindConsumer {
			require.Contains(t, []string{"oncemill.inbox billing", "oncemill.inbox shipping", "oncemill.inbox mail"}, s.Name())
		}
	}
}

// TestTraceFollowsEventThroughOutboxRelayAndInbox: a service writes an
// event in its transaction while a span is current; the relay publishes
// it; a consumer's inbox applies it and writes an event of its own to its
// outbox; a redelivery is a duplicate. Every span is in the producer's
// trace: producer → relay → inbox (applied) → the consumer's relay, and
// the duplicate's inbox span is the relay span's child too.
func TestTraceFollowsEventThroughOutboxRelayAndInbox(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	pool := pgtest.Pool(t, 8)
	schema := sqlschema.Config{Schema: pgtest.Schema(t, pool)}
	store, err := postgres.New(pool, postgres.Config{Schema: schema.Schema})
	require.NoError(t, err)
	ctx := context.Background()
	const topic, shipped = "orders.paid", "orders.shipped"

	// The consumer: a router with the inbox, whose handler writes an
	// event of its own through the consumer outbox.
	broker := adapters.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16, Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:  store,
		Consumer: "billing",
		Outbox:   forwarder.InboxOutbox(shipped, schema, forwarder.WithHooks(tr)),
		Hooks:    []observe.Hook{tr},
	})
	require.NoError(t, err)
	type seen struct {
		span trace.SpanContext
		msg  *message.Message
	}
	handled := make(chan seen, 4)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(inbox.Middleware)
	router.AddHandler("billing", topic, broker, shipped, broker, func(msg *message.Message) ([]*message.Message, error) {
		handled <- seen{span: trace.SpanContextFromContext(msg.Context()), msg: msg.Copy()}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("ship A-42"))}, nil
	})
	routed := make(chan error, 1)
	go func() { routed <- router.Run(ctx) }()
	t.Cleanup(func() {
		require.NoError(t, router.Close())
		require.NoError(t, <-routed)
	})
	<-router.Running()

	// The producer writes the event with its business change, in one
	// transaction, while its span is current.
	pctx, prod := r.tp.Tracer("shop").Start(ctx, "checkout")
	tx, err := pool.Begin(pctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	events, err := forwarder.NewTxPublisher(pctx, tx, schema, forwarder.WithHooks(tr))
	require.NoError(t, err)
	event := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"A-42"}`))
	require.NoError(t, events.Publish(topic, event))
	require.NoError(t, tx.Commit(ctx))
	prod.End()
	require.NotContains(t, event.Metadata, "traceparent", "the caller's message is left as it was")

	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: broker, Schema: schema, Hooks: []observe.Hook{tr}})
	require.NoError(t, err)
	relayRows(t, relay, 1)

	var first seen
	select {
	case first = <-handled:
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer got no message")
	}
	applied := waitSpan(t, r, func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "applied"
	})
	rel := r.ended(t, "oncemill.relay")
	trace0 := prod.SpanContext().TraceID()

	require.Equal(t, trace.SpanKindProducer, rel.SpanKind())
	require.Equal(t, prod.SpanContext().SpanID(), rel.Parent().SpanID(), "the relay span is the producer's child")
	require.Equal(t, trace0, rel.SpanContext().TraceID())
	require.Equal(t, event.UUID, attrs(rel)["messaging.message.id"].AsString())

	require.Equal(t, trace.SpanKindConsumer, applied.SpanKind())
	require.Equal(t, rel.SpanContext().SpanID(), applied.Parent().SpanID(), "the inbox span is the relay span's child")
	require.Equal(t, trace0, applied.SpanContext().TraceID())
	require.Equal(t, topic, attrs(applied)["messaging.destination.name"].AsString())
	require.Equal(t, event.UUID, attrs(applied)["messaging.message.id"].AsString())
	require.Equal(t, []string{"claimed", "handled", "committed"}, eventNames(applied))
	require.Equal(t, applied.SpanContext(), first.span, "the handler ran in the inbox span")

	// The consumer's own event carries its inbox span on: the relay that
	// publishes it is the inbox span's child. A downstream consumer
	// subscribes first: the GoChannel refuses a topic nobody reads.
	downstream, err := broker.Subscribe(ctx, shipped)
	require.NoError(t, err)
	relayRows(t, relay, 1)
	select {
	case m := <-downstream:
		m.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("the downstream consumer got no event")
	}
	next := waitSpan(t, r, func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "oncemill.relay" && s.Parent().SpanID() == applied.SpanContext().SpanID()
	})
	require.Equal(t, trace0, next.SpanContext().TraceID())

	// The broker delivers the same message again: a duplicate, in the
	// same trace, under the same relay span.
	require.NoError(t, broker.Publish(topic, first.msg.Copy()))
	dup := waitSpan(t, r, func(s sdktrace.ReadOnlySpan) bool {
		return s.Name() == "oncemill.inbox billing" && attrs(s)[tracing.OutcomeKey].AsString() == "duplicate"
	})
	require.Equal(t, trace0, dup.SpanContext().TraceID())
	require.Equal(t, rel.SpanContext().SpanID(), dup.Parent().SpanID())
	require.NotEqual(t, applied.SpanContext().SpanID(), dup.SpanContext().SpanID())
	require.Equal(t, codes.Unset, dup.Status().Code)
	require.Len(t, handled, 0, "the duplicate did not run the handler")

	for _, s := range r.sr.Ended() {
		require.Equal(t, trace0, s.SpanContext().TraceID(), "span %q is in the producer's trace", s.Name())
	}
}

// relayRows runs relay batches until want rows went out.
func relayRows(t *testing.T, r *forwarder.Relay, want int) {
	t.Helper()
	total := 0
	require.Eventually(t, func() bool {
		n, err := r.RelayBatch(context.Background())
		require.NoError(t, err)
		total += n
		return total >= want
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, want, total)
}

// waitSpan waits for one ended span that match says is the one.
func waitSpan(t *testing.T, r recorded, match func(sdktrace.ReadOnlySpan) bool) sdktrace.ReadOnlySpan {
	t.Helper()
	var found sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool {
		for _, s := range r.sr.Ended() {
			if match(s) {
				found = s
				return true
			}
		}
		return false
	}, 30*time.Second, 5*time.Millisecond)
	return found
}

// TestDeadLetterStaysInTheTrace: a message that fails is dead-lettered by
// the poison middleware in front of the inbox; the dead letter carries the
// trace context the delivery had, and the failed attempt's span is an
// error in that trace.
func TestDeadLetterStaysInTheTrace(t *testing.T) {
	t.Parallel()
	r := newRecorded(t)
	tr := r.tracer(t)
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	hooks := []observe.Hook{tr}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "billing", Hooks: hooks})
	require.NoError(t, err)
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dlq, Topic: "billing.dlq", MaxAttempts: 1, Hooks: hooks})
	require.NoError(t, err)
	handler := poison.Middleware(inbox.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("ledger rejected the account")
	}))

	_, prod, msg := producer(t, r)
	prod.End()
	tr.OnMessageOut(context.Background(), observe.OutRelay, msg)
	relayed := extract(msg)
	_, err = handler(msg)
	require.NoError(t, err, "dead-lettered and acked")

	failed := r.ended(t, "oncemill.inbox billing")
	require.Equal(t, codes.Error, failed.Status().Code)
	require.Equal(t, "failed", attrs(failed)[tracing.OutcomeKey].AsString())
	require.Equal(t, relayed.SpanID(), failed.Parent().SpanID())

	dead, err := dlq.Subscribe(context.Background(), "billing.dlq")
	require.NoError(t, err)
	var d *message.Message
	select {
	case d = <-dead:
		d.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("no dead letter")
	}
	got := extract(d)
	require.Equal(t, prod.SpanContext().TraceID(), got.TraceID(), "the dead letter is in the producer's trace")
}
