package tracing_test

import (
	"context"
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/tracing"
	"github.com/oncemill/oncemill/sqlschema"
)

// One Tracer is the hook of the outbox writer, the relay, the poison
// middleware and the inbox: the trace goes from the transaction that wrote
// an event, through the relay, to the consumer that applied it. The
// example needs PostgreSQL and a broker, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	// The application's tracer provider, with its exporter
	// (sdktrace.WithBatcher(exporter)), set globally; Config{} uses it.
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(ctx) //nolint:errcheck // an example
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	tracer, err := tracing.New(tracing.Config{})
	if err != nil {
		panic(err)
	}
	hooks := []observe.Hook{tracer}

	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	broker, err := adapters.Open(ctx, os.Getenv("BROKER_URL"), adapters.Options{})
	if err != nil {
		panic(err)
	}
	defer broker.Close()

	// The producer: the event carries the span current in ctx (the
	// request's, say) in its metadata, "traceparent" and "tracestate".
	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	events, err := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{}, forwarder.WithHooks(hooks...))
	if err != nil {
		panic(err)
	}
	if err := events.Publish("orders.paid", message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	// The relay: a span "oncemill.relay" per row, the writer's child.
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: broker.Publisher, Hooks: hooks})
	if err != nil {
		panic(err)
	}

	// The consumer: a span "oncemill.inbox billing" per delivery, the
	// relay span's child; the handler runs in it.
	store, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		panic(err)
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "billing", Hooks: hooks})
	if err != nil {
		panic(err)
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: broker.Publisher, Topic: "billing.dlq", Hooks: hooks})
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddPlugin(relay.Plugin)
	router.AddConsumerHandler("billing", "orders.paid", broker.Subscriber, func(msg *message.Message) error {
		// msg.Context() holds the inbox span: spans started here are its
		// children.
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(), `UPDATE invoices SET paid = true WHERE order_id = 'A-42'`)
		return err
	}).AddMiddleware(poison.Middleware, inbox.Middleware)
	if err := router.Run(ctx); err != nil {
		panic(err)
	}
}

// An inbox span continues the trace whose context the message brought in
// its metadata.
func ExampleNew() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	tracer, err := tracing.New(tracing.Config{TracerProvider: tp})
	if err != nil {
		panic(err)
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "billing", Hooks: []observe.Hook{tracer}})
	if err != nil {
		panic(err)
	}
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, nil })

	// What a producer with OpenTelemetry sends: its span in the metadata.
	ctx, checkout := tp.Tracer("shop").Start(context.Background(), "checkout")
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	checkout.End()

	for range 2 { // a delivery and its redelivery
		if _, err := handler(msg.Copy()); err != nil {
			panic(err)
		}
	}
	for _, s := range spans.Ended()[1:] {
		outcome := ""
		for _, a := range s.Attributes() {
			if a.Key == tracing.OutcomeKey {
				outcome = a.Value.AsString()
			}
		}
		fmt.Println(s.Name(), outcome, "child of checkout:", s.Parent().SpanID() == checkout.SpanContext().SpanID())
	}
	// Output:
	// oncemill.inbox billing applied child of checkout: true
	// oncemill.inbox billing duplicate child of checkout: true
}
