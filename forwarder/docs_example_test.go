package forwarder_test

// The code of docs/outbox.md, between "// snippet:NAME" and "// endsnippet"
// lines; internal/docsnippets checks that the page shows it as it is here.
// It needs PostgreSQL and a broker, so it is compiled, not run.

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/sqlschema"
)

func docsWriter(ctx context.Context, pool *pgxpool.Pool, orderID string, msg *message.Message) error {
	// snippet:writer
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = $1`, orderID); err != nil {
		return err
	}
	events, err := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{})
	if err != nil {
		return err
	}
	if err := events.Publish("orders.paid", msg); err != nil { // keeps UUID, metadata, partition_key
		return err
	}
	return tx.Commit(ctx)
	// endsnippet
}

func docsRelay(ctx context.Context, pool *pgxpool.Pool, ps *adapters.PubSub, router *message.Router) error {
	// snippet:relay
	relay, err := forwarder.NewRelay(forwarder.RelayConfig{Pool: pool, Publisher: ps.Publisher})
	if err != nil {
		return err
	}
	router.AddPlugin(relay.Plugin) // runs with the router; router.Close() drains its batch and stops it

	lag, err := relay.Lag(ctx) // pending rows, the oldest's age, and what holds them back
	if err != nil {
		return err
	}
	fmt.Println(lag.Pending, lag.OldestAge, lag.HeldBy)
	// endsnippet
	return nil
}

func docsScheduled(ctx context.Context, pool *pgxpool.Pool, orderID string, reminder *message.Message) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after Commit
	// snippet:scheduled
	events, err := forwarder.NewTxPublisher(ctx, tx, sqlschema.Config{})
	if err != nil {
		return err
	}
	reminder.Metadata.Set(delivery.PartitionKey, orderID)
	forwarder.Delay(reminder, 24*time.Hour) // or forwarder.PublishAt(reminder, at)

	// A row of oncemill.outbox_scheduled, committed with the transaction.
	if err := events.Publish("orders.reminder", reminder); err != nil {
		return err
	}
	// endsnippet
	return tx.Commit(ctx)
}

func docsConsumerOutbox(store *postgres.Store) (*middleware.Inbox, error) {
	// snippet:consumer-outbox
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store,
		Outbox: forwarder.InboxOutbox("orders.shipped", sqlschema.Config{})}) // produced messages commit with the effect
	if err != nil {
		return nil, err
	}
	// endsnippet
	return inbox, nil
}
