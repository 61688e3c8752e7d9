// Command service is the shape of a consumer to copy into production: one
// binary, configured from the environment, that records each order's
// payment exactly once and announces it through the outbox.
//
// A Watermill router consumes TOPIC through Poison (retries, then the
// PostgreSQL dead-letter table), a Bloom prefilter and the transactional
// inbox. The handler inserts the payment in the inbox's transaction and
// returns an event, which the consumer outbox writes in that same
// transaction; the outbox relay publishes it to EVENTS_TOPIC. The relay
// and the janitor that sweeps expired keys run with the router. Every
// component reports to one Prometheus registry, served at /metrics;
// /healthz answers 200 only while the database answers and the router and
// the broker are up. With OTEL_EXPORTER_OTLP_ENDPOINT set, every
// component also reports to OpenTelemetry, exported with OTLP over HTTP:
// one trace goes from the producer's span, in the message's traceparent,
// through the delivery's inbox span and the outbox row to the relay's
// span, which the event carries to the broker. SIGTERM or SIGINT drains
// the router within Kubernetes' 30 s grace period, flushes the last
// spans and exits 0.
//
//	go run ./examples/service                      # gochannel:// and the local PostgreSQL
//	go run ./examples/service -produce 100         # same, publishing 100 demo orders 3 times each
//	BROKER_URL=amqp://guest:guest@127.0.0.1:5672/ go run ./examples/service
//	OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 go run ./examples/service   # traces to a collector
//
// Environment: DATABASE_URL, BROKER_URL, HTTP_ADDR, DB_SCHEMA, TOPIC,
// EVENTS_TOPIC, CONSUMER_GROUP, LOG_LEVEL, OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and the SDK's other OTEL_* variables
// (see config.go).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/amqp"
	_ "github.com/oncemill/oncemill/adapters/kafka"
	_ "github.com/oncemill/oncemill/adapters/nats"
	_ "github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/sqlschema"
)

// The drain budget. Kubernetes sends SIGKILL terminationGracePeriodSeconds
// (30 s by default) after SIGTERM. The router waits up to closeTimeout for
// running handlers and the relay's batch. A handler running at SIGTERM
// keeps a live context (the inbox's DrainTimeout, 20 s) until it finishes
// or handlerTimeout ends it, at most 10 s; one that has returned then gets
// up to finishTimeout to commit: 15 s + 5 s = 20 s. The HTTP
// server then gets up to 2 s to answer its last requests, and the spans
// still buffered up to traceFlushTimeout to reach the collector: 24 s. If
// closing the broker connections and the pool still takes the process
// past shutdownBudget, it exits 1 on its own, before the SIGKILL, saying
// so.
const (
	closeTimeout      = 15 * time.Second
	finishTimeout     = 5 * time.Second
	traceFlushTimeout = 2 * time.Second
	shutdownBudget    = 25 * time.Second
	// handlerTimeout bounds one attempt of the handler (Watermill's
	// Timeout middleware, behind Poison): one that runs past it fails,
	// is counted and is dead-lettered after maxAttempts.
	handlerTimeout = 10 * time.Second
	maxAttempts    = 5
	// startTimeout bounds connecting, migrating and warming the filter.
	startTimeout = time.Minute
)

// consumerName is the handler's name and the inbox's consumer: it scopes
// the keys, and it is the consumer label of the metrics.
const consumerName = "record-payment"

// Payment is the message consumed from TOPIC and the event published to
// EVENTS_TOPIC.
type Payment struct {
	OrderID     string `json:"orderId"`
	AmountCents int64  `json:"amountCents"`
}

func main() {
	produce := flag.Int("produce", 0, "once the router runs, publish `N` demo orders to TOPIC, each 3 times in a shuffled order, plus one malformed message (to try the service with BROKER_URL=gochannel://)")
	flag.Parse()
	cfg, err := loadConfig(os.Getenv)
	if err != nil {
		fmt.Fprintf(os.Stderr, "service: invalid configuration:\n%v\n", err)
		os.Exit(2)
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel})))
	if err := run(cfg, *produce); err != nil {
		slog.Error("service stopped", "error", err)
		os.Exit(1)
	}
}

