// Command readme is the README's consumer: it charges every order once, however
// often the broker delivers it, and dead-letters what it cannot read.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/amqp"     // amqp:// (import only the brokers you use)
	_ "github.com/oncemill/oncemill/adapters/kafka"    // kafka://
	_ "github.com/oncemill/oncemill/adapters/postgres" // postgres://
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	dbURL, brokerURL := os.Getenv("DATABASE_URL"), os.Getenv("BROKER_URL")
	if dbURL == "" {
		return errors.New("DATABASE_URL is not set: give the PostgreSQL URL, e.g. postgres://user:pass@host:5432/db")
	}
	if brokerURL == "" {
		return errors.New("BROKER_URL is not set: give the broker URL, e.g. kafka://host:9092 or amqp://user:pass@host:5672/")
	}
	pool, err := pgxpool.New(ctx, dbURL) // connects on first use
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	defer pool.Close()
	store, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		return err
	}
	broker, err := adapters.Open(ctx, brokerURL, adapters.Options{ConsumerGroup: "billing", HandOutMarks: store}) // before the database is touched; on Kafka the store marks the offsets handed out
	if err != nil {
		return fmt.Errorf("BROKER_URL: %w", err)
	}
	defer broker.Close()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil { // idempotent, safe on every start
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (order_id text NOT NULL, amount_cents bigint NOT NULL)`); err != nil {
		return err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge-orders", Key: middleware.KeyFromJSON("orderId")})
	if err != nil {
		return err
	}
	deadLetters, err := dlq.NewPublisher(pool, sqlschema.Config{}) // the oncemill.dlq table
	if err != nil {
		return err
	}
	parked, err := retry.NewStore(pool, sqlschema.Config{}) // the oncemill.retries table: retries that wait off the consumer
	if err != nil {
		return err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: deadLetters, Retries: parked}) // the inbox's key and consumer
	if err != nil {
		return err
	}
	replays, err := dlq.NewReplaySubscriber(pool, sqlschema.Config{}, dlq.ReplaySubscriberConfig{Consumer: "charge-orders"}) // for "oncemill dlq replay --to-consumer"
	if err != nil {
		return err
	}
	orders, err := poison.Subscriber(dlq.WithReplays(broker.Subscriber, replays)) // the broker's orders, the replays asked for, and the parked ones when due
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NewSlogLogger(nil))
	if err != nil {
		return err
	}
	router.AddMiddleware(poison.Middleware, inbox.Middleware) // Poison in front of the inbox
	router.AddConsumerHandler("charge-orders", "orders", orders, charge)
	return router.Run(ctx) // until SIGINT or SIGTERM; what is in flight is drained
}

// charge is a plain Watermill handler. Its effect goes through the inbox's
// transaction, so the charge and the order's key commit together.
func charge(msg *message.Message) error {
	var order struct {
		ID     string `json:"orderId"`
		Amount int64  `json:"amountCents"`
	}
	if err := json.Unmarshal(msg.Payload, &order); err != nil {
		return middleware.Permanent(err) // retrying cannot help: to the DLQ at once
	}
	_, err := postgres.Tx(msg.Context()).Exec(msg.Context(),
		`INSERT INTO charges (order_id, amount_cents) VALUES ($1, $2)`, order.ID, order.Amount)
	return err // rolls back the charge and the claim; the message comes back
}
