package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/dedup/sqlite"
	dlv "github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
)

// A payment handler wrapped in a lease-mode inbox runs once for three
// deliveries of one order. The memory store is for examples and tests only:
// it forgets on restart.
func ExampleNewInbox() {
	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		LeaseStore: memory.New(),
		Consumer:   "payments",
	})
	if err != nil {
		panic(err)
	}
	charges := 0
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		charges++ // a real handler passes middleware.IdempotencyKey(msg.Context()) to the provider
		return nil, nil
	})

	// The broker redelivers the same payment three times, each time as a
	// new delivery with its own UUID but the producer's idempotency key.
	for i := 0; i < 3; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42","amount":1999}`))
		msg.Metadata.Set(dlv.IdempotencyKey, "A-42")
		if _, err := handler(msg); err != nil {
			panic(err)
		}
	}
	stats := inbox.Stats()
	fmt.Println("charges:", charges, "duplicates dropped:", stats.Duplicates)
	// Output: charges: 1 duplicates dropped: 2
}

// In transactional mode the handler writes its effect through the
// transaction in which the inbox claimed the key, so both commit together.
// Here the key is a business field of the payload.
func ExampleInbox_Middleware() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "oncemill-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	store, err := sqlite.Open(ctx, filepath.Join(dir, "inbox.db"), sqlite.Config{})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	if _, err := store.DB().ExecContext(ctx, `CREATE TABLE shipments (order_id TEXT)`); err != nil {
		panic(err)
	}

	inbox, err := middleware.NewInbox(middleware.InboxConfig{
		TxStore:  store,
		Consumer: "shipping",
		Key:      middleware.KeyFromJSON("orderId"),
	})
	if err != nil {
		panic(err)
	}
	ship := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, err := sqlite.Tx(msg.Context()).ExecContext(msg.Context(),
			`INSERT INTO shipments (order_id) VALUES (?)`, middleware.IdempotencyKey(msg.Context()))
		return nil, err
	})

	for i := 0; i < 3; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))
		if _, err := ship(msg); err != nil {
			panic(err)
		}
	}
	_, err = ship(message.NewMessage(watermill.NewUUID(), []byte(`{"sku":"X"}`)))
	fmt.Println("permanent:", middleware.IsPermanent(err))

	var n int
	if err := store.DB().QueryRowContext(ctx, `SELECT count(*) FROM shipments`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("shipments:", n)
	// Output:
	// permanent: true
	// shipments: 1
}

// A message that can never succeed is dead-lettered, with the reason, after
// MaxAttempts attempts, and then acked: the attempts run in process, in
// the one delivery, so that they spend none of the broker's deliveries.
func ExampleNewPoison() {
	dlqPubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer dlqPubSub.Close()
	poison, err := middleware.NewPoison(middleware.PoisonConfig{
		Publisher:   dlqPubSub,
		Topic:       "payments.dlq",
		MaxAttempts: 3,
		Consumer:    "payments",
	})
	if err != nil {
		panic(err)
	}
	attempts := 0
	handler := poison.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		attempts++
		return nil, errors.New("ledger rejected the account")
	})

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"orderId":"A-42"}`))
	msg.Metadata.Set(dlv.IdempotencyKey, "A-42")
	_, err = handler(msg) // one delivery: its attempts run in process, after a backoff
	fmt.Printf("attempts: %d, nacked: %v\n", attempts, err != nil)

	dead, err := dlqPubSub.Subscribe(context.Background(), "payments.dlq")
	if err != nil {
		panic(err)
	}
	d := <-dead
	d.Ack()
	fmt.Println(d.Metadata.Get("oncemill_dlq_key"), d.Metadata.Get("oncemill_dlq_attempts"), d.Metadata.Get("oncemill_dlq_error"))
	// Output:
	// attempts: 3, nacked: false
	// A-42 3 ledger rejected the account
}

// A Bloom prefilter in front of a lease-mode inbox: the first delivery of
// each key goes straight to the inbox, a redelivery is answered by one read
// of the store without running the handler.
func ExampleNewBloom() {
	store := memory.New() // for the example; use the inbox's real store
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: store, Consumer: "shipping"})
	if err != nil {
		panic(err)
	}
	bloom, err := middleware.NewBloom(middleware.BloomConfig{Store: store, Consumer: "shipping", ExpectedKeys: 10_000})
	if err != nil {
		panic(err)
	}
	shipped := 0
	handler := bloom.Middleware(inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		shipped++
		return nil, nil
	}))
	for _, key := range []string{"order-1", "order-2", "order-1", "order-1"} {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata.Set(dlv.IdempotencyKey, key)
		if _, err := handler(msg); err != nil {
			panic(err)
		}
	}
	s := bloom.Stats()
	fmt.Println("shipped:", shipped, "surely new:", s.SurelyNew, "duplicates answered by the filter's read:", s.Duplicates)
	// Output: shipped: 2 surely new: 2 duplicates answered by the filter's read: 2
}

// A handler that panics is a failed attempt like one that returns an
// error: the inbox recovers the panic, rolls back and returns an error
// wrapping ErrPanicked, which the poison middleware counts.
func ExampleErrPanicked() {
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "shipping"})
	if err != nil {
		panic(err)
	}
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		var labels map[string]string
		labels["A-42"] = "DHL" // a bug: assignment to entry in nil map
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(dlv.IdempotencyKey, "A-42")
	_, err = handler(msg)
	fmt.Println(errors.Is(err, middleware.ErrPanicked), inbox.Stats().Panicked)
	// Output: true 1
}

// The fencing token of a lease-mode attempt goes with the effect, so that
// a downstream system can refuse a holder whose lease was taken over.
func ExampleLeaseToken() {
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "payments"})
	if err != nil {
		panic(err)
	}
	handler := inbox.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		// e.g. a provider call with Idempotency-Key and a fencing header
		fmt.Println(middleware.IdempotencyKey(ctx), middleware.LeaseToken(ctx) > 0)
		return nil, nil
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.Metadata.Set(dlv.IdempotencyKey, "A-42")
	if _, err := handler(msg); err != nil {
		panic(err)
	}
	// Output: A-42 true
}