func run(cfg config, produce int) error {
	// The first SIGTERM or SIGINT starts the drain; after it the default
	// action is back, so a second one ends the process at once.
	signals, stopSignals := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stopSignals()
	logger := watermill.NewSlogLogger(slog.Default())
	traces := "off"
	if cfg.TracesEndpoint != "" {
		traces = redacted(cfg.TracesEndpoint)
	}
	slog.Info("starting", "database", redacted(cfg.DatabaseURL), "broker", redacted(cfg.BrokerURL),
		"http", cfg.HTTPAddr, "schema", cfg.Schema, "topic", cfg.Topic, "events_topic", cfg.EventsTopic, "group", cfg.ConsumerGroup,
		"traces", traces)

	startCtx, cancelStart := context.WithTimeout(signals, startTimeout)
	defer cancelStart()
	pool, err := openDatabase(startCtx, cfg.DatabaseURL, cfg.schema())
	if err != nil {
		return err
	}
	defer pool.Close()

	brokerLogger := watermill.LoggerAdapter(logger)
	if strings.HasPrefix(cfg.BrokerURL, "gochannel:") {
		brokerLogger = quietLogger{logger}
	}
	ps, err := adapters.Open(startCtx, cfg.BrokerURL, adapters.Options{Logger: brokerLogger, ConsumerGroup: cfg.ConsumerGroup})
	if err != nil {
		return fmt.Errorf("BROKER_URL: %w", err)
	}
	defer func() {
		if err := ps.Close(); err != nil {
			slog.Error("closing the broker connections", "error", err)
		}
	}()

	// One registry for everything /metrics serves: the oncemill hooks, the
	// dead-letter table's size, and the Go runtime and process.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := prom.New(prom.Config{Registerer: reg})
	if err != nil {
		return err
	}
	deadLetters, err := dlq.NewStore(pool, cfg.schema())
	if err != nil {
		return err
	}
	dlqSize, err := prom.NewDLQCollector(deadLetters, prom.DLQCollectorConfig{Logger: logger})
	if err != nil {
		return err
	}
	reg.MustRegister(dlqSize)

	// The tracer, when there is one, is a hook beside the metrics. Its
	// stop runs before the closes deferred above: once the router has
	// drained, every span has ended, and the last ones are exported
	// within traceFlushTimeout.
	tracers, stopTracing, err := newTracing(startCtx, cfg)
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), traceFlushTimeout)
		defer cancel()
		if err := stopTracing(ctx); err != nil {
			slog.Error("flushing the last spans", "error", err)
		}
	}()
	hooks := append([]observe.Hook{metrics}, tracers...)

	health := newHealth(pool, ps.Subscriber)
	router, err := newRouter(startCtx, cfg, pool, ps.Subscriber, health.publisher(ps.Publisher), hooks, logger)
	if err != nil {
		return err
	}

	listener, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("HTTP_ADDR: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.Handle("GET /healthz", health)
	server := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = server.Shutdown(ctx)
	}()

	if strings.HasPrefix(cfg.BrokerURL, "gochannel:") {
		// In-process, the events have no other reader: this one stands
		// for the downstream service. Without a subscriber GoChannel
		// refuses the relay's publish and the events stay in the outbox.
		events, err := ps.Subscriber.Subscribe(signals, cfg.EventsTopic)
		if err != nil {
			return fmt.Errorf("subscribe to EVENTS_TOPIC: %w", err)
		}
		go func() {
			for m := range events {
				slog.Debug("event", "topic", cfg.EventsTopic, "uuid", m.UUID)
				m.Ack()
			}
		}()
	}

	// The router's context is not the signals': Close, not a cancelled
	// context, is what drains it and reports whether it drained in time.
	routed := make(chan error, 1)
	go func() { routed <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case err := <-routed:
		return fmt.Errorf("router: %w", err)
	case <-signals.Done():
		return errors.Join(errors.New("stopped while starting"), router.Close())
	}
	health.routerUp.Store(true)
	slog.Info("running", "metrics", "http://"+listener.Addr().String()+"/metrics")
	if produce > 0 {
		go func() {
			if err := produceDemo(ps.Publisher, cfg.Topic, produce); err != nil {
				slog.Error("producing demo orders", "error", err)
			}
		}()
	}

	select {
	case <-signals.Done():
	case err := <-routed:
		// The router stops by itself when every subscription has ended.
		health.routerUp.Store(false)
		return errors.Join(errors.New("router stopped on its own: a subscription ended"), err)
	case err := <-served:
		health.routerUp.Store(false)
		return errors.Join(fmt.Errorf("HTTP server: %w", err), router.Close())
	}
	stopSignals()
	health.routerUp.Store(false) // not ready from now on
	began := time.Now()
	// Not stopped: it covers the deferred closes too, until the process
	// exits.
	time.AfterFunc(shutdownBudget, func() {
		slog.Error("shutdown exceeded its budget; exiting", "budget", shutdownBudget)
		os.Exit(1)
	})
	slog.Info("draining", "close_timeout", closeTimeout, "finish_timeout", finishTimeout)
	if err := router.Close(); err != nil {
		return fmt.Errorf("drain: %w (handlers still running after %s)", err, closeTimeout)
	}
	if err := <-routed; err != nil {
		return fmt.Errorf("router: %w", err)
	}
	slog.Info("drained", "took", time.Since(began).Round(time.Millisecond))
	return nil
}

