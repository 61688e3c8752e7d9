// Package tracing turns oncemill's hooks (package observe) into
// OpenTelemetry spans, so that one trace follows an event from the
// transaction that wrote it to the outbox, through the relay, to the inbox
// that applied it, and on to a dead-letter queue and a replay.
//
// A [Tracer] is one hook for all of them: give it to InboxConfig.Hooks,
// PoisonConfig.Hooks, RelayConfig.Hooks and forwarder.WithHooks.
//
// # Spans
//
//   - "oncemill.inbox <consumer>", kind Consumer: one per delivery through
//     the inbox, duplicates included, with the events "claimed",
//     "handled" and "committed" as the attempt passes them, and the
//     attributes messaging.destination.name (the topic),
//     messaging.message.id, oncemill.consumer, and at its end
//     oncemill.outcome, oncemill.handler.duration and
//     oncemill.store.duration (seconds). Failed, panicked, crash-looping,
//     rejected and unavailable deliveries record their error and end with
//     status Error. The handler runs with this span in its context, so
//     that its own spans, and the events it writes to a consumer outbox,
//     are the span's children.
//   - "oncemill.relay", kind Producer: one per outbox row the relay
//     publishes, a child of the span that wrote the row (a new trace for a
//     row written without one), and the parent of the consumers' inbox
//     spans. It ends as the row is handed to the publisher.
//   - "dead_lettered", an event with oncemill.reason and oncemill.attempts,
//     on the span in the poison middleware's context, when it has one.
//
// # Propagation
//
// Trace context travels in the message's metadata under the propagator's
// keys: with the default propagator, the W3C Trace Context keys
// "traceparent" and "tracestate", the keys OpenTelemetry middlewares for
// Watermill read and write through propagation.MapCarrier(msg.Metadata).
// An event written to the outbox carries the writer's span; the relay
// replaces it with its own span, a child of the writer's. A dead letter
// carries the span in the poison middleware's context when it has one, or
// else the context the delivered message had; a replay is rebuilt from the
// dead letter's metadata. Both stay in the original trace.
//
// # With a tracing middleware of one's own
//
// When the message's context already holds a valid span, say one a
// tracing middleware in front of the inbox started from the same
// metadata, the inbox span is that span's child and the metadata is not
// read again. A Tracer ends only spans it started itself: never the
// user's.
//
// # Cost
//
// A span that is not recorded (a no-op provider, or not sampled) gets no
// attributes or events; with a no-op provider a delivery costs one
// allocation, the context that carries the span.
package tracing

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncemill/oncemill/observe"
)

// ScopeName is the instrumentation scope of the spans a Tracer starts.
const ScopeName = "github.com/oncemill/oncemill/observe/tracing"

// Attribute keys of oncemill's own, beside the semantic conventions'
// messaging.* attributes.
const (
	// ConsumerKey is the inbox's consumer name.
	ConsumerKey = attribute.Key("oncemill.consumer")
	// OutcomeKey is the delivery's [observe.Outcome].
	OutcomeKey = attribute.Key("oncemill.outcome")
	// HandlerDurationKey is how long the handler ran, in seconds; absent
	// when it did not run.
	HandlerDurationKey = attribute.Key("oncemill.handler.duration")
	// StoreDurationKey is the time the delivery spent in the inbox outside
	// the handler (the store's statements, the wait on another delivery),
	// in seconds.
	StoreDurationKey = attribute.Key("oncemill.store.duration")
	// ReasonKey is the [observe.Reason] a message was dead-lettered for.
	ReasonKey = attribute.Key("oncemill.reason")
	// AttemptsKey is the number of attempts a dead-lettered message had.
	AttemptsKey = attribute.Key("oncemill.attempts")
)

// The span events a Tracer adds.
const (
	// EventDeadLettered is added to the span in the poison middleware's
	// context when it dead-letters a message.
	EventDeadLettered = "dead_lettered"
)

