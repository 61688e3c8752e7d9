package main

import (
	"context"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/tracing"
)

// defaultServiceName is the service.name of the spans unless
// OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) says
// otherwise.
const defaultServiceName = "oncemill-example-service"

// newTracing returns the hooks that trace the service, and stop, which
// exports the spans still buffered and stops the exporter; the caller
// calls it once the router has drained, with a deadline.
//
// With cfg.TracesEndpoint set, the spans go to it through a batching
// OpenTelemetry SDK provider and the OTLP/HTTP exporter, and one
// observe/tracing hook serves the inbox, Poison, Bloom, the consumer
// outbox and the relay: a delivery's span is a child of the trace
// context its message carries (W3C traceparent and tracestate, under
// those metadata keys), the event the handler returns carries that span
// into the outbox row, and the relay's span for the row goes on to the
// broker with the event. The provider and the propagator are also set
// as OpenTelemetry's globals, so that spans the handler starts with
// otel.Tracer are children of the delivery's.
//
// With cfg.TracesEndpoint empty there is no hook at all, not even one
// on a no-op provider: a delivery costs nothing for tracing, and no
// trace context is passed on to the events.
func newTracing(ctx context.Context, cfg config) (hooks []observe.Hook, stop func(context.Context) error, err error) {
	if cfg.TracesEndpoint == "" {
		return nil, func(context.Context) error { return nil }, nil
	}
	// Not a network call: the exporter connects on its first export, so
	// a collector that is down costs spans, never the service's start.
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(cfg.TracesEndpoint))
	if err != nil {
		return nil, nil, fmt.Errorf("OTLP trace exporter: %w", err)
	}
	// Later detectors win: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
	// override the default name.
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(defaultServiceName)),
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithFromEnv(),
	)
	if err != nil {
		_ = exporter.Shutdown(ctx)
		return nil, nil, fmt.Errorf("OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER (parent-based, always on,
	// by default), the batching from OTEL_BSP_*.
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	propagator := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	otel.SetTracerProvider(provider)
	otel.SetTextMapPropagator(propagator)
	// An export that fails (the collector is down, refuses the spans) is
	// logged; the spans of that batch are lost, the deliveries are not.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		slog.Warn("OpenTelemetry", "error", err)
	}))
	tracer, err := tracing.New(tracing.Config{TracerProvider: provider, Propagator: propagator})
	if err != nil {
		_ = provider.Shutdown(ctx)
		return nil, nil, err
	}
	return []observe.Hook{tracer}, provider.Shutdown, nil
}
