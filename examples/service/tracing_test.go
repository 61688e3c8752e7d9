package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/adapters/amqp"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// TestServiceTracesRabbitMQ runs the service on PostgreSQL and RabbitMQ
// with OTEL_EXPORTER_OTLP_ENDPOINT pointing at a collector of the test's:
// a payment published with the traceparent of a span the test started is
// applied in a span of that trace, the producer's child; the event the
// handler returns goes through the outbox and the relay in a span that is
// the inbox span's child, and reaches the broker carrying it. The batch
// processor is told to wait an hour, so the spans reach the collector
// only because SIGTERM flushes them.
func TestServiceTracesRabbitMQ(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, 2)
	requireRabbitMQ(t)

	schema := freshSchema(t, pool)
	suffix := randomSuffix(t)
	topic, events := "orders_"+suffix, "payments_recorded_"+suffix
	const group, audit = "billing", "audit"
	cleanupAMQP(t, []string{topic, events}, []string{topic + "." + group, events + "." + audit})
	ctx := context.Background()
	require.NoError(t, amqp.Declare(ctx, amqp.Config{URL: amqpURL, ConsumerGroup: group}, topic))
	require.NoError(t, amqp.Declare(ctx, amqp.Config{URL: amqpURL, ConsumerGroup: audit}, events))

	col := startCollector(t)
	svc := startService(t, map[string]string{
		"DATABASE_URL":                pgtest.URL(),
		"BROKER_URL":                  amqpURL,
		"HTTP_ADDR":                   freeAddr(t),
		"DB_SCHEMA":                   schema,
		"TOPIC":                       topic,
		"EVENTS_TOPIC":                events,
		"CONSUMER_GROUP":              group,
		"OTEL_EXPORTER_OTLP_ENDPOINT": col.url,
		"OTEL_SERVICE_NAME":           "payments-" + suffix,
		"OTEL_BSP_SCHEDULE_DELAY":     "3600000", // milliseconds
	})
	svc.waitHealthy(t, 60*time.Second)
	require.Contains(t, svc.log(), "traces="+col.url+"/v1/traces", "the service says where its spans go")

	// The producer: a service with OpenTelemetry of its own, whose span
	// travels in the message's metadata as its Watermill middleware
	// writes it.
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	pctx, checkout := tp.Tracer("shop").Start(ctx, "checkout", trace.WithSpanKind(trace.SpanKindProducer))
	orderID := "traced-" + suffix
	msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"orderId":%q,"amountCents":4200}`, orderID)))
	msg.Metadata.Set(delivery.PartitionKey, orderID)
	propagation.TraceContext{}.Inject(pctx, propagation.MapCarrier(msg.Metadata))
	checkout.End()
	producer, err := adapters.Open(ctx, amqpURL, adapters.Options{})
	require.NoError(t, err)
	defer producer.Close()
	require.NoError(t, producer.Publisher.Publish(topic, msg))
	traceID, producerSpan := checkout.SpanContext().TraceID(), checkout.SpanContext().SpanID()

	// The event reaches the broker in the producer's trace, under a span
	// of the service's.
	event := getEvent(t, events+"."+audit)
	require.Equal(t, orderID, event.Headers[delivery.IdempotencyKey])
	carried := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(ctx, amqpHeaders(event.Headers)))
	require.True(t, carried.IsValid(), "the event carries a traceparent: %v", event.Headers)
	require.Equal(t, traceID, carried.TraceID(), "the event is in the producer's trace")
	require.NotEqual(t, producerSpan, carried.SpanID(), "the event carries a span of the service's")
	require.Zero(t, col.count(), "nothing exported yet: the batch waits an hour")

	code, took := svc.stop(t, 30*time.Second)
	require.Equal(t, 0, code, "exit code after SIGTERM")
	t.Logf("drained, flushed and exited in %s", took.Round(time.Millisecond))

	var spans []exportedSpan
	waitFor(t, 10*time.Second, "the collector has the inbox and relay spans", func() (bool, string) {
		spans = col.spans()
		return len(spans) >= 2, fmt.Sprintf("%d spans: %s", len(spans), names(spans))
	})
	inbox := only(t, spans, func(s exportedSpan) bool {
		return s.Name == "oncemill.inbox "+consumerName && s.attr("messaging.message.id") == msg.UUID
	})
	relay := only(t, spans, func(s exportedSpan) bool { return s.Name == "oncemill.relay" })

	require.Equal(t, hex.EncodeToString(traceID[:]), hex.EncodeToString(inbox.TraceId), "the inbox span is in the producer's trace")
	require.Equal(t, hex.EncodeToString(producerSpan[:]), hex.EncodeToString(inbox.ParentSpanId), "the inbox span is the producer's child")
	require.Equal(t, tracepb.Span_SPAN_KIND_CONSUMER, inbox.Kind)
	require.Equal(t, "applied", inbox.attr("oncemill.outcome"))
	require.Equal(t, topic, inbox.attr("messaging.destination.name"))
	require.Equal(t, consumerName, inbox.attr("oncemill.consumer"))

	require.Equal(t, hex.EncodeToString(traceID[:]), hex.EncodeToString(relay.TraceId), "the relay span is in the producer's trace")
	require.Equal(t, hex.EncodeToString(inbox.SpanId), hex.EncodeToString(relay.ParentSpanId), "the outbox event is the inbox span's child")
	require.Equal(t, tracepb.Span_SPAN_KIND_PRODUCER, relay.Kind)
	require.Equal(t, hex.EncodeToString(relay.SpanId), carried.SpanID().String(), "the event on the broker carries the relay's span")

	for _, s := range spans {
		require.Equal(t, hex.EncodeToString(traceID[:]), hex.EncodeToString(s.TraceId), "span %q is in the producer's trace", s.Name)
		require.Equal(t, "payments-"+suffix, s.resource["service.name"], "service.name from OTEL_SERVICE_NAME")
	}
}

// TestTracingOff: without an endpoint the service adds no tracing hook,
// and its stop has nothing to do.
func TestTracingOff(t *testing.T) {
	c, err := loadConfig(func(string) string { return "" })
	require.NoError(t, err)
	hooks, stop, err := newTracing(context.Background(), c)
	require.NoError(t, err)
	require.Empty(t, hooks)
	require.NoError(t, stop(context.Background()))
}

// getEvent takes one event from queue, with automatic acknowledgement.
func getEvent(t *testing.T, queue string) amqp091.Delivery {
	t.Helper()
	var got amqp091.Delivery
	waitFor(t, 30*time.Second, "an event in "+queue, func() (bool, string) {
		var ok bool
		err := withChannel(func(ch *amqp091.Channel) error {
			var err error
			got, ok, err = ch.Get(queue, true)
			return err
		})
		return err == nil && ok, fmt.Sprintf("received %v, %v", ok, err)
	})
	return got
}

// amqpHeaders reads an AMQP message's string headers as a propagation
// carrier.
func amqpHeaders(h amqp091.Table) propagation.MapCarrier {
	c := propagation.MapCarrier{}
	for k, v := range h {
		if s, ok := v.(string); ok {
			c[k] = s
		}
	}
	return c
}

// ---------------------------------------------------------------- collector

// collector is an OTLP/HTTP trace receiver: it accepts the protobuf
// exports POSTed to /v1/traces and keeps their spans.
type collector struct {
	url string
	mu  sync.Mutex
	got []exportedSpan
}

// exportedSpan is a span as the service exported it, with its resource's
// string attributes.
type exportedSpan struct {
	*tracepb.Span
	resource map[string]string
}

func (s exportedSpan) attr(key string) string {
	for _, kv := range s.Attributes {
		if kv.Key == key {
			return kv.Value.GetStringValue()
		}
	}
	return ""
}

// startCollector serves a collector on a free port until the test ends.
func startCollector(t *testing.T) *collector {
	t.Helper()
	c := &collector{}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", c.export)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	c.url = srv.URL
	return c
}

func (c *collector) export(w http.ResponseWriter, r *http.Request) {
	if ct := r.Header.Get("Content-Type"); ct != "application/x-protobuf" {
		http.Error(w, "want application/x-protobuf, got "+ct, http.StatusUnsupportedMediaType)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var spans []exportedSpan
	for _, rs := range req.ResourceSpans {
		res := map[string]string{}
		for _, kv := range rs.GetResource().GetAttributes() {
			res[kv.Key] = kv.Value.GetStringValue()
		}
		for _, ss := range rs.ScopeSpans {
			for _, s := range ss.Spans {
				spans = append(spans, exportedSpan{Span: s, resource: res})
			}
		}
	}
	c.mu.Lock()
	c.got = append(c.got, spans...)
	c.mu.Unlock()
	resp, err := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(resp)
}

func (c *collector) spans() []exportedSpan {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]exportedSpan(nil), c.got...)
}

func (c *collector) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.got)
}

// only returns the one span match selects; it fails the test unless
// there is exactly one.
func only(t *testing.T, spans []exportedSpan, match func(exportedSpan) bool) exportedSpan {
	t.Helper()
	var found []exportedSpan
	for _, s := range spans {
		if match(s) {
			found = append(found, s)
		}
	}
	require.Len(t, found, 1, "matching spans among %s", names(spans))
	return found[0]
}

// names lists the spans' names and attributes, for failure messages.
func names(spans []exportedSpan) string {
	var b strings.Builder
	for _, s := range spans {
		attrs := map[string]string{}
		for _, kv := range s.Attributes {
			attrs[kv.Key] = kv.Value.String()
		}
		a, _ := json.Marshal(attrs)
		fmt.Fprintf(&b, "\n  %q trace %x parent %x span %x %s", s.Name, s.TraceId, s.ParentSpanId, s.SpanId, a)
	}
	return b.String()
}