// Config configures a [Tracer]. The zero value uses OpenTelemetry's global
// tracer provider and propagator.
type Config struct {
	// TracerProvider starts the spans. Defaults to otel.GetTracerProvider(),
	// which follows a provider set globally later.
	TracerProvider trace.TracerProvider
	// Propagator reads and writes trace context in message metadata.
	// Defaults to otel.GetTextMapPropagator(), and to
	// propagation.TraceContext{} when that is still OpenTelemetry's
	// no-op default when New is called.
	Propagator propagation.TextMapPropagator
}

// Tracer is an observe hook that records oncemill's work as OpenTelemetry
// spans; see the package documentation. It is safe for concurrent use.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator

	inboxNames names
}

// relaySpanName names the relay's spans. The relay does not tell its hooks
// the row's topic, so the name does not say it.
const relaySpanName = "oncemill.relay"

var (
	_ observe.InboxTraceHook = (*Tracer)(nil)
	_ observe.InboxHook      = (*Tracer)(nil)
	_ observe.MessageOutHook = (*Tracer)(nil)
	_ observe.DeadLetterHook = (*Tracer)(nil)
)

// New returns a Tracer for cfg.
func New(cfg Config) (*Tracer, error) {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	prop := cfg.Propagator
	if prop == nil {
		prop = otel.GetTextMapPropagator()
		if len(prop.Fields()) == 0 {
			// The global default propagates nothing: the trace would stop
			// at the first message.
			prop = propagation.TraceContext{}
		}
	}
	return &Tracer{
		tracer:     tp.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL)),
		prop:       prop,
		inboxNames: names{prefix: "oncemill.inbox"},
	}, nil
}

// The start options of the spans, made once: an option made per span
// costs an allocation even when the span is not recorded.
var (
	consumerSpan = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	producerSpan = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer)}
)

// ownedKey marks, in a context, the inbox span a Tracer started, so that it
// ends that span and no other (never a user's span, nor another Tracer's).
type ownedKey struct{ t *Tracer }

func (t *Tracer) owned(ctx context.Context) trace.Span {
	s, _ := ctx.Value(ownedKey{t}).(trace.Span)
	return s
}

// StartInboxAttempt starts the delivery's span, a child of the span in ctx
// if it holds a valid one, else of the trace context in the message's
// metadata (a new trace when it has none). It implements
// [observe.InboxTraceHook].
func (t *Tracer) StartInboxAttempt(ctx context.Context, consumer, topic string, msg *message.Message) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() && len(msg.Metadata) > 0 {
		ctx = t.prop.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	}
	ctx, span := t.tracer.Start(ctx, t.inboxNames.get(consumer), consumerSpan...)
	if !span.IsRecording() {
		// Nothing to end or annotate; the context still carries the
		// (unsampled) span context to whatever the handler sends on.
		return ctx
	}
	attrs := [...]attribute.KeyValue{
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingMessageID(msg.UUID),
		ConsumerKey.String(consumer),
		semconv.MessagingDestinationName(topic),
	}
	n := len(attrs)
	if topic == "" {
		n--
	}
	span.SetAttributes(attrs[:n]...)
	return context.WithValue(ctx, ownedKey{t}, span)
}

// OnInboxStep adds the step as an event to the delivery's span. It
// implements [observe.InboxTraceHook].
func (t *Tracer) OnInboxStep(ctx context.Context, step observe.Step) {
	if s := t.owned(ctx); s != nil && s.IsRecording() {
		s.AddEvent(string(step))
	}
}

