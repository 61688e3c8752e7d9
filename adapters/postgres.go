package adapters

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"
)

// openPostgres opens watermill-sql v4 on PostgreSQL through pgx: one table
// per topic, offsets per consumer group. The URL's own parameters (group)
// are removed before the rest reaches pgx.
func openPostgres(ctx context.Context, u *url.URL, opts Options) (*PubSub, error) {
	grp := group(u, opts)
	dsn := *u
	q := dsn.Query()
	q.Del("group")
	dsn.RawQuery = q.Encode()

	pool, err := pgxpool.New(ctx, dsn.String())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadURL, err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("postgres unreachable: %w", err)
	}
	closePool := func() error { pool.Close(); return nil }

	db := wsql.BeginnerFromPgx(pool)
	// BYTEA, not the default JSON: a broker carries any payload, and a
	// malformed one must reach the handler chain (and the DLQ), not fail
	// the publish.
	schema := wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{
		SchemaAdapter:        schema,
		AutoInitializeSchema: true,
	}, opts.Logger)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("watermill-sql publisher: %w", err), closePool())
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    grp,
		SchemaAdapter:    schema,
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, opts.Logger)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("watermill-sql subscriber: %w", err), pub.Close(), closePool())
	}
	return &PubSub{Publisher: pub, Subscriber: sub, closers: []func() error{closePool}}, nil
}