// openDatabase connects, migrates oncemill's tables (idempotent, safe on
// every start) and creates the payments table. pgx's pool holds at most
// max(4, CPUs) connections unless DATABASE_URL sets pool_max_conns.
func openDatabase(ctx context.Context, url string, schema sqlschema.Config) (*pgxpool.Pool, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	if err := sqlschema.Migrate(ctx, pool, schema); err != nil {
		pool.Close()
		return nil, err
	}
	// No UNIQUE (order_id), on purpose: the inbox is what keeps a payment
	// from being recorded twice, and a double would show here as two rows.
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+paymentsTable(schema.Schema)+` (
	id bigserial PRIMARY KEY,
	order_id text NOT NULL,
	amount_cents bigint NOT NULL,
	recorded_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		pool.Close()
		return nil, fmt.Errorf("create the payments table: %w", err)
	}
	return pool, nil
}

// paymentsTable is the quoted name of the table the handler writes.
func paymentsTable(schema string) string { return pgx.Identifier{schema, "payments"}.Sanitize() }

// newRouter builds the router: the middlewares, the handler consuming
// TOPIC from sub, the outbox relay publishing to the broker through pub,
// and the janitor.
func newRouter(ctx context.Context, cfg config, pool *pgxpool.Pool, sub message.Subscriber, pub message.Publisher,
	hooks []observe.Hook, logger watermill.LoggerAdapter) (*message.Router, error) {
	schema := cfg.schema() // the one openDatabase migrated
	store, err := postgres.New(pool, schema)
	if err != nil {
		return nil, err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:       store,
		Consumer:      consumerName,
		Key:           middleware.KeyFromJSON("orderId"), // the business key, not the message UUID
		FinishTimeout: finishTimeout,
		// The event the handler returns is written to the outbox in the
		// inbox's transaction: payment, claim and event commit together.
		Outbox: forwarder.InboxOutbox(cfg.EventsTopic, schema, forwarder.WithHooks(hooks...)),
		Hooks:  hooks,
		Logger: logger,
	})
	if err != nil {
		return nil, err
	}
	// The prefilter takes the inbox's store, key, consumer and window.
	bloom, err := middleware.NewBloom(middleware.BloomConfig{Inbox: inbox, Hooks: hooks, Logger: logger})
	if err != nil {
		return nil, err
	}
	if _, err := bloom.Warm(ctx); err != nil {
		return nil, fmt.Errorf("warm the Bloom filter: %w", err)
	}
	// In the inbox's database, a dead letter is written in the claim's
	// transaction: the message is in the table or applied, never both.
	table, err := dlq.NewPublisher(pool, schema)
	if err != nil {
		return nil, err
	}
	// Dead letters are filed under the inbox's consumer and key.
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Inbox:       inbox,
		Publisher:   table,
		Topic:       cfg.dlqTopic(),
		MaxAttempts: maxAttempts,
		Hooks:       hooks,
		Logger:      logger,
	})
	if err != nil {
		return nil, err
	}
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{
		Pool:      pool,
		Publisher: pub,
		Schema:    schema,
		Hooks:     hooks,
		Logger:    logger,
	})
	if err != nil {
		return nil, err
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, logger)
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(poison.Middleware, wmiddleware.Timeout(handlerTimeout), bloom.Middleware, inbox.Middleware)
	// Replays an operator requests for this consumer (oncemill dlq replay
	// --to-consumer, the console) come through the same handler and
	// inbox, and reach no other consumer of the topic.
	replays, err := dlq.NewReplaySubscriber(pool, schema, dlq.ReplaySubscriberConfig{Consumer: consumerName, Logger: logger})
	if err != nil {
		return nil, err
	}
	router.AddHandler(consumerName, cfg.Topic, dlq.WithReplays(sub, replays), cfg.EventsTopic, outboxOnly{}, recordPayment(cfg.Schema))
	router.AddPlugin(relay.Plugin, runWithRouter("oncemill_janitor", func() (func() error, error) {
		j, err := dedup.NewJanitor(store, dedup.JanitorConfig{Logger: logger})
		if err != nil {
			return nil, err
		}
		return j.Close, nil
	}))
	return router, nil
}

// recordPayment is the business handler: it records the payment in the
// inbox's transaction and returns the event announcing it. A message that
// can never succeed is marked permanent, and Poison dead-letters it at once.
func recordPayment(schema string) message.HandlerFunc {
	insert := `INSERT INTO ` + paymentsTable(schema) + ` (order_id, amount_cents) VALUES ($1, $2)`
	return func(msg *message.Message) ([]*message.Message, error) {
		var p Payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, middleware.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		if p.AmountCents <= 0 {
			return nil, middleware.Permanent(fmt.Errorf("order %q: amountCents must be positive, got %d", p.OrderID, p.AmountCents))
		}
		ctx := msg.Context()
		if _, err := postgres.Tx(ctx).Exec(ctx, insert, p.OrderID, p.AmountCents); err != nil {
			return nil, err // rolled back with the claim; retried
		}
		event := message.NewMessage(watermill.NewUUID(), msg.Payload)
		event.Metadata.Set(delivery.IdempotencyKey, p.OrderID)
		event.Metadata.Set(delivery.PartitionKey, p.OrderID)
		return []*message.Message{event}, nil
	}
}

// outboxOnly is the handler's publisher as the router sees it. The inbox
// writes what the handler returns to the outbox and returns nothing to
// the router, so nothing reaches it. It is not the broker's publisher on
// purpose: the router closes a handler's publisher when the handler
// stops, which would be under the relay's last batch.
type outboxOnly struct{}

func (outboxOnly) Publish(topic string, _ ...*message.Message) error {
	return fmt.Errorf("publish to %s: the handler's messages go through the outbox (InboxConfig.Outbox)", topic)
}

func (outboxOnly) Close() error { return nil }

// quietLogger logs Info at Debug. GoChannel logs a line at Info for every
// message published to a topic nobody in the process subscribes to (the
// events, here), and per-message lines belong at Debug.
type quietLogger struct{ watermill.LoggerAdapter }

func (l quietLogger) Info(msg string, fields watermill.LogFields) { l.LoggerAdapter.Debug(msg, fields) }

func (l quietLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return quietLogger{l.LoggerAdapter.With(fields)}
}
