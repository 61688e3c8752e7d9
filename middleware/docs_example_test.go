package middleware_test

// The code of docs/guarantee.md and docs/stores.md, between "// snippet:NAME"
// and "// endsnippet" lines; internal/docsnippets checks that the pages
// show it as it is here. It needs PostgreSQL, Redis and a broker, so it is
// compiled, not run.

import (
	"context"
	"errors"
	"syscall"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/postgres"
	"github.com/oncemill/oncemill/dedup/redis"
	"github.com/oncemill/oncemill/dedup/twotier"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/retry"
	"github.com/oncemill/oncemill/sqlschema"
)

func docsTransactional(ctx context.Context, pool *pgxpool.Pool, router *message.Router, sub message.Subscriber) error {
	// snippet:transactional
	if err := sqlschema.Migrate(ctx, pool, sqlschema.Config{}); err != nil { // idempotent, safe on every start
		return err
	}
	store, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		return err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
	if err != nil {
		return err
	}
	router.AddMiddleware(inbox.Middleware)

	router.AddConsumerHandler("charge-orders", "orders", sub, func(msg *message.Message) error {
		_, err := postgres.Tx(msg.Context()).Exec(msg.Context(),
			`INSERT INTO charges (order_key, payload) VALUES ($1, $2)`, middleware.IdempotencyKey(msg.Context()), msg.Payload)
		return err // an error rolls back the effect and the claim; the message is nacked
	})
	// endsnippet
	return nil
}

// cardProvider stands for a payment API that deduplicates by an
// idempotency key of the caller's.
type cardProvider interface {
	Charge(ctx context.Context, idempotencyKey string, payload []byte) error
}

func docsLease(router *message.Router, sub message.Subscriber, provider cardProvider) error {
	// snippet:lease
	store, err := redis.New(redis.Config{Client: goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:6379"})})
	if err != nil {
		return err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: store})
	if err != nil {
		return err
	}
	router.AddMiddleware(inbox.Middleware)

	router.AddConsumerHandler("charge-cards", "orders", sub, func(msg *message.Message) error {
		ctx := msg.Context()
		return provider.Charge(ctx, middleware.IdempotencyKey(ctx), msg.Payload) // the provider's own key covers a crash before Complete
	})
	// endsnippet
	return nil
}

func docsPoison(pool *pgxpool.Pool, router *message.Router, inbox *middleware.Inbox) error {
	// snippet:poison
	table, err := dlq.NewPublisher(pool, sqlschema.Config{}) // or any Watermill publisher: a topic, a queue
	if err != nil {
		return err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: table, Topic: "payments.dlq", MaxAttempts: 5})
	if err != nil {
		return err
	}
	router.AddMiddleware(poison.Middleware, inbox.Middleware)
	// endsnippet
	return nil
}

func docsRetries(pool *pgxpool.Pool, router *message.Router, inbox *middleware.Inbox, table message.Publisher,
	sub message.Subscriber, charge message.NoPublishHandlerFunc) error {
	// snippet:retries
	parked, err := retry.NewStore(pool, sqlschema.Config{}) // the oncemill.retries table
	if err != nil {
		return err
	}
	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: table, Retries: parked})
	if err != nil {
		return err
	}
	orders, err := poison.Subscriber(sub) // sub's messages, and the parked ones when due
	if err != nil {
		return err
	}
	router.AddMiddleware(poison.Middleware, inbox.Middleware) // the inbox's Consumer is "charge-orders"
	router.AddConsumerHandler("charge-orders", "orders", orders, charge)
	// endsnippet
	return nil
}

func docsClassify() middleware.PoisonConfig {
	return middleware.PoisonConfig{
		// snippet:classify
		Classify: func(err error) middleware.Decision {
			if errors.Is(err, syscall.ECONNREFUSED) {
				return middleware.Pause
			}
			return middleware.DefaultClassify(err)
		},
		// endsnippet
	}
}

func docsBatch(store *postgres.Store) (*middleware.Inbox, error) {
	// snippet:batch
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store,
		Tuning: middleware.InboxTuning{Batch: middleware.BatchConfig{MaxMessages: 32}}}) // Linger 0, Parallel 4
	if err != nil {
		return nil, err
	}
	// endsnippet
	return inbox, nil
}

func docsBatchHandler(router *message.Router, sub message.Subscriber) {
	// snippet:batchhandler
	router.AddConsumerHandler("charge-orders", "orders", sub, middleware.BatchHandler(
		func(ctx context.Context, msgs []*message.Message) error { // the batch's new messages, duplicates dropped
			rows := make([][]any, len(msgs))
			for i, msg := range msgs {
				if len(msg.Payload) == 0 {
					return middleware.BatchErrors{msg.UUID: errors.New("empty order")} // fails this one; its mates run again
				}
				rows[i] = []any{middleware.IdempotencyKey(msg.Context()), msg.Payload}
			}
			_, err := postgres.Tx(ctx).CopyFrom(ctx, pgx.Identifier{"charges"},
				[]string{"order_key", "payload"}, pgx.CopyFromRows(rows))
			return err // any other error or a panic: the batch is split until the culprit runs alone
		}))
	// endsnippet
}

func docsBloom(ctx context.Context, store *postgres.Store, router *message.Router, poison *middleware.Poison) error {
	// snippet:bloom
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store, Consumer: "charge-orders"})
	if err != nil {
		return err
	}
	bloom, err := middleware.NewBloom(middleware.BloomConfig{
		Inbox:        inbox,     // its store, key, consumer and window
		ExpectedKeys: 2_000_000, // per window; 9.59 bits/key at the default 1%
	})
	if err != nil {
		return err
	}
	if _, err := bloom.Warm(ctx); err != nil { // streams the window's done keys from the store
		return err
	}
	router.AddMiddleware(poison.Middleware, bloom.Middleware, inbox.Middleware)
	// endsnippet
	return nil
}

func docsTwoTier(pool *pgxpool.Pool) (*middleware.Inbox, error) {
	// snippet:twotier
	lock, err := redis.New(redis.Config{Client: goredis.NewClient(&goredis.Options{Addr: "127.0.0.1:6379"})})
	if err != nil {
		return nil, err
	}
	record, err := postgres.New(pool, postgres.Config{})
	if err != nil {
		return nil, err
	}
	store, err := twotier.New(twotier.Config{Lock: lock, Record: record})
	if err != nil {
		return nil, err
	}
	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store}) // handler: postgres.Tx(ctx) as before
	if err != nil {
		return nil, err
	}
	// endsnippet
	return inbox, nil
}

func docsJanitor(ctx context.Context, store *postgres.Store) error {
	// snippet:janitor
	if _, err := dedup.Sweep(ctx, store, 1000); err != nil { // once: expired rows, 1,000 per statement
		return err
	}
	janitor, err := dedup.NewJanitor(store, dedup.JanitorConfig{}) // every minute, in one goroutine
	if err != nil {
		return err
	}
	defer janitor.Close()
	// endsnippet
	return nil
}
