package dlq_test

// The code of docs/brokers.md and docs/operations.md, between
// "// snippet:NAME" and "// endsnippet" lines; internal/docsnippets checks
// that the pages show it as it is here. It needs PostgreSQL and a broker,
// so it is compiled, not run.

import (
	"context"
	"net/http"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/sqlschema"
)

func docsOpen(ctx context.Context, router *message.Router, charge message.NoPublishHandlerFunc) error {
	// snippet:open
	ps, err := adapters.Open(ctx, os.Getenv("BROKER_URL"), adapters.Options{ConsumerGroup: "billing"})
	if err != nil {
		return err // unknown scheme, bad or missing parameter, unreachable broker; never the password
	}
	defer ps.Close()
	router.AddConsumerHandler("charge-orders", "orders", ps.Subscriber, charge)
	// endsnippet
	return router.Run(ctx)
}

func docsReplays(pool *pgxpool.Pool, ps *adapters.PubSub, router *message.Router, charge message.NoPublishHandlerFunc) error {
	// snippet:replays
	replays, err := dlq.NewReplaySubscriber(pool, sqlschema.Config{}, dlq.ReplaySubscriberConfig{Consumer: "charge-orders"})
	if err != nil {
		return err
	}
	router.AddConsumerHandler("charge-orders", "orders", dlq.WithReplays(ps.Subscriber, replays), charge)
	// endsnippet
	return nil
}

func docsConsole(pool *pgxpool.Pool, mux *http.ServeMux) error {
	// snippet:console
	c, err := console.New(console.Config{Pool: pool, Token: os.Getenv("ONCEMILL_CONSOLE_TOKEN")})
	if err != nil {
		return err
	}
	mux.Handle("/oncemill/", http.StripPrefix("/oncemill", c))
	// endsnippet
	return nil
}
