package dlq_test

import (
	"context"
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/sqlschema"
)

// A consumer's poison middleware dead-letters into the table through
// dlq.Publisher; later an operator lists the entries of one consumer and
// replays those that failed on a timeout to their original topic. The
// example needs PostgreSQL and a broker, so it is compiled, not run.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil { // creates oncemill.dlq
		panic(err)
	}

	// The consumer side: any Watermill publisher may receive dead letters;
	// this one keeps them in PostgreSQL.
	deadLetters, err := dlq.NewPublisher(pool, sqlschema.Config{})
	if err != nil {
		panic(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))
	msg.Metadata.Set(delivery.DeadTopic, "orders")
	msg.Metadata.Set(delivery.DeadConsumer, "charge-orders")
	msg.Metadata.Set(delivery.DeadError, "payment gateway timeout")
	if err := deadLetters.Publish("orders.dlq", msg); err != nil {
		panic(err)
	}

	// The operator side.
	store, err := dlq.NewStore(pool, sqlschema.Config{})
	if err != nil {
		panic(err)
	}
	timeouts := dlq.Filter{Consumer: "charge-orders", ErrorContains: "timeout"}
	entries, err := store.List(ctx, timeouts)
	if err != nil {
		panic(err)
	}
	for _, e := range entries {
		fmt.Println(e.ID, e.Topic, e.Attempts, e.Error)
	}

	broker, err := adapters.Open(ctx, os.Getenv("BROKER_URL"), adapters.Options{})
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	replayed, err := store.Replay(ctx, broker.Publisher, timeouts, nil)
	fmt.Println("replayed:", replayed, "error:", err)
}
