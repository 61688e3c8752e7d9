package forwarder_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/sqlschema"
)

// An order service marks an order paid and writes the event in the same
// transaction; the relay, run by the service's router, publishes it to the
// broker, and Lag says how far behind it is and why. The example needs
// PostgreSQL and a broker, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil { // creates oncemill.outbox
		panic(err)
	}

	// The writer: the event commits or rolls back with the update.
	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = $1`, "A-42"); err != nil {
		panic(err)
	}
	events, err := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{})
	if err != nil {
		panic(err)
	}
	event := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42","status":"paid"}`))
	event.Metadata.Set(delivery.PartitionKey, "A-42") // the order's events keep their order
	if err := events.Publish("orders.paid", event); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}

	// The relay, started and stopped with the router.
	broker, err := adapters.Open(ctx, os.Getenv("BROKER_URL"), adapters.Options{})
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: broker.Publisher})
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddPlugin(relay.Plugin)
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	lag, err := relay.Lag(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("pending:", lag.Pending, "oldest:", lag.OldestAge)
	if lag.HeldBy != nil {
		fmt.Println("held back by", lag.HeldBy)
	}
}

// A reminder goes out a day after the order, not before: PublishAt marks
// the message, and the outbox's publisher writes it to the scheduled
// table, from which the relay moves it into the outbox when it is due
// (see docs/outbox.md, "Scheduled messages", for the writer and relay
// around it).
func ExamplePublishAt() {
	placed := time.Date(2030, 1, 2, 9, 30, 0, 0, time.UTC)
	reminder := message.NewMessage("reminder-A-42", []byte(`{"orderId":"A-42"}`))
	reminder.Metadata.Set(delivery.PartitionKey, "A-42")
	forwarder.PublishAt(reminder, placed.Add(24*time.Hour))
	fmt.Println(forwarder.DueAtKey, reminder.Metadata.Get(forwarder.DueAtKey))
	// Output: oncemill_due_at 2030-01-03T09:30:00Z
}