// OnInboxAttempt records the delivery's outcome and times on its span,
// marks the span as failed for the outcomes that are errors, and ends it,
// if this Tracer started it. It implements [observe.InboxHook].
func (t *Tracer) OnInboxAttempt(ctx context.Context, a observe.InboxAttempt) {
	s := t.owned(ctx)
	if s == nil || !s.IsRecording() {
		return
	}
	attrs := [...]attribute.KeyValue{
		OutcomeKey.String(string(a.Outcome)),
		StoreDurationKey.Float64(a.Store.Seconds()),
		HandlerDurationKey.Float64(a.Handler.Seconds()),
	}
	n := len(attrs)
	if a.Handler <= 0 {
		n--
	}
	s.SetAttributes(attrs[:n]...)
	if isError(a.Outcome) {
		desc := string(a.Outcome)
		if a.Err != nil {
			s.RecordError(a.Err)
			desc = a.Err.Error()
		}
		s.SetStatus(codes.Error, desc)
	}
	s.End()
}

// isError reports whether a delivery with the outcome failed: its span
// ends with status Error. Duplicates, dead copies, deliveries another
// holds and those cut short by shutdown are not errors.
func isError(o observe.Outcome) bool {
	switch o {
	case observe.Failed, observe.Panicked, observe.Unavailable, observe.CrashLoop, observe.Rejected:
		return true
	}
	return false
}

// OnMessageOut writes trace context into the metadata of a message sent
// on. A row the relay publishes ([observe.OutRelay]) gets a new span of
// kind Producer, started as a child of the context in the row's metadata
// (the writer's) and ended at once. Any other message (an outbox write, a
// dead letter) gets the span context of ctx when it holds a valid one, and
// otherwise keeps the context it has. It implements
// [observe.MessageOutHook].
func (t *Tracer) OnMessageOut(ctx context.Context, kind observe.Out, msg *message.Message) {
	if kind == observe.OutRelay {
		t.relay(ctx, msg)
		return
	}
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		t.inject(ctx, msg)
	}
}

func (t *Tracer) relay(ctx context.Context, msg *message.Message) {
	if len(msg.Metadata) > 0 {
		ctx = t.prop.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	}
	parent := trace.SpanContextFromContext(ctx)
	ctx, span := t.tracer.Start(ctx, relaySpanName, producerSpan...)
	if span.IsRecording() {
		span.SetAttributes(semconv.MessagingOperationTypeSend, semconv.MessagingMessageID(msg.UUID))
	}
	span.End()
	if sc := span.SpanContext(); sc.IsValid() && !sc.Equal(parent) {
		t.inject(ctx, msg)
	}
}

func (t *Tracer) inject(ctx context.Context, msg *message.Message) {
	if msg.Metadata == nil {
		msg.Metadata = make(message.Metadata, 2)
	}
	t.prop.Inject(ctx, propagation.MapCarrier(msg.Metadata))
}

// OnDeadLetter adds the event "dead_lettered", with the reason and the
// attempts counted, to the span in ctx. It implements
// [observe.DeadLetterHook].
func (t *Tracer) OnDeadLetter(ctx context.Context, d observe.DeadLetter) {
	s := trace.SpanFromContext(ctx)
	if !s.IsRecording() {
		return
	}
	s.AddEvent(EventDeadLettered, trace.WithAttributes(
		ReasonKey.String(string(d.Reason)),
		AttemptsKey.Int(d.Attempts),
	))
}

// names caches span names, "<prefix> <label>", so that starting a span
// does not build its name each time. Labels (consumer names) are few; past
// maxNames new ones are built each time. Reads take no lock.
type names struct {
	prefix string
	m      atomic.Pointer[map[string]string]
}

const maxNames = 1024

func (n *names) get(label string) string {
	if label == "" {
		return n.prefix
	}
	m := n.m.Load()
	if m != nil {
		if name, ok := (*m)[label]; ok {
			return name
		}
	}
	name := n.prefix + " " + label
	for {
		if m != nil && len(*m) >= maxNames {
			return name
		}
		next := make(map[string]string, 1+lenOf(m))
		if m != nil {
			for k, v := range *m {
				next[k] = v
			}
		}
		next[label] = name
		if n.m.CompareAndSwap(m, &next) {
			return name
		}
		m = n.m.Load()
	}
}

func lenOf(m *map[string]string) int {
	if m == nil {
		return 0
	}
	return len(*m)
}
